"""Checkpoints and resume (issue 9): segments, optimizer states by layer, the checkpoint store, resume in virtual
time (bit-identical) and onto a new plan, the PS refusing bad updates, and bad input."""

import errno
import json
import shutil

import jax
import numpy as np
import optax
import pytest

from experiments.configs import tiny
from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.jobs import checkpoint
from hetpipe_jax.jobs import job_config
from hetpipe_jax.jobs import resume as resume_lib
from hetpipe_jax.jobs import virtual_job
from hetpipe_jax.jobs.job_config import ConfigError
from hetpipe_jax.ps.param_server import BadUpdateError, ParameterServer
from hetpipe_jax.rules.records import MinibatchRecord
from hetpipe_jax.runtime import opt_state
from hetpipe_jax.runtime import stages as stages_lib
from hetpipe_jax.runtime.param_layout import ParamLayout
from tests.mpi_util import read_jsonl


def _config(data_dir, **overrides):
  c = tiny.get_config()
  c.update({"data_dir": str(data_dir), "check_counts": False, "progress": False, "num_virtual_workers": 3,
            "num_inflight": 2, "staleness_bound": 1, "num_minibatches": 24, "emulate_stage_ms": "10,10;20,20;40,40",
            "checkpoint_every_waves": 4, **overrides})
  return c


def _run(config, workdir, resume=False):
  return virtual_job.run(job_config.resolve_job(config, "virtual", resume), str(workdir))


def _leaves_equal(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ---------------------------------------------------------------- pure pieces
@pytest.mark.parametrize("start,total,every,expected", [
    (0, 12, 4, [(0, 4), (4, 8), (8, 12)]),
    (0, 10, 4, [(0, 4), (4, 8), (8, 10)]),
    (0, 10, 0, [(0, 10)]),
    (8, 12, 4, [(8, 12)]),
    (5, 12, 4, [(5, 8), (8, 12)]),  # a resume onto a new Nm may start between multiples
    (0, 3, 4, [(0, 3)]),
])
def test_segments_end_at_multiples_of_the_interval(start, total, every, expected):
  assert resume_lib.segments(start, total, every) == expected


def test_segments_reject_bad_bounds():
  with pytest.raises(ValueError, match="outside the run's 4 waves"):
    resume_lib.segments(4, 4, 2)
  with pytest.raises(ValueError, match="must be >= 0"):
    resume_lib.segments(0, 4, -1)


def test_shift_record_moves_a_segment_into_the_runs_numbering():
  r = MinibatchRecord(1, 3, 1, 1, 9, 2, 0, (1, 0, 2), 0.5, 0.75)
  resume_lib.shift_record(r, resume_lib.Offsets(clock=8, minibatch=16, time_s=10.0))
  assert (r.minibatch_id, r.wave_id, r.local_clock_at_injection, r.version_local_updates, r.version_global_clock,
          r.version_vector_clock, r.inject_time_s, r.complete_time_s, r.version_id) == (
              19, 9, 9, 18, 8, (9, 8, 10), 10.5, 10.75, 9)


@pytest.mark.parametrize("tx", [optax.adam(1e-2), optax.sgd(0.1, momentum=0.9),
                                optax.chain(optax.clip(1.0), optax.adam(optax.cosine_decay_schedule(1e-2, 50)))],
                         ids=["adam", "momentum", "clip+adam+schedule"])
def test_optimizer_state_by_layer_moves_between_partitions(tx):
  """A state split by layer under one partition and joined under another equals the state of training the whole
  model with that optimizer (the reference: one stage)."""
  spec = models.get_model("cnn_small")
  params = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  state = tx.init(params)
  for k in range(3):
    grads = jax.tree.map(lambda p, k=k: np.full_like(p, 0.01 * (k + 1)), params)
    _, state = tx.update(grads, state, params)
  pieces = [opt_state.split_by_layer(
      jax.device_get(_stage_state(tx, state, params, a, b)), params[a:b]) for a, b in ((0, 2), (2, 5), (5, 7))]
  scalars = pieces[0][0]
  per_layer = [layer for _, layers in pieces for layer in layers]
  rebuilt = opt_state.join_layers(tx, params, scalars, per_layer)
  assert jax.tree.structure(rebuilt) == jax.tree.structure(state)
  assert _leaves_equal(rebuilt, state)
  other = opt_state.join_layers(tx, params[1:4], scalars, per_layer[1:4])  # any other cut
  assert jax.tree.structure(other) == jax.tree.structure(tx.init(params[1:4]))


def _stage_state(tx, full_state, params, a, b):
  """The state a stage of layers [a, b) would hold: the full state's per-layer parts for its layers."""
  scalars, per_layer = opt_state.split_by_layer(full_state, params)
  return opt_state.join_layers(tx, params[a:b], scalars, per_layer[a:b])


def test_optimizer_state_of_another_optimizer_is_refused():
  spec = models.get_model("mlp_tiny")
  params = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  scalars, per_layer = opt_state.split_by_layer(optax.adam(1e-3).init(params), params)
  with pytest.raises(ValueError, match="another optimizer"):
    opt_state.join_layers(optax.sgd(0.1, momentum=0.9), params, scalars, per_layer)


def test_checkpoint_store_round_trip_and_falls_back_past_a_corrupt_checkpoint(tmp_path, caplog):
  spec = models.get_model("cnn_small")
  params = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  tx = optax.adam(1e-3)
  parts = opt_state.split_by_layer(tx.init(params), params)
  store = checkpoint.TrainingCheckpoints(tmp_path, max_to_keep=2)
  meta = {"num_layers": len(params), "opt_parts_per_layer": 2}
  for step in (4, 8, 12):
    got = store.save(step, params, {0: parts, 1: parts}, {**meta, "step": step})
    assert got["bytes"] > 0 and got["seconds"] >= 0
  assert store.steps() == [8, 12]  # max_to_keep
  step, weights, opts, got_meta = store.restore_latest()
  assert step == 12 and got_meta["step"] == 12 and _leaves_equal(weights, params)
  assert [jax.tree.structure(w) for w in weights] == [jax.tree.structure(p) for p in params]  # empty layers kept
  assert _leaves_equal(opt_state.join_layers(tx, params, *opts[1]), tx.init(params))
  for f in (tmp_path / "checkpoints" / "12").rglob("*"):  # corrupt the newest: every file truncated
    if f.is_file():
      f.write_bytes(b"")
  step, *_ = store.restore_latest()
  assert step == 8
  assert "checkpoints/12 is unreadable" in caplog.text
  store.close()


def test_parameter_server_refuses_nan_and_wrong_size_before_touching_the_weights():
  ps = ParameterServer(np.ones(4, np.float32), 2)
  bad = np.array([0.5, np.nan, np.inf, 0.0], np.float32)
  with pytest.raises(BadUpdateError, match=r"VW 1's update of wave 0 has 2 NaN/Inf values"):
    ps.push(1, 0, bad)
  with pytest.raises(BadUpdateError, match="VW 0 pushed 3 floats for wave 0; the model has 4"):
    ps.push(0, 0, np.zeros(3, np.float32))
  assert ps.weights.tolist() == [1, 1, 1, 1] and ps.state.applied == [] and ps.state.pushed_waves == [0, 0]


# ---------------------------------------------------------------- virtual time: interrupted and resumed
class _Interrupted(Exception):
  pass


def test_virtual_run_interrupted_and_resumed_is_bit_identical_to_the_uninterrupted_run(tmp_path, synthetic_data_dir,
                                                                                      monkeypatch):
  config = _config(synthetic_data_dir)
  full = _run(config, tmp_path / "full")
  assert [c["global_clock"] for c in full["checkpoints"]] == [4, 8, 12]
  # The same run, stopped right after its checkpoint of clock 8 (a crash: nothing after it is written).
  save = resume_lib.save_training_checkpoint

  def crash_after_8(store, step, *args):
    got = save(store, step, *args)
    if step == 8:
      raise _Interrupted()
    return got

  monkeypatch.setattr(resume_lib, "save_training_checkpoint", crash_after_8)
  with pytest.raises(_Interrupted):
    _run(config, tmp_path / "part")
  monkeypatch.setattr(resume_lib, "save_training_checkpoint", save)
  part = tmp_path / "part"
  assert not (part / "summary.json").exists()
  with pytest.raises(ConfigError, match="holds an unfinished run's checkpoints"):
    _run(config, part)  # without --resume nothing is overwritten
  resumed = _run(config, part, resume=True)
  assert [r["global_clock"] for r in resumed["resumes"]] == [8]
  assert _leaves_equal(checkpoint.restore_weights(tmp_path / "full" / "checkpoint"),
                       checkpoint.restore_weights(part / "checkpoint"))
  for name in ("minibatches.jsonl", "ps_applied.jsonl"):
    assert (tmp_path / "full" / name).read_text() == (part / name).read_text(), name
  # Across checkpoint segments the PS applied every VW's waves 0..11 once each (24 minibatches, Nm 2), in order.
  applied = [(r["vw_id"], r["wave_id"]) for r in read_jsonl(tmp_path / "full" / "ps_applied.jsonl")]
  assert sorted(applied) == [(v, w) for v in range(3) for w in range(12)]
  assert all([w for v2, w in applied if v2 == v] == list(range(12)) for v in range(3))
  strip = lambda rows: [{k: v for k, v in r.items() if k != "host_wall_time_s"} for r in rows]  # noqa: E731
  assert strip(read_jsonl(tmp_path / "full" / "metrics.jsonl")) == strip(read_jsonl(part / "metrics.jsonl"))
  for key in ("test_accuracy", "test_loss", "simulated_time_s", "applied_waves_count", "extra_updates",
              "max_clock_distance", "wait_s"):
    assert resumed[key] == full[key], key


@pytest.mark.parametrize("change,named", [
    ({"optimizer": "sgd", "learning_rate": 0.5},
     "config.optimizer='sgd' (the run used 'adam'); config.learning_rate=0.5"),
    ({"seed": 3}, "config.seed=3 (the run used 0)"),
    ({"batch_size": 16}, "config.batch_size=16 (the run used 32)"),
])
def test_a_resume_that_changes_the_training_is_refused(tmp_path, synthetic_data_dir, change, named):
  """The layout and the run's length may change on a resume; the training may not: another optimizer used to end in
  a traceback from deep in the optimizer state, a new learning rate, seed or batch size ran silently while
  config.json and the records called it one run. Now each is one error naming the settings, before any work."""
  _run(_config(synthetic_data_dir, checkpoint_every_waves=4, num_minibatches=8), tmp_path / "first")
  workdir = tmp_path / "run"
  workdir.mkdir()
  shutil.copytree(tmp_path / "first" / "checkpoints", workdir / "checkpoints")
  with pytest.raises(ConfigError, match=r"^--resume continues checkpoint 4 of .* with the same training, but ") as e:
    _run(_config(synthetic_data_dir, checkpoint_every_waves=4, num_minibatches=16, **change), workdir, resume=True)
  assert named in str(e.value) and "the layout and the run's length may change" in str(e.value)
  assert sorted(p.name for p in workdir.iterdir()) == ["checkpoints"]  # nothing written


@pytest.mark.parametrize("change", [{"partition": "0:1,1:4;0:3,3:4;0:2,2:4"}, {"num_inflight": 3},
                                    {"num_virtual_workers": 2, "emulate_stage_ms": "10,10;20,20"}],
                         ids=["partition", "num_inflight", "num_vws"])
def test_resume_onto_a_new_plan_continues_from_the_checkpoint(tmp_path, synthetic_data_dir, change):
  """The first minibatch each VW trains after the resume uses exactly the checkpoint's global weights: its recorded
  loss equals the model's loss at those weights on that minibatch (an oracle computed here, apart from the run), and
  it is far below the loss at the initial weights (training continued, not restarted)."""
  base = _config(synthetic_data_dir, checkpoint_every_waves=4, num_minibatches=16)
  interrupted = _config(synthetic_data_dir, checkpoint_every_waves=4, num_minibatches=8)  # stops at clock 4
  _run(interrupted, tmp_path / "first")
  workdir = tmp_path / "run"
  workdir.mkdir()
  shutil.copytree(tmp_path / "first" / "checkpoints", workdir / "checkpoints")
  config = _config(synthetic_data_dir, checkpoint_every_waves=4, num_minibatches=16, **change)
  summary = _run(config, workdir, resume=True)
  del base
  (resume,) = summary["resumes"]
  assert resume["global_clock"] == 4 and resume["notes"], resume
  n_old, n_new = 3, summary["num_virtual_workers"]
  start = 8 * n_old // n_new
  assert resume["minibatches_per_vw"] == start
  spec = models.get_model("mlp_tiny")
  _, weights, _, _ = checkpoint.TrainingCheckpoints(tmp_path / "first").restore_latest()
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)

  def loss(params, x, y):
    return float(stages_lib.cross_entropy_loss(models.apply_layers(spec.layers, params, x), y))

  records = read_jsonl(workdir / "minibatches.jsonl")
  for v in range(n_new):
    first = next(r for r in records if r["vw_id"] == v and r["minibatch_id"] == start)
    assert first["version_global_clock"] == 4 and first["version_local_updates"] == start
    x, y = sharding.ShardedMinibatches(dataset, n_new, v, 32, 0).get(start)
    assert first["loss"] == pytest.approx(loss(weights, x, y), rel=1e-5)
    assert first["loss"] < 0.7 * loss(params0, x, y)
  assert ParamLayout.from_layer_params(params0).num_params > 0


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path, synthetic_data_dir):
  _run(_config(synthetic_data_dir, num_minibatches=8), tmp_path / "first")
  workdir = tmp_path / "run"
  workdir.mkdir()
  shutil.copytree(tmp_path / "first" / "checkpoints", workdir / "checkpoints")
  before = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*"))
  with pytest.raises(ConfigError, match="was written for model 'mlp_tiny'.*this run's model is 'cnn_small'"):
    _run(_config(synthetic_data_dir, model="cnn_small", num_minibatches=16), workdir, resume=True)
  assert sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*")) == before  # nothing lost or added
  assert "checkpoints/4" in before


def test_resume_needs_checkpoints(tmp_path, synthetic_data_dir):
  with pytest.raises(ConfigError, match="has no checkpoints to resume from"):
    _run(_config(synthetic_data_dir), tmp_path / "empty", resume=True)


def test_an_unwritable_workdir_fails_before_any_work(tmp_path, synthetic_data_dir):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")  # a workdir below a file cannot be created, even by root
  with pytest.raises(ConfigError, match="cannot be written"):
    _run(_config(synthetic_data_dir), blocker / "run")
  assert blocker.read_text() == "not a directory"


def test_config_records_the_checkpoint_settings(tmp_path, synthetic_data_dir):
  summary = _run(_config(synthetic_data_dir, num_minibatches=8), tmp_path / "run")
  config = json.loads((tmp_path / "run" / "config.json").read_text())
  assert config["checkpoint_every_waves"] == summary["checkpoint_every_waves"] == 4
  assert [c["global_clock"] for c in summary["checkpoints"]] == [4]
  store = checkpoint.TrainingCheckpoints(tmp_path / "run")
  step, _, _, meta = store.restore_latest()
  store.close()
  # A checkpoint says where it came from: the config as it ran, the plan (none here) and the code version.
  assert step == 4 and meta["config"] == config and meta["plan"] is None and meta["code_version"] not in ("", None)
  assert meta["minibatches_done_per_vw"] == 8 and meta["num_inflight"] == 2 and len(meta["records"]) == 3 * 8


def test_a_full_disk_while_saving_stops_with_one_error_and_the_earlier_checkpoints_resume(tmp_path, synthetic_data_dir,
                                                                                         monkeypatch):
  """A save that fails (ENOSPC) stops the run with one ConfigError naming the clock and the fix; the checkpoint
  before it stays loadable and a resume from it finishes with the uninterrupted run's weights."""
  config = _config(synthetic_data_dir)
  full = _run(config, tmp_path / "full")
  save = checkpoint.TrainingCheckpoints.save

  def disk_full_at_8(self, step, *args, **kwargs):
    if step == 8:
      raise OSError(errno.ENOSPC, "No space left on device")
    return save(self, step, *args, **kwargs)

  monkeypatch.setattr(checkpoint.TrainingCheckpoints, "save", disk_full_at_8)
  with pytest.raises(ConfigError, match=r"global clock 8 could not be written.*No space left on device.*--resume"):
    _run(config, tmp_path / "part")
  monkeypatch.setattr(checkpoint.TrainingCheckpoints, "save", save)
  store = checkpoint.TrainingCheckpoints(tmp_path / "part", max_to_keep=3)
  assert store.steps() == [4]
  store.close()
  resumed = _run(config, tmp_path / "part", resume=True)
  assert [r["global_clock"] for r in resumed["resumes"]] == [4]
  assert _leaves_equal(checkpoint.restore_weights(tmp_path / "full" / "checkpoint"),
                       checkpoint.restore_weights(tmp_path / "part" / "checkpoint"))
  assert resumed["test_accuracy"] == full["test_accuracy"]
