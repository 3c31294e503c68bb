"""The two-layer rule (STYLE.md): planning modules never load jax, flax, optax or mpi4py, even transitively."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLANNING_MODULES = ["schedule", "wsp", "records", "job_config", "cluster", "profile_format", "cost_model",
                    "partitioner", "partition_check", "inflight", "allocator", "ps_placement", "plan_format",
                    "planner", "task_times", "engine", "engine_report", "trace", "data"]
HEAVY = ["jax", "jaxlib", "flax", "optax", "mpi4py", "orbax"]


def test_planning_layer_loads_no_runtime_packages():
  code = (f"import importlib, json, sys\n"
          f"for m in {PLANNING_MODULES!r}: importlib.import_module('hetpipe_jax.' + m)\n"
          f"print(json.dumps(sorted({{n.split('.')[0] for n in sys.modules}} & set({HEAVY!r}))))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
  assert out.returncode == 0, out.stderr
  assert json.loads(out.stdout.strip().splitlines()[-1]) == []
