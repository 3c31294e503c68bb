"""The second calibration (experiments/paper/calibration_hetpipe.py): it recovers efficiencies it is given through
the engine's own HetPipe rates, says when a cell cannot be reached, and its script runs end to end."""

import json
import subprocess
import sys

import pytest

from experiments.paper import calibration, calibration_hetpipe, common
from experiments.paper import paper_tables as pt
from hetpipe_jax.paths import REPO_ROOT

COLUMNS = ("V4", "V4R4")


@pytest.fixture(scope="module")
def setting():
  return common.load_cluster(), common.load_profile("vgg19_imagenet"), common.compare_config(True)


def test_fit_recovers_known_efficiencies_from_hetpipe_rates(setting):
  """Rates made by the engine at known efficiencies (TITAN V 0.6, TITAN RTX 0.2: each the bottleneck of its column)
  are fitted back to them: the first type at or just above its truth (the smallest e whose rate reaches the target,
  to 10 halvings of log 20: 0.3%), the second within 1% (it is fitted with the first's small excess)."""
  base, profile, config = setting
  truth = {"TITAN V": 0.6, "TITAN RTX": 0.2}
  true_cluster = calibration.Calibration(truth, [], list(truth)).apply(base)
  table = {col: calibration_hetpipe.hetpipe_images_per_s(true_cluster, profile, col, config, 3) for col in COLUMNS}
  cal = calibration_hetpipe.fit(base, profile, table, config, COLUMNS, max_nm=3, steps=10)
  assert cal.order == ["TITAN V", "TITAN RTX"]
  assert 0.6 <= cal.efficiency["TITAN V"] <= 0.6 * 1.003, cal.efficiency
  assert cal.efficiency["TITAN RTX"] == pytest.approx(0.2, rel=0.01), cal.efficiency
  for cell in cal.cells:
    assert cell["reached"] and cell["fitted_images_per_s"] >= table[cell["column"]]  # the smallest e reaching it
    assert cell["images_per_s_at_e_min"] < table[cell["column"]] <= cell["images_per_s_at_e_1"]


def test_a_cell_out_of_reach_is_recorded_at_efficiency_one_not_reached(setting):
  base, profile, config = setting
  cal = calibration_hetpipe.fit(base, profile, {"V4": 1e6}, config, ("V4",), max_nm=3, steps=2)
  (cell,) = cal.cells
  assert cal.efficiency["TITAN V"] == 1.0 and not cell["reached"]
  assert cell["fitted_images_per_s"] == pytest.approx(cell["images_per_s_at_e_1"])
  assert cell["images_per_s_at_e_1"] < 1e6


def test_calibration_hetpipe_quick_writes_its_results_and_names_every_cell(tmp_path):
  out = tmp_path / "r"
  proc = subprocess.run([sys.executable, "experiments/paper/calibration_hetpipe.py", "--quick", f"--results_dir={out}"],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  data = json.loads((out / "calibration_hetpipe.json").read_text())
  assert data["quick"] and data["fit_model"] == "vgg19_imagenet" and data["order"] == ["TITAN V", "TITAN RTX"]
  fit_cells = [r for r in data["rows"] if r["calibration_cell"]]
  assert {(r["model"], r["system"]) for r in fit_cells} == {("vgg19_imagenet", "hetpipe")}
  # every other Table 4 cell of the quick columns is a prediction (ResNet-152's HetPipe row, both Horovod rows)
  assert len(data["rows"]) - len(fit_cells) == sum(
      pt.TABLE4_HETPIPE["resnet152_imagenet"][c] is not None for c in COLUMNS) + sum(
          pt.TABLE4_HOROVOD[m][c] is not None for m in pt.MODELS for c in COLUMNS)
  assert sum(c["calibrated"] for c in data["claims"]) == len(fit_cells)
  assert (out / "calibration_hetpipe.md").exists() and (out / "calibration_hetpipe.png").exists()
  # a quick fit is never taken for the saved one (the timing plans read only a full fit)
  assert calibration_hetpipe.saved_calibration(str(out)) is None
