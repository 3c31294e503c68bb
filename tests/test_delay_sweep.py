"""experiments/delay_sweep.py: its closed-form delay rule against a pipelined VW, its settings check, and its smoke
run end to end."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from experiments import delay_sweep
from experiments.configs import lm
from hetpipe_jax import models
from hetpipe_jax.data import sharding, text
from hetpipe_jax.jobs import checkpoint, job_config, virtual_job
from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.runtime.param_layout import ParamLayout
from tests.mpi_util import read_jsonl
from tests.test_text_lm import SEQ


@pytest.mark.parametrize("variant", ["adam:1", "adam:1:predict=1", "adam:2", "muon:1:predict=1", "muon:2:predict=1"])
def test_the_closed_form_delay_is_a_hetpipe_vw_in_virtual_time(tmp_path, text_dir, variant):
  """One VW, D = 0, Nm = delay + 1, 2 stages, run by the job in virtual time (the LM config on gpt_tiny), ends on the
  weights of sequential training where minibatch p's gradient is taken after max(0, p - delay) updates (with
  prediction: at the predicted weights), and the run's recorded versions are that rule."""
  n, lr = 12, 1e-2  # whole waves at Nm = 2 and 3
  v = delay_sweep.parse_variant(variant, lr)
  c = lm.get_config()
  c.update({"model": "gpt_tiny", "data_dir": str(text_dir), "num_virtual_workers": 1, "num_stages": 2,
            "num_inflight": v.delay + 1, "staleness_bound": 0, "batch_size": 8, "learning_rate": lr,
            "warmup_minibatches": 3, "num_minibatches": n, "eval_every_epochs": 0, "check_counts": False,
            "progress": False, "emulate_stage_ms": "10,10", "checkpoint_every_waves": 0,
            "weight_prediction": "optimizer" if v.predict else "none", "optimizer": v.optimizer,
            "adam_b1": v.b1, "adam_b2": v.b2, "muon_beta": 0.95, "muon_consistent_rms": v.rms or 0.0})
  virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path))
  records = read_jsonl(tmp_path / "minibatches.jsonl")
  assert [r["version_local_updates"] for r in sorted(records, key=lambda r: r["minibatch_id"])] == [
      max(0, p - v.delay) for p in range(n)]
  spec = models.get_model("gpt_tiny")
  data = text.load_text_dataset([text_dir], SEQ)
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, 3, n)
  source = sharding.ShardedMinibatches(data, 1, 0, 8, 0)
  expected = delay_sweep.train_delayed(v, spec, params0, source.get, n, schedule)
  layout = ParamLayout.from_layer_params(params0)
  actual = layout.flatten(checkpoint.restore_weights(tmp_path / "checkpoint"))
  assert np.max(np.abs(layout.flatten(expected) - layout.flatten(params0))) > 1e-3  # it trained
  # Adam normalises every gradient, so float32 differences between the staged and the whole-model gradient reach
  # the weights unshrunk: 1e-4 is 1% of one step (lr 1e-2). One delay less must miss by far more than that.
  np.testing.assert_allclose(actual, layout.flatten(expected), rtol=1e-4, atol=1e-4)
  fewer = delay_sweep.train_delayed(dataclasses.replace(v, delay=v.delay - 1), spec, params0, source.get, n, schedule)
  assert np.max(np.abs(actual - layout.flatten(fewer))) > 100 * 1e-4


@pytest.mark.parametrize("bad,match", [("sgd:1", "NAME one of"), ("adam", "NAME one of"), ("adam:-1", ">= 0"),
                                       ("adam:1:lr2=3", "unknown key 'lr2'"),
                                       ("nadam99:1:predict=1", "Adam and Muon only")])
def test_a_bad_variant_is_one_error_naming_it(bad, match):
  with pytest.raises(ValueError, match=match):
    delay_sweep.parse_variant(bad, 1e-3)


def test_delay_sweep_smoke(text_dir):
  """The CLI end to end: four rows, curves at the evaluation points, the gap to delay 0 beside the delayed rows, and
  a variant's own rate used (rate 0 learns nothing)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  proc = subprocess.run([sys.executable, "experiments/delay_sweep.py", "--smoke", f"--text_dir={text_dir}"],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout)
  assert out["smoke"] is True and out["model"] == "gpt_tiny" and len(out["variants"]) == 4
  for row in out["variants"]:
    assert sorted(row["bits_per_byte"]) == ["3", "6"] and all(np.isfinite(list(row["bits_per_byte"].values())))
  ref, delayed, predicted, frozen = out["variants"]
  assert "gap_to_delay_0" not in ref
  assert delayed["gap_to_delay_0"] == round(delayed["bits_per_byte"]["6"] / ref["bits_per_byte"]["6"] - 1, 4)
  assert predicted["predict"] is True and "gap_to_delay_0" in predicted
  assert delayed["bits_per_byte"] != ref["bits_per_byte"]  # the delay changed the numerics
  assert frozen["lr"] == 0.0 and "gap_to_delay_0" not in frozen
  assert frozen["bits_per_byte"]["3"] == frozen["bits_per_byte"]["6"] > ref["bits_per_byte"]["6"]


def test_the_cli_refuses_a_bad_variant_in_one_line_before_any_work():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  proc = subprocess.run([sys.executable, "experiments/delay_sweep.py", "--variants=adam:0,bogus:1"], cwd=REPO_ROOT,
                        env=env, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 1 and proc.stdout == ""
  assert proc.stderr.strip().splitlines()[-1].startswith("error: --variants: 'bogus:1' must be NAME:DELAY")
