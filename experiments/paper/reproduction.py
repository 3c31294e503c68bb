r"""Writes REPRODUCTION.md (repository root) from ``experiments/paper/results/*.json``: every §8 claim of the HetPipe
paper, the paper's number, ours, the difference, why, whether the cell is calibration, and its re-run command.

  .venv/bin/python experiments/paper/reproduction.py [--run_all | --quick] [--results_dir=...] [--output=...]

Numbers come from the results files only (written by ``calibration.py``, ``table3.py``, ``fig4.py``, ``table4.py``
and the convergence scripts of branch ``paper-conv``); nothing is typed here. Each results JSON has a top-level
``"claims"`` list of ``{"claim", "paper", "ours", "difference", "why", "command", "calibrated"}``, ``"png"`` (path
relative to the repository root) and ``"markdown"`` (its table). A file in ``SECTIONS`` that is missing becomes a
"not run yet" row (with the paper's claims it would cover and the command that makes it); a results file not in
``SECTIONS`` is appended as its own section, so a new script needs no change here to appear. A results file's optional
``"beside"`` map (section stem -> Markdown lines) adds its rows under another section's table (the staleness study's
time-to-target rows beside Figures 5 and 6).

``--quick`` first runs the throughput scripts' quick modes into ``--results_dir`` (seconds; for tests and CI, not a
result), ``--run_all`` their full settings (about a minute on 2 cores), then writes the page.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import sys
from typing import Any

if str(pathlib.Path(__file__).resolve().parents[2]) not in sys.path:  # run as a file: find the package
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from absl import app, flags  # noqa: E402

from experiments.paper import common  # noqa: E402
from experiments.paper import paper_tables as pt  # noqa: E402
from hetpipe_jax.paths import REPO_ROOT  # noqa: E402

# (results file stem, section title, command, the paper's claims the file covers when it is missing).
SECTIONS = (
    ("calibration", "Calibration set (Table 4, Horovod row)", common.command("calibration"),
     [f"Table 4 Horovod {pt.MODEL_NAMES[m]} {c}: {v} images/s" for m, _, c, v in pt.table4_cells("horovod")]),
    ("calibration_hetpipe", "A second calibration (Table 4, VGG-19's HetPipe row), checked on every other cell",
     common.command("calibration_hetpipe"),
     [f"Table 4 HetPipe VGG-19 {c}: {v} images/s" for m, _, c, v in pt.table4_cells("hetpipe")
      if m == "vgg19_imagenet"]),
    ("table3", "Table 3 / Figure 3: one virtual worker vs Nm (§8.2)", common.command("table3"),
     ["normalised throughput and max GPU utilisation grow with Nm", "larger Nm do not fit memory (bars left out)"]),
    ("fig4", "Figure 4: NP, ED, HD, ED-local, Horovod (§8.3)", common.command("fig4"),
     [*pt.FIG4_OBSERVATIONS, "VGG-19 ED-local 1.8x Horovod", "ResNet-152 ED-local 1.4x Horovod",
      "bytes across nodes: VGG-19 ED-local 103 MB vs Horovod 515 MB; ResNet-152 298 MB vs 211 MB"]),
    ("table4", "Table 4: adding whimpy GPUs (§8.3)", common.command("table4"),
     [f"Table 4 HetPipe {pt.MODEL_NAMES[m]} {c}: {v} images/s" for m, _, c, v in pt.table4_cells("hetpipe")]),
    # Written by experiments/paper/convergence.py (branch paper-conv) as one results file.
    ("convergence", "Figures 5 and 6: convergence in virtual time, waiting statistics (§8.4)",
     common.command("convergence"), list(pt.CONVERGENCE_CLAIMS.values())),
    ("waiting", "Waiting statistics vs timing jitter and pull policy (§8.4, engine sensitivity study)",
     common.command("waiting"), [pt.CONVERGENCE_CLAIMS["waiting_d4_over_d0"], pt.CONVERGENCE_CLAIMS["idle_over_waiting"]]),
    # Written by experiments/paper/fsdp_compare.py (issue 26; not in --run_all: about a minute and a half on 2 cores).
    ("fsdp_compare", "Beyond the paper: HetPipe against fully sharded data parallelism (ZeRO-3 / FSDP)",
     common.command("fsdp_compare"), ["(no paper claim: the 2026 baseline beside HetPipe's best allocation)"]),
    # Written by experiments/staleness_study.py --results_dir=experiments/paper/results (issue 25; hours on 2 cores).
    ("staleness", "Staleness and its remedies", f"{common.PYTHON} experiments/staleness_study.py "
     "--results_dir=experiments/paper/results", ["(no paper claim: issue 25's goals for compensated staleness)"]),
)
CLAIM_KEYS = ("claim", "paper", "ours", "difference", "why", "command", "calibrated")


def _cell(v: Any) -> str:
  s = "-" if v is None else str(v)
  return s.replace("|", "\\|").replace("\n", " ")


def load_results(results_dir: str) -> dict[str, dict]:
  """Every ``*.json`` under ``results_dir`` by stem.

  Raises:
    ValueError: a file that is not JSON, or whose claims break the shared convention (names the file and key).
  """
  out = {}
  for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
    stem = os.path.splitext(os.path.basename(path))[0]
    try:
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("claims"), list):
      continue  # not a results file of this convention (e.g. a raw dump)
    for i, c in enumerate(data["claims"]):
      missing = [k for k in CLAIM_KEYS if k not in c]
      if missing:
        raise ValueError(f"{path}: claims[{i}] lacks {missing}; every claim needs {list(CLAIM_KEYS)}")
    out[stem] = data
  return out


def _claims_table(claims: list[dict]) -> list[str]:
  lines = ["| claim | paper | ours | difference | why | calibration? | re-run |", "|---|---|---|---|---|---|---|"]
  for c in claims:
    lines.append(f"| {_cell(c['claim'])} | {_cell(c['paper'])} | {_cell(c['ours'])} | {_cell(c['difference'])} | "
                 f"{_cell(c['why'])} | {'calibration' if c['calibrated'] else 'prediction'} | "
                 f"`{_cell(c['command'])}` |")
  return lines


def render(results: dict[str, dict], output_dir: str) -> str:
  """The page's Markdown (image links relative to ``output_dir``)."""
  lines = ["# Reproducing HetPipe §8 (ATC '20)", "",
           "Generated by `.venv/bin/python experiments/paper/reproduction.py` from "
           "`experiments/paper/results/*.json`; do not edit by hand. Throughput numbers are predictions of the "
           "event engine (`hetpipe_jax/sim/engine.py`) on the paper's cluster (`experiments/clusters/"
           "hetpipe_paper.json`) with the cost model calibrated on the cells marked *calibration* below (one roofline "
           "efficiency per GPU type, `experiments/paper/calibration.py`, on Table 4's Horovod row); every other number "
           "is a prediction, shown with its error against the paper. One section only (\"A second calibration\") fits "
           "the same four numbers on VGG-19's HetPipe row instead and predicts the rest from them; the staleness "
           "study's time to target is reported under both fits. Convergence rows reproduce the paper's staleness "
           "pattern and speed in virtual time, not its ImageNet accuracy.", ""]
  n_pred = sum(1 for d in results.values() for c in d["claims"] if not c["calibrated"])
  n_cal = sum(1 for d in results.values() for c in d["claims"] if c["calibrated"])
  missing = [s for s, *_ in SECTIONS if s not in results]
  lines += [f"Claims: {n_pred} predictions, {n_cal} calibration cells; sections not run yet: "
            f"{', '.join(missing) or 'none'}.", ""]
  known = [s for s, *_ in SECTIONS]
  extra = [(s, s, "(see the results file)", []) for s in results if s not in known]
  for stem, title, cmd, paper_claims in (*SECTIONS, *extra):
    lines += [f"## {title}", ""]
    data = results.get(stem)
    if data is None:
      lines += ["| claim | paper | ours | re-run |", "|---|---|---|---|"]
      for pc in paper_claims:
        lines.append(f"| {_cell(pc)} | (see claim) | not run yet | `{cmd}` |")
      lines.append("")
      continue
    if data.get("quick"):
      lines += ["*Quick mode: a smoke run of the script, not a result.*", ""]
    lines += _claims_table(data["claims"]) + [""]
    if data.get("markdown"):
      lines += [data["markdown"], ""]
    for other in results.values():  # rows another results file shows beside this section's (its "beside" map)
      if other.get("beside", {}).get(stem):
        lines += [*other["beside"][stem], ""]
    png = data.get("png")
    if png:
      target = png if os.path.isabs(png) else os.path.join(str(REPO_ROOT), png)
      lines += [f"![{title}]({os.path.relpath(target, output_dir)})", ""]
  return "\n".join(lines)


def write(results_dir: str, output: str) -> str:
  results = load_results(results_dir)
  text = render(results, os.path.dirname(os.path.abspath(output)))
  with open(output, "w", encoding="utf-8") as f:
    f.write(text + "\n")
  return text




def run_scripts(results_dir: str, quick: bool) -> None:
  """The throughput scripts (quick modes, or their full settings) into ``results_dir``, in process (each defines
  its flags only when run as a script)."""
  from experiments.paper import calibration, calibration_hetpipe, fig4, table3, table4, waiting  # pylint: disable=g-import-not-at-top
  calibration.run(results_dir, quick)
  calibration_hetpipe.run(results_dir, quick)
  table3.run(results_dir, quick, 8)
  fig4.run(results_dir, quick)
  table4.run(results_dir, quick)
  waiting.run(results_dir, quick)


def main(argv):
  del argv
  if flags.FLAGS.quick or flags.FLAGS.run_all:
    run_scripts(flags.FLAGS.results_dir, flags.FLAGS.quick)
  text = write(flags.FLAGS.results_dir, flags.FLAGS.output)
  print(text[:2000])
  print(f"wrote {flags.FLAGS.output}")


if __name__ == "__main__":  # flags only when run as a script (reproduction --quick imports it)
  flags.DEFINE_string("results_dir", common.RESULTS_DIR, "Where the results JSON files are.")
  flags.DEFINE_string("output", str(REPO_ROOT / "REPRODUCTION.md"), "The page to write.")
  flags.DEFINE_bool("quick", False, "Run the throughput scripts' quick modes into --results_dir first.")
  flags.DEFINE_bool("run_all", False, "Run the throughput scripts in their full settings first (about a minute).")
  app.run(main)
