"""What the paper-reproduction scripts share: profiles, sub-clusters, engine settings, claims and result files.

Every script writes ``experiments/paper/results/<name>.json`` (or under ``--results_dir``) with a top-level
``"claims"`` list (:func:`claim`), ``"png"`` (path relative to the repository root when under it) and ``"markdown"``
(the table), plus ``<name>.md`` and ``<name>.png``. :mod:`experiments.paper.reproduction` reads them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.costs import cost_model
from hetpipe_jax.costs import profile_format
from hetpipe_jax.costs.cluster import ClusterSpec, sub_cluster  # noqa: F401  (sub_cluster: used by the paper scripts)
from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.planning import compare as compare_lib

RESULTS_DIR = str(REPO_ROOT / "experiments" / "paper" / "results")
CLUSTER = "hetpipe_paper"
PYTHON = ".venv/bin/python"
# The in-flight memory count of the HetPipe predictions (``CostModelConfig.inflight_memory``): each stage's peak under
# the schedule rules at the plan's task times (the engine runs exactly those times, so the bound is safe for what is
# predicted; ``hetpipe_jax.sim.inflight_memory``). Plans that run keep the planner's default, "conservative".
INFLIGHT_MEMORY = "schedule"


def load_profile(model: str, batch_size: int = 32) -> profile_format.ModelProfile:
  """The saved cost-only profile of ``model`` (``experiments/profiles/<model>_b<batch>_cpu_costonly.json``)."""
  return profile_format.load_profile(
      str(REPO_ROOT / "experiments" / "profiles" / f"{model}_b{batch_size}_cpu_costonly.json"))


def stats(xs) -> dict:
  """Mean, sample standard deviation (0 for one value), min, max and count of the values that are not None (all
  None when there are none)."""
  xs = [x for x in xs if x is not None]
  if not xs:
    return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
  a = np.asarray(xs, dtype=float)
  return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0, "min": float(a.min()),
          "max": float(a.max()), "n": len(a)}


def cost_config() -> cost_model.CostModelConfig:
  """The cost-model settings of the HetPipe predictions (:data:`INFLIGHT_MEMORY`; everything else default)."""
  return cost_model.CostModelConfig(inflight_memory=INFLIGHT_MEMORY)


def compare_config(quick: bool, staleness_bound: int = 0) -> compare_lib.CompareConfig:
  """The engine settings of the throughput experiments: HetPipe §5's pull policy (``pull_every_wave=False``), D,
  and every other engine setting at its default (PS apply on receipt, PS link contention as the engine's default),
  so a change of the engine's defaults reaches these scripts."""
  return compare_lib.CompareConfig(num_vws=4, staleness_bound=staleness_bound, pull_every_wave=False,
                                   num_waves=8 if quick else 40)


def engine_shares_nics() -> bool:
  """Whether the engine's default models VWs sharing a node's network interface (``EngineConfig.shared_nic``, added
  by the NIC work): the scripts name "no shared NIC" as a cause of a miss only when it does not."""
  from hetpipe_jax.sim import engine  # pylint: disable=g-import-not-at-top
  fields = {f.name: f for f in dataclasses.fields(engine.EngineConfig)}
  return "shared_nic" in fields and bool(fields["shared_nic"].default)


def rel_error(ours: float | None, paper: float | None) -> float | None:
  """``ours / paper - 1`` (None when either is missing or the paper's is 0)."""
  if ours is None or paper is None or paper == 0:
    return None
  return ours / paper - 1.0


def fmt_error(err: float | None) -> str:
  return "-" if err is None else f"{100 * err:+.0f}%"


def claim(claim_text: str, paper: Any, ours: Any, difference: str, why: str, command: str,
          calibrated: bool) -> dict[str, Any]:
  """One row of REPRODUCTION.md (the convention shared by every results JSON)."""
  return {"claim": claim_text, "paper": paper, "ours": ours, "difference": difference, "why": why,
          "command": command, "calibrated": bool(calibrated)}


def command(script: str) -> str:
  return f"{PYTHON} experiments/paper/{script}.py"


def _rel(path: str) -> str:
  try:
    return os.path.relpath(path, REPO_ROOT) if os.path.abspath(path).startswith(str(REPO_ROOT) + os.sep) else path
  except ValueError:
    return path


def write_results(results_dir: str, name: str, payload: dict[str, Any], markdown: str, figure) -> str:
  """Writes ``<name>.json`` (``payload`` + ``png`` + ``markdown``), ``<name>.md`` and ``<name>.png`` (``figure``: a
  matplotlib figure, closed here). Returns the JSON path.

  Raises:
    ValueError: ``payload`` lacks a ``claims`` list.
  """
  if not isinstance(payload.get("claims"), list):
    raise ValueError(f"results {name!r}: payload needs a 'claims' list")
  os.makedirs(results_dir, exist_ok=True)
  png = os.path.join(results_dir, f"{name}.png")
  figure.savefig(png, dpi=90)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  plt.close(figure)
  with open(os.path.join(results_dir, f"{name}.md"), "w", encoding="utf-8") as f:
    f.write(markdown + "\n")
  path = os.path.join(results_dir, f"{name}.json")
  from hetpipe_jax.sim.engine_report import json_safe  # pylint: disable=g-import-not-at-top
  with open(path, "w", encoding="utf-8") as f:
    json.dump(json_safe({**payload, "png": _rel(png), "markdown": markdown}), f, indent=1)
  return path


def print_results(path: str) -> None:
  """A script's ending: prints the Markdown table written beside the results JSON ``path``, then the path."""
  with open(path.replace(".json", ".md"), encoding="utf-8") as f:
    print(f.read())
  print(f"wrote {path}")


def pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def load_cluster(name: str = CLUSTER) -> ClusterSpec:
  return cluster_lib.load_cluster(name)
