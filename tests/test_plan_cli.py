"""The planner CLI (``python -m hetpipe_jax.plan``), the plan file, and bad-input errors (HetPipe §4, §7, §8.1)."""

import json
import os
import resource
import subprocess
import sys

import pytest

from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.planning import plan_format



def _children_cpu_s() -> float:
  """CPU seconds (user + system) of this process's finished child processes."""
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def run_plan(*args, timeout=120):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT))
  return subprocess.run([sys.executable, "-m", "hetpipe_jax.plan", *args], cwd=REPO_ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


@pytest.mark.parametrize("model", ["resnet152_imagenet", "vgg19_imagenet"])
@pytest.mark.parametrize("policy", ["NP", "ED", "HD"])
def test_paper_plans(tmp_path, model, policy):
  out = tmp_path / "plan.json"
  t0 = _children_cpu_s()
  r = run_plan("--cluster=hetpipe_paper", f"--model={model}", "--batch_size=32", f"--policy={policy}",
               "--num_vws=4", f"--output={out}")
  assert r.returncode == 0, r.stderr[-2000:]
  assert _children_cpu_s() - t0 < 10.0  # the CLI's CPU seconds (a loaded machine does not inflate them)
  assert f"policy={policy}" in r.stdout and "minibatches/s" in r.stdout and "bytes crossing nodes" in r.stdout
  plan = plan_format.load_plan(str(out), expected_model=model)
  assert len(plan.virtual_workers) == 4 and plan.num_inflight >= 1
  d = json.loads(out.read_text())
  for key in ("format_version", "model", "batch_size", "cluster", "policy", "num_inflight", "virtual_workers",
              "predicted_total_minibatches_per_s", "ps_placement"):
    assert key in d
  for key in ("vw_id", "gpus", "gpu_types", "devices", "partition", "stage_time_ms", "stage_memory_bytes",
              "max_num_inflight", "predicted_minibatches_per_s"):
    assert key in d["virtual_workers"][0]


def test_inflight_memory_flag_is_used_and_recorded(tmp_path):
  # The setting reaches the plan (its cost_model entry) and the memory each stage is counted for; ResNet-152 on the
  # paper's cluster is bottleneck-last, so the schedule count equals the conservative one (same memory).
  plans = {}
  for mode in ("conservative", "schedule"):
    out = tmp_path / f"{mode}.json"
    r = run_plan("--cluster=hetpipe_paper", "--model=resnet152_imagenet", "--policy=ED", "--num_vws=4",
                 f"--inflight_memory={mode}", f"--output={out}")
    assert r.returncode == 0, r.stderr[-2000:]
    plans[mode] = json.loads(out.read_text())
    assert plans[mode]["cost_model"]["inflight_memory"] == mode
  assert ([v["stage_memory_bytes"] for v in plans["schedule"]["virtual_workers"]]
          == [v["stage_memory_bytes"] for v in plans["conservative"]["virtual_workers"]])
  r = run_plan("--cluster=hetpipe_paper", "--model=resnet152_imagenet", "--method=pipedream",
               "--inflight_memory=schedule")
  assert r.returncode != 0 and "--inflight_memory=schedule is for --method=hetpipe" in r.stderr


def write_cluster(tmp_path, mutate):
  d = json.loads((REPO_ROOT / "experiments/clusters/hetpipe_paper.json").read_text())
  mutate(d)
  p = tmp_path / "c.json"
  p.write_text(json.dumps(d))
  return str(p)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["nodes"][2]["gpus"].__setitem__(1, "GTX 480"), "unknown GPU type 'GTX 480'"),
    (lambda d: d["intra_node_link"].__setitem__("bandwidth_bytes_per_s", -1), "bandwidth_bytes_per_s must be positive"),
    (lambda d: d["gpu_types"][3].__setitem__("memory_bytes", 0), "'Quadro P4000': memory_bytes must be positive"),
    (lambda d: [t.__setitem__("memory_bytes", 2**30) for t in d["gpu_types"]] and
     [t.__setitem__("reserved_bytes", 0) for t in d["gpu_types"]], "fits no partition even with num_inflight=1"),
])
def test_bad_cluster_inputs(tmp_path, mutate, message):
  r = run_plan(f"--cluster={write_cluster(tmp_path, mutate)}", "--model=vgg19_imagenet", "--policy=NP")
  assert r.returncode != 0
  assert message in r.stderr


def test_unknown_model():
  r = run_plan("--cluster=hetpipe_paper", "--model=alexnet_imagenet")
  assert r.returncode != 0 and "unknown model 'alexnet_imagenet'" in r.stderr


def test_a_model_no_allocation_fits_is_one_error_line(tmp_path):
  """GPT-2 large at batch 2 fits no HD virtual worker of the paper's cluster (its TITAN V / P4000 VWs): the planner
  says so in one line naming the settings and the overflowing stages, exit 2, no traceback, no plan written."""
  out = tmp_path / "plan.json"
  r = run_plan("--cluster=hetpipe_paper", "--model=gpt2_large", "--batch_size=2", "--policy=HD", "--num_vws=4",
               f"--output={out}")
  assert r.returncode == 2, r.stderr
  lines = [l for l in r.stderr.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and "--model=gpt2_large" in lines[0] and "fits no partition" in lines[0]
  assert "GiB usable" in lines[0] and "Traceback" not in r.stderr
  assert not out.exists()


def test_a_model_with_fewer_layers_than_a_vws_gpus_is_one_error_line(tmp_path):
  """ED with 2 VWs gives each VW 8 GPUs of the paper's cluster; the CNN has 7 layers, so no VW can be partitioned:
  one `error:` line naming the settings and the fix, exit 2, no traceback, no plan written."""
  out = tmp_path / "plan.json"
  r = run_plan("--cluster=hetpipe_paper", "--model=cnn", "--batch_size=64", "--policy=ED", "--num_vws=2",
               f"--output={out}")
  assert r.returncode == 2, r.stderr
  lines = [l for l in r.stderr.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and "--model=cnn" in lines[0] and "--num_vws=2" in lines[0], r.stderr
  assert "7 layers, fewer than the 8 GPUs" in lines[0] and "more virtual workers" in lines[0]
  assert "Traceback" not in r.stderr and not out.exists()


def test_unknown_cluster():
  r = run_plan("--cluster=moon_base", "--model=vgg19_imagenet")
  assert r.returncode != 0 and "unknown cluster 'moon_base'" in r.stderr


def test_plan_for_another_model_is_rejected(tmp_path):
  out = tmp_path / "plan.json"
  assert run_plan("--cluster=hetpipe_paper", "--model=vgg19_imagenet", "--policy=ED", f"--output={out}").returncode == 0
  with pytest.raises(ValueError, match=r"'vgg19_imagenet'.*'resnet152_imagenet'"):
    plan_format.load_plan(str(out), expected_model="resnet152_imagenet")
  d = json.loads(out.read_text())
  d["virtual_workers"][1]["partition"][1][0] += 1
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps(d))
  with pytest.raises(ValueError, match="virtual worker 1: partition .* does not cover"):
    plan_format.load_plan(str(bad))
  d = json.loads(out.read_text())
  d["format_version"] = 99
  bad.write_text(json.dumps(d))
  with pytest.raises(ValueError, match="format_version 99"):
    plan_format.load_plan(str(bad))


def test_shipped_local_cpu_plan_is_valid():
  plan = plan_format.load_plan(str(REPO_ROOT / "experiments/plans/local_cpu_cnn_b64.json"), expected_model="cnn")
  assert plan.cluster == "local_cpu" and plan.profile["measured"]
  assert [vw.devices for vw in plan.virtual_workers] == [(0, 1), (2, 3)]




def test_max_vw_gpus_flag_is_used_and_recorded(tmp_path):
  # --policy=auto searches VWs of at most --max_vw_gpus GPUs: 16 GPUs in 4 VWs with at most 4 each leaves equal VWs
  # only (4 x 4); the value and its source are recorded in the plan's allocation_search.
  out = tmp_path / "auto.json"
  r = run_plan("--cluster=hetpipe_paper", "--model=resnet152_imagenet", "--policy=auto", "--num_vws=4",
               "--max_vw_gpus=4", f"--output={out}")
  assert r.returncode == 0, r.stderr[-2000:]
  plan = json.loads(out.read_text())
  assert plan["allocation_search"]["max_vw_gpus"] == 4
  assert "default" not in plan["allocation_search"]["max_vw_gpus_source"]
  assert sorted(len(v["gpus"]) for v in plan["virtual_workers"]) == [4, 4, 4, 4]
  for args, message in ((["--policy=ED", "--max_vw_gpus=4"], "--max_vw_gpus applies to --policy=auto only"),
                        (["--policy=auto", "--max_vw_gpus=0"], "--max_vw_gpus must be >= 1")):
    r = run_plan("--cluster=hetpipe_paper", "--model=resnet152_imagenet", "--num_vws=4", *args)
    assert r.returncode != 0 and message in r.stderr


@pytest.mark.parametrize("method,flag", [("hetpipe", "--remat"), ("pipedream", "--remat"),
                                         ("gpipe", "--ps_placement=local"), ("horovod", "--ps_placement=default"),
                                         ("horovod", "--policy=HD"), ("horovod", "--num_vws=2")])
def test_a_flag_the_method_does_not_use_is_one_error_line(tmp_path, method, flag):
  """``--remat`` with hetpipe used to be dropped (the plan's memory without it, ``remat: false``), with pipedream
  recorded as ``remat: true`` without changing the plan; ``--ps_placement`` with an all-reduce method and
  ``--policy``/``--num_vws`` with Horovod were dropped. Now: one ``error:`` line naming the flag, exit 2, no plan."""
  out = tmp_path / "plan.json"
  r = run_plan("--model=cnn", "--batch_size=64", f"--method={method}", flag, f"--output={out}")
  name = flag.split("=")[0]
  assert r.returncode == 2 and r.stderr.startswith(f"error: {name}="), r.stderr[-2000:]
  assert f"is not used by --method={method}: leave it out" in r.stderr and not out.exists()


def test_flags_a_method_uses_still_run():
  """The same flags where the method uses them (and ``--noremat`` anywhere) are accepted."""
  for args in (("--method=gpipe", "--remat"), ("--method=horovod", "--remat"), ("--method=hetpipe", "--noremat"),
               ("--method=pipedream", "--ps_placement=local"), ("--method=gpipe", "--num_vws=2")):
    r = run_plan("--model=cnn", "--batch_size=64", *args)
    assert r.returncode == 0, (args, r.stderr[-2000:])


def test_an_invalid_micro_batch_count_is_one_error_line():
  r = run_plan("--model=cnn", "--batch_size=64", "--method=horovod", "--num_inflight=3")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert "error: no plan for" in r.stderr and "num_microbatches=3 must be >= 1 and divide the batch size 64" in r.stderr
