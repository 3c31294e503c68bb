"""Job settings without MPI or jax: every plan-vs-config rule, the recorded values, and the bad-input messages."""

import json
import re

import pytest

from experiments.configs import default, tiny
from hetpipe_jax.jobs import emulation, job_config
from hetpipe_jax.jobs.job_config import ConfigError, resolve_settings, resolved_config
from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.planning import plan_format

PLAN = "experiments/plans/local_cpu_cnn_b64.json"


def _plan():
  # Read here with plain json, apart from the code under test.
  return json.loads((REPO_ROOT / PLAN).read_text())


def _default(**overrides):
  c = default.get_config()
  c.update(overrides)
  return c


def _tiny(**overrides):
  c = tiny.get_config()
  c.update(overrides)
  return c


def test_unset_plan_decided_settings_come_from_the_plan():
  plan = _plan()
  s = resolve_settings(_default())
  assert s.num_inflight == plan["num_inflight"] == 2
  assert s.num_virtual_workers == len(plan["virtual_workers"]) == 2
  assert [v.partition for v in s.vws] == [tuple(map(tuple, vw["partition"])) for vw in plan["virtual_workers"]]
  assert [v.partition for v in s.vws] == [((0, 2), (2, 7))] * 2
  assert s.num_stages == 2 and s.world_size == 3
  assert dict(s.sources) == {k: "plan" for k in job_config.PLAN_DECIDED}
  assert s.plan is not None and s.plan.model == "cnn" and not s.notes


def test_num_inflight_within_max_m_overrides_the_plan_and_says_so():
  s = resolve_settings(_default(num_inflight=4))
  assert s.num_inflight == 4
  assert "overrides the plan's Nm=2" in s.sources["num_inflight"]
  assert len(s.notes) == 1 and "config.num_inflight=4" in s.notes[0] and "Max_m=64" in s.notes[0]
  # The highest Nm the plan's memory allows is accepted; one more is an error naming both values and the fix.
  assert resolve_settings(_default(num_inflight=64)).num_inflight == 64
  with pytest.raises(ConfigError, match=r"config.num_inflight=65 exceeds the plan's Max_m=64 .*Nm=2.*at most 64"):
    resolve_settings(_default(num_inflight=65))


def test_num_inflight_equal_to_the_plan_is_recorded_as_such():
  s = resolve_settings(_default(num_inflight=2))
  assert s.num_inflight == 2 and s.sources["num_inflight"] == "config (= plan)" and not s.notes


@pytest.mark.parametrize("overrides,message", [
    ({"num_virtual_workers": 3}, r"config.num_virtual_workers=3 but the plan .* has 2 virtual workers"),
    ({"num_stages": 3}, r"config.num_stages=3 but the plan .* has \[2, 2\] stages"),
    ({"partition": "0:3,3:7"}, r"config.partition='0:3,3:7' but the plan .* has partition '0:2,2:7'"),
    ({"partition": ""}, r"config.partition='' but the plan .* has partition '0:2,2:7'"),  # "" = even split 0:4,4:7
    ({"partition": "0:2,2:7;0:3,3:7"}, r"has partition '0:2,2:7'"),
    ({"stage_devices": "1,0"}, r"config.stage_devices='1,0' but the plan places virtual worker 0 on devices \[0, 1\]"),
    ({"batch_size": 32}, r"the plan was made for batch size 64 but config.batch_size=32"),
])
def test_a_plan_decided_setting_that_disagrees_with_the_plan_is_an_error(overrides, message):
  with pytest.raises(ConfigError, match=message) as e:
    resolve_settings(_default(**overrides))
  assert "config.plan=" in str(e.value) or "batch_size" in str(e.value)  # says how to fix it


@pytest.mark.parametrize("overrides", [
    {"num_virtual_workers": 2}, {"num_stages": 2}, {"partition": "0:2,2:7"}, {"partition": "0:2,2:7;0:2,2:7"},
    {"stage_devices": "0,1"}])
def test_a_plan_decided_setting_equal_to_the_plan_is_accepted(overrides):
  s = resolve_settings(_default(**overrides))
  name = next(iter(overrides)) if "stage_devices" not in overrides else None
  if name:
    assert s.sources[name] == "config (= plan)"
  assert [v.partition for v in s.vws] == [((0, 2), (2, 7))] * 2


def test_without_a_plan_the_config_or_the_documented_defaults_run():
  s = resolve_settings(_tiny())
  assert (s.num_virtual_workers, s.num_stages, s.num_inflight) == (2, 2, 2)
  assert s.sources == {"num_virtual_workers": "default", "num_stages": "default", "num_inflight": "default",
                       "partition": "default (even split)"}
  s = resolve_settings(_tiny(num_virtual_workers=3, num_stages=3, num_inflight=4, partition="0:1,1:2,2:3"))
  assert (s.num_virtual_workers, s.num_stages, s.num_inflight) == (3, 3, 4)
  assert all(v.partition == ((0, 1), (1, 2), (2, 3)) for v in s.vws)
  assert set(s.sources.values()) == {"config"}
  s = resolve_settings(_tiny(partition="0:1,1:3;0:2,2:3"))
  assert [v.partition for v in s.vws] == [((0, 1), (1, 3)), ((0, 2), (2, 3))]


def test_resolved_config_records_the_values_that_run():
  c = _default(num_inflight=4)
  s = job_config.resolve_job(c)
  d = resolved_config(s, [v.partition for v in s.vws])
  assert d["num_inflight"] == 4 and d["num_virtual_workers"] == 2 and d["num_stages"] == 2
  assert d["partition"] == "0:2,2:7"
  assert d["setting_sources"]["num_virtual_workers"] == "plan"
  assert c.num_inflight == 4 and c.num_stages is None  # the user's config is not mutated
  # Fed back as a config (with the plan), the recorded values resolve to the same settings.
  again = resolve_settings(_default(**{k: d[k] for k in job_config.PLAN_DECIDED}))
  assert again.num_inflight == 4 and [v.partition for v in again.vws] == [v.partition for v in s.vws]


def test_per_vw_partitions_are_recorded_per_vw():
  assert job_config.format_partitions([((0, 1), (1, 3)), ((0, 2), (2, 3))]) == "0:1,1:3;0:2,2:3"
  assert job_config.format_partitions([((0, 1), (1, 3))] * 3) == "0:1,1:3"


@pytest.mark.parametrize("overrides,message", [
    ({"num_inflight": 0}, r"config.num_inflight=0: must be >= 1"),
    ({"num_virtual_workers": 0}, r"config.num_virtual_workers=0"),
    ({"num_stages": 0}, r"config.num_stages=0"),
    ({"staleness_bound": -1}, r"config.staleness_bound=-1: D must be >= 0"),
    ({"batch_size": 0}, r"config.batch_size=0"),
    ({"platform": "tpu"}, r"config.platform='tpu'"),
    ({"optimizer": "lamb"}, r"config.optimizer='lamb'"),
    ({"lr_schedule": "step"}, r"config.lr_schedule='step'"),
    ({"warmup_minibatches": 10}, r"config.warmup_minibatches=10 is used only by config.lr_schedule='warmup_cosine'"),
    ({"lr_schedule": "warmup_cosine"}, r"config.warmup_minibatches=0 is used only by .*needs it > 0"),
    ({"ps_apply": "batched"}, r"config.ps_apply='batched' must be 'on_receipt'"),
    ({"learning_rate": 0.0}, r"config.learning_rate=0.0"),
    ({"adam_b1": 1.0}, r"config.adam_b1=1.0 must be in \[0, 1\)"),
    ({"adam_b2": -0.1}, r"config.adam_b2=-0.1 must be in \[0, 1\)"),
    ({"optimizer": "sgd", "adam_b1": 0.5}, r"config.adam_b1=0.5 is an Adam setting; config.optimizer='sgd'"),
    ({"grad_clip_norm": -1.0}, r"config.grad_clip_norm=-1.0 must be >= 0"),
    ({"partition": "0-3,3-7"}, r"config.partition='0-3,3-7' is malformed"),
    ({"partition": "0:1,1:2,2:3"}, r"has \[3\] ranges but config.num_stages=2"),
    ({"partition": "0:1,1:3;0:1,1:3;0:1,1:3"}, r"gives 3 partitions for 2 virtual workers"),
    ({"stage_devices": "a,b"}, r"config.stage_devices='a,b' is malformed"),
    ({"stage_devices": "0"}, r"lists 1 devices for 2 stages"),
    ({"stage_devices": "1,-1"}, r"config.stage_devices='1,-1' must be non-negative device indices"),
    ({"emulate_stage_ms": "20,x"}, r"config.emulate_stage_ms='20,x' is malformed"),
    ({"emulate_stage_ms": "20,40,60"}, r"needs 2 times per VW for 2 VWs"),
    ({"emulate_stage_ms": "20,0"}, r"every time must be > 0"),
    ({"emulate_plan": True}, r"config.emulate_plan needs config.plan"),
    ({"method": "fsdp"}, r"config.method='fsdp' is planned and simulated .* not by hetpipe_jax.train"),
])
def test_bad_settings_name_the_setting(overrides, message):
  c = _tiny(**overrides)
  with pytest.raises(ConfigError, match=message):
    emulation.emulated_task_times(job_config.resolve_job(c))


def test_world_size_devices_and_partition_coverage():
  s = resolve_settings(_tiny(num_virtual_workers=3))
  job_config.check_world_size(s, 4)
  with pytest.raises(ConfigError, match=r"MPI world size is 3 but the job has 3 virtual workers.*mpiexec -n 4"):
    job_config.check_world_size(s, 3)
  with pytest.raises(ConfigError, match=r"2 stages need 2 local devices per VW but only 1"):
    job_config.check_devices(s, 1)
  assert job_config.check_partitions(s, 5) == [((0, 3), (3, 5))] * 3  # even split by layer count
  s = resolve_settings(_tiny(partition="0:1,2:4"))
  with pytest.raises(ConfigError, match="does not cover every layer exactly once"):
    job_config.check_partitions(s, 4)
  with pytest.raises(ConfigError, match="exceeds the model's 1 layers"):
    job_config.check_partitions(resolve_settings(_tiny()), 1)


def test_plan_file_errors(tmp_path):
  with pytest.raises(ConfigError, match=r"config.plan='nope.json'"):
    resolve_settings(_default(plan="nope.json"))
  with pytest.raises(ConfigError, match=r"made for model 'cnn', not for model 'mlp_tiny'"):
    resolve_settings(_default(model="mlp_tiny"))
  bad = _plan()
  bad["virtual_workers"][1]["partition"] = [[0, 3], [2, 7]]
  path = tmp_path / "bad.json"
  path.write_text(json.dumps(bad))
  with pytest.raises(ConfigError, match=r"virtual worker 1: partition .* does not cover every layer exactly once"):
    resolve_settings(_default(plan=str(path)))


def test_the_plan_is_read_once(monkeypatch):
  calls = []
  real = plan_format.load_plan
  monkeypatch.setattr(plan_format, "load_plan", lambda *a, **k: calls.append(a) or real(*a, **k))
  c = _default(emulate_plan=True)
  times = emulation.emulated_task_times(job_config.resolve_job(c))
  assert len(times) == 2 and len(calls) == 1


def _validated(c):
  """The MPI job's settings validation: resolve, with the PS methods' shards and stage ranks."""
  return job_config.resolve_job(c, "mpi")


# Issue 23 defect 3: per method-only setting, written out by hand (not from job_config.METHOD_SETTINGS), the methods
# that must accept it; every other method must refuse it with an error naming it. num_ps_shards=2 is refused by
# PipeDream too (per-stage updates with sharded PSs are not supported), by its own rule.
METHOD_SETTING_CASES = [
    ("num_ps_shards", 1, {"hetpipe", "pipedream"}),
    ("num_ps_shards", 2, {"hetpipe"}),
    ("ps_placement", "default", {"hetpipe", "pipedream"}),
    ("ps_apply", "clock_aligned", {"hetpipe", "pipedream"}),
    ("pull_every_wave", False, {"hetpipe", "pipedream"}),
    ("vertical_sync", True, {"pipedream"}),
    ("ps_staleness_scaling", "inverse", {"hetpipe", "pipedream"}),
    ("ps_staleness_alpha", 0.5, {"hetpipe", "pipedream"}),
    ("delay_compensation", "dc", {"hetpipe", "pipedream"}),
    ("stage_ranks", True, {"hetpipe"}),
    ("remat", True, {"gpipe", "1f1b_flush", "horovod"}),
    ("checkpoint_every_waves", 4, {"hetpipe", "pipedream"}),  # gpipe used to run without and record 0
]


@pytest.mark.parametrize("method", ["hetpipe", "pipedream", "gpipe", "1f1b_flush", "horovod"])
@pytest.mark.parametrize("name,value,accepted_by", METHOD_SETTING_CASES)
def test_every_method_refuses_the_settings_it_does_not_use(method, name, value, accepted_by):
  """Every method's settings go through the same validation: a setting the method does not use is refused naming it
  (GPipe, 1F1B-flush and Horovod used to run without a PS and record ``num_ps_shards: 2``); one it uses is accepted
  and recorded as it runs. The defaults of each method run."""
  base = {"method": method, "checkpoint_every_waves": 0, "eval_every_epochs": 0.0}
  if method == "horovod":
    base["num_stages"] = 1
  _validated(_tiny(**base))  # the defaults are accepted by every method
  c = _tiny(**{**base, name: value})
  if method not in accepted_by:
    with pytest.raises(ConfigError, match=rf"^config\.{name}={value!r}") as e:
      _validated(c)
    assert f"config.method={method!r}" in str(e.value)
    return
  if name == "ps_staleness_alpha":  # read only by the "exp" scaling (DEPENDENT_CASES)
    c = _tiny(**{**base, name: value, "ps_staleness_scaling": "exp"})
  s = _validated(c)
  recorded = resolved_config(s, job_config.check_partitions(s, 4))  # mlp_tiny: 4 layers
  assert recorded[name] == value and recorded["method"] == method
  if name == "num_ps_shards":
    assert s.num_ps_shards == value and s.world_size == value + s.num_virtual_workers


def _suggested_fixes(message):
  fixes = [("mpiexec", int(n)) for n in re.findall(r"mpiexec -n (-?\d+)", message)]
  fixes += [(k, int(v)) for k, v in re.findall(r"set config\.(\w+)=(-?\d+)", message)]
  return fixes


@pytest.mark.parametrize("method", ["hetpipe", "gpipe"])
def test_the_world_size_error_suggests_only_fixes_that_work(method):
  """Issue 23 defect 4: `mpiexec -n 3 ... --config.num_ps_shards=4` was told to "set config.num_virtual_workers=-1".
  Over worlds, shard counts and layouts, every fix the error suggests, applied, passes the world-size check."""
  checked = 0
  for shards in ((1, 2, 4) if method == "hetpipe" else (None,)):
    for partition in ("", "0:1,1:3;0:2,2:3"):  # one partition for every VW, or one per VW (fixes the VW count)
      over = {"method": method, "num_ps_shards": shards, "partition": partition, "checkpoint_every_waves": 0,
              "eval_every_epochs": 0.0}
      c = _tiny(**over)
      s = _validated(c)
      for world in range(1, 8):
        if world == s.world_size:
          job_config.check_world_size(s, world, c)
          continue
        with pytest.raises(ConfigError, match=rf"MPI world size is {world} but") as e:
          job_config.check_world_size(s, world, c)
        fixes = _suggested_fixes(str(e.value))
        assert fixes and fixes[0] == ("mpiexec", s.world_size), str(e.value)
        for key, v in fixes[1:]:
          assert key == "num_virtual_workers" and v >= 1, str(e.value)
          fixed = _validated(_tiny(**over, num_virtual_workers=v))
          job_config.check_world_size(fixed, world, c)
          checked += 1
        # The one VW count that fits, where the layout allows it, is suggested.
        fits = world - (shards if method == "hetpipe" else 0)
        assert (len(fixes) == 2) == (fits >= 1 and partition == ""), str(e.value)
  assert checked > 0
  s = _validated(_tiny(num_ps_shards=4, checkpoint_every_waves=0, eval_every_epochs=0.0))
  with pytest.raises(ConfigError) as e:
    job_config.check_world_size(s, 3)  # the case
  assert "mpiexec -n 6" in str(e.value) and "num_virtual_workers=" not in str(e.value).split("):")[-1]


def test_a_device_may_hold_several_stages():
  """One GPU running a whole VW (scripts/gpu_check.sh's main job: both stages on GPU 0): the stages share device 0,
  and the VW needs one local device."""
  s = resolve_settings(_tiny(plan="", stage_devices="0,0", platform="gpu"))
  assert [vw.devices for vw in s.vws] == [(0, 0), (0, 0)] and s.devices_needed == 1
  three = resolve_settings(_tiny(plan="", num_stages=3, stage_devices="1,1,0"))
  assert three.vws[0].devices == (1, 1, 0) and three.devices_needed == 2


# Section field -> the flat config field it holds, written out by hand (not from job_config._build_job).
JOB_FIELDS = {
    ("wsp", "staleness_bound"): "staleness_bound", ("wsp", "pull_every_wave"): "pull_every_wave",
    ("wsp", "ps_apply"): "ps_apply",
    ("ps", "staleness_scaling"): "ps_staleness_scaling", ("ps", "staleness_alpha"): "ps_staleness_alpha",
    ("optim", "optimizer"): "optimizer", ("optim", "learning_rate"): "learning_rate",
    ("optim", "lr_schedule"): "lr_schedule", ("optim", "warmup_minibatches"): "warmup_minibatches",
    ("optim", "momentum"): "momentum", ("optim", "adam_b1"): "adam_b1", ("optim", "adam_b2"): "adam_b2",
    ("optim", "weight_decay"): "weight_decay", ("optim", "muon_beta"): "muon_beta",
    ("optim", "grad_clip_norm"): "grad_clip_norm", ("optim", "delay_compensation"): "delay_compensation",
    ("optim", "dc_lambda"): "dc_lambda",
    ("checkpoint", "every_waves"): "checkpoint_every_waves", ("checkpoint", "max_to_keep"): "checkpoint_max_to_keep",
    ("emulation", "emulate_stage_ms"): "emulate_stage_ms", ("emulation", "emulate_plan"): "emulate_plan",
    ("emulation", "timing_plan"): "timing_plan",
    ("run", "num_epochs"): "num_epochs", ("run", "num_minibatches"): "num_minibatches",
    ("run", "log_every_waves"): "log_every_waves", ("run", "eval_every_epochs"): "eval_every_epochs",
    ("run", "eval_batch_size"): "eval_batch_size", ("run", "progress"): "progress",
    ("run", "save_task_trace"): "save_task_trace",
    ("data", "dataset"): "dataset", ("data", "data_dir"): "data_dir", ("data", "check_counts"): "check_counts",
    ("pipeline", "method"): "method", ("pipeline", "num_inflight"): "num_inflight",
    ("pipeline", "num_virtual_workers"): "num_virtual_workers", ("pipeline", "platform"): "platform",
    ("pipeline", "num_cpu_devices"): "num_cpu_devices", ("pipeline", "stage_rank_grouping"): "stage_rank_grouping",
}


def test_the_job_holds_every_flat_setting_as_given():
  """Every section of the Job holds its flat setting as the config gives it (each away from its default here, but
  ``num_epochs``: with ``num_minibatches`` set it is not read, and refused), so config.json (the flat config as it
  ran) and what runs agree; the fault drill's text is parsed once."""
  c = _tiny(staleness_bound=3, pull_every_wave=False, ps_apply="clock_aligned", ps_staleness_scaling="exp",
            ps_staleness_alpha=0.5, optimizer="nadamw", learning_rate=0.02, lr_schedule="warmup_cosine",
            warmup_minibatches=2, adam_b1=0.8, adam_b2=0.99, weight_decay=0.01, grad_clip_norm=0.5,
            delay_compensation="dc", dc_lambda=0.1, checkpoint_every_waves=7, checkpoint_max_to_keep=2,
            emulate_stage_ms="10,20", num_minibatches=8, log_every_waves=3, eval_every_epochs=0.5,
            eval_batch_size=100, progress=False, save_task_trace=True, debug_nan_update="1:2", seed=5, batch_size=16,
            num_inflight=4, num_virtual_workers=3, num_cpu_devices=4, data_dir="/x", check_counts=False)
  job = job_config.resolve_job(c, "virtual")
  for (section, field), name in JOB_FIELDS.items():
    assert getattr(getattr(job, section), field) == c[name], (section, field, name)
  assert (job.seed, job.batch_size, job.model) == (5, 16, "mlp_tiny")
  assert job.run.debug_nan_update == (1, 2) and job.resume is False and job.mode == "virtual"
  assert dict(job.flat) == c.to_dict()


def test_the_job_reads_every_layout_field_of_its_settings_through_its_sections():
  """The MPI helpers take a JobSettings or a Job: each layout field of JobSettings (every field but the model, plan,
  sources and notes) reads the same on the Job, and an MPI job's PS shards and placement are its ``ps`` section's."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from hetpipe_jax.jobs import job_ranks  # pylint: disable=g-import-not-at-top
  from hetpipe_jax.jobs.job import JobSettings  # pylint: disable=g-import-not-at-top
  c = _tiny(num_virtual_workers=2, num_inflight=3, staleness_bound=2, num_ps_shards=2)
  settings = job_ranks.with_stage_ranks(c, job_ranks.with_ps_shards(c, resolve_settings(c)))
  job = job_config.resolve_job(c, "mpi")
  layout = [f.name for f in dataclasses.fields(JobSettings) if f.name not in ("model", "plan", "sources", "notes")]
  assert len(layout) == 12
  for name in layout:
    assert getattr(job, name) == getattr(settings, name), name
  assert (job.num_ps_shards, job.ps_placement) == (job.ps.num_shards, job.ps.placement) == (2, settings.ps_placement)
  assert (job.world_size, job.num_ps_ranks) == (settings.world_size, 2)


@pytest.mark.parametrize("method,want", [("hetpipe", 100), ("pipedream", 100), ("gpipe", 0), ("1f1b_flush", 0),
                                         ("horovod", 0)])
def test_unset_checkpoint_every_waves_runs_the_methods_default_and_is_recorded_as_it_runs(method, want):
  """Unset, the PS methods checkpoint every 100 global-clock ticks and the all-reduce methods only save the final
  weights; config.json records the value that runs, from "default". Given, 0 runs for every method; above 0 the
  all-reduce methods refuse it, saying how to fix it (they used to run without checkpoints and record 0)."""
  extra = {"num_stages": 1} if method == "horovod" else {}
  c = _tiny(method=method, **extra)
  assert c.checkpoint_every_waves is None
  for config, every, source in ((c, want, "default"), (_tiny(method=method, checkpoint_every_waves=0, **extra), 0,
                                                       "config")):
    job = _validated(config)
    recorded = resolved_config(job, job_config.check_partitions(job, 4))
    assert job.checkpoint.every_waves == recorded["checkpoint_every_waves"] == every
    assert recorded["setting_sources"]["checkpoint_every_waves"] == source
  given = _tiny(method=method, checkpoint_every_waves=7, **extra)
  if want:
    assert _validated(given).checkpoint.every_waves == 7
    return
  with pytest.raises(ConfigError, match=r"^config\.checkpoint_every_waves=7 writes training checkpoints") as e:
    _validated(given)
  assert str(e.value).endswith("leave it unset or set --config.checkpoint_every_waves=0")


# Per setting that only a feature reads, written out by hand (not from job_checks.DEPENDENT_SETTINGS): a value away
# from its default, the settings that turn the feature off, and those that turn it on.
DEPENDENT_CASES = [
    ("dc_lambda", 0.5, {}, {"delay_compensation": "dc"}),
    ("ps_staleness_alpha", 0.5, {"ps_staleness_scaling": "inverse"}, {"ps_staleness_scaling": "exp"}),
    ("pipemare_warmup_minibatches", 7, {}, {"delay_scaled_lr": "pipemare"}),
    ("stage_rank_grouping", "node", {}, {"stage_ranks": True, "num_stages": 2}),
    ("checkpoint_max_to_keep", 2, {"checkpoint_every_waves": 0}, {"checkpoint_every_waves": 4}),
    ("checkpoint_max_to_keep", 2, {"method": "gpipe"}, {}),
    ("num_epochs", 2.0, {"num_minibatches": 8}, {"num_minibatches": 0}),  # tiny.py runs 40 minibatches per VW
    ("num_epochs", 2.0, {}, {}),
]


@pytest.mark.parametrize("name,value,off,on", DEPENDENT_CASES)
def test_a_setting_given_while_the_feature_reading_it_is_off_is_refused(name, value, off, on):
  """These used to be accepted and recorded in config.json while nothing read them (``dc_lambda`` without
  delay compensation, ...): now they are refused naming the setting and what uses it; with the feature on they run
  as given."""
  with pytest.raises(ConfigError, match=rf"^config\.{name}={value!r} is used only with ") as e:
    _validated(_tiny(**{**off, name: value}))
  assert f"leave config.{name} at its default" in str(e.value)
  if on:
    job = _validated(_tiny(**{**on, name: value}))
    assert dict(job.flat)[name] == value


def test_emulate_plan_unset_true_and_false_in_virtual_time():
  """Virtual time needs task durations. Unset, it takes the plan's (recorded emulate_plan=True); True, the same;
  False with no emulate_stage_ms or timing_plan leaves none and is refused (it used to run the plan's times and
  record True); False beside emulate_stage_ms runs those. Under MPI unset is recorded as False (no emulation)."""
  for given, recorded in ((None, True), (True, True)):
    job = job_config.resolve_job(_default(**({} if given is None else {"emulate_plan": given})), "virtual")
    times, emulate_plan = emulation.virtual_task_times(job)
    assert emulate_plan is recorded and len(times) == 2
  with pytest.raises(ConfigError, match=r"^config\.emulate_plan=False leaves --mode=virtual without task durations"):
    emulation.virtual_task_times(job_config.resolve_job(_default(emulate_plan=False), "virtual"))
  job = job_config.resolve_job(_default(emulate_plan=False, emulate_stage_ms="10,20"), "virtual")
  times, emulate_plan = emulation.virtual_task_times(job)
  assert emulate_plan is False and len(times) == 2
  mpi = job_config.resolve_job(_default(), "mpi")
  assert resolved_config(mpi, job_config.check_partitions(mpi, 7))["emulate_plan"] is False


@pytest.mark.parametrize("overrides,message", [
    ({"stage_ranks": True, "num_stages": 2}, "config.stage_ranks=True: virtual time runs every VW's stages in its one "
     "process"),
    ({"num_ps_shards": 2}, "config.num_ps_shards=2: virtual time runs one in-process PS"),
])
def test_mpi_only_layouts_are_refused_in_virtual_time(overrides, message):
  """Virtual time runs one process and one PS: stage ranks used to be accepted there and recorded as
  ``stage_ranks: true`` in config.json while every stage ran in the one process. The same settings run under MPI."""
  with pytest.raises(ConfigError, match="^" + re.escape(message)):
    job_config.resolve_job(_tiny(**overrides), "virtual")
  job = job_config.resolve_job(_tiny(**overrides), "mpi")
  assert job.pipeline.stage_ranks == overrides.get("stage_ranks", False) and job.num_ps_shards == overrides.get(
      "num_ps_shards", 1)
