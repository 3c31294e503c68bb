"""A user's own model and dataset from a module outside the package (tests/user_model_data.py), by configuration
alone: trained in virtual time (its final weights equal the sequential replay of its recorded versions) and under
MPI; and the error cases, each one ConfigError naming the setting before any work."""

import json
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from experiments.configs import tiny
from hetpipe_jax import models
from hetpipe_jax.data import sharding
from hetpipe_jax.jobs import checkpoint, job_config, run_context, virtual_job
from hetpipe_jax.jobs.job_config import ConfigError
from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.runtime.param_layout import ParamLayout
from tests import user_model_data
from tests.mpi_util import read_jsonl, run_job
from tests.replay import read_applied_order, replay_final_weights

MODEL = "tests.user_model_data:make_spec"
DATASET = "tests.user_model_data:make_dataset"


def _config(**overrides):
  c = tiny.get_config()
  c.update({"model": MODEL, "dataset": DATASET, "progress": False, **overrides})
  return c


def test_user_model_and_dataset_train_in_virtual_time_and_equal_the_replay(tmp_path):
  nm, mb, batch = 2, 24, 16
  config = _config(num_inflight=nm, num_minibatches=mb, batch_size=batch, optimizer="momentum", learning_rate=0.1,
                   emulate_stage_ms="10,20")
  summary = virtual_job.run(job_config.resolve_job(config, "virtual"), str(tmp_path))
  recorded = json.loads((tmp_path / "config.json").read_text())
  assert recorded["model"] == MODEL and recorded["dataset"] == DATASET
  assert recorded["dataset_info"] == {"num_train": 768, "num_eval": 256, "name": "user_linear_3class", "seed": 0}
  assert recorded["objective"] == summary["objective"] == "classification"
  assert recorded["partition"] == "0:2,2:3" == summary["partition"]  # the even split of the user's 3 layers
  spec = user_model_data.make_spec()
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  dataset = user_model_data.make_dataset(config)
  sources = [sharding.ShardedMinibatches(dataset, 2, v, batch, 0) for v in range(2)]
  expected = replay_final_weights(read_jsonl(tmp_path / "minibatches.jsonl"), spec, params0,
                                  optax.sgd(0.1, momentum=0.9), sources, nm, read_applied_order(tmp_path))
  actual = ParamLayout.from_layer_params(params0).flatten(checkpoint.restore_weights(tmp_path / "checkpoint"))
  assert np.max(np.abs(actual - ParamLayout.from_layer_params(params0).flatten(params0))) > 1e-2  # it trained
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
  assert summary["test_accuracy"] > 0.6  # chance is 1/3: the user's task was learned from the user's data


@pytest.mark.mpi
def test_user_model_and_dataset_train_under_mpi(tmp_path):
  proc = run_job(tmp_path, 3, {"model": MODEL, "dataset": DATASET, "num_minibatches": 8, "learning_rate": 0.01})
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  config = json.loads((tmp_path / "config.json").read_text())
  assert summary["model"] == config["model"] == MODEL and config["dataset"] == DATASET
  assert summary["objective"] == "classification" and 0.0 <= summary["test_accuracy"] <= 1.0
  assert config["dataset_info"]["num_eval"] == 256
  assert len(read_jsonl(tmp_path / "minibatches.jsonl")) == 16


@pytest.mark.parametrize("model,dataset,message", [
    ("tests.no_such_module:make_spec", DATASET,
     r"config.model='tests.no_such_module:make_spec': cannot import module 'tests.no_such_module'"),
    ("tests.user_model_data:no_such_factory", DATASET, r"config.model=.*has no callable 'no_such_factory'"),
    ("tests.user_model_data:not_a_spec", DATASET, r"config.model=.*not_a_spec\(\) returned dict, not a ModelSpec"),
    (MODEL, "tests.no_such_module:make_dataset", r"config.dataset=.*cannot import module 'tests.no_such_module'"),
    (MODEL, "tests.user_model_data:not_a_spec", r"config.dataset=.*raised TypeError"),
    (MODEL, "tests.user_model_data:spec_as_dataset", r"config.dataset=.*returned ModelSpec, not a .*ExampleDataset"),
    (MODEL, "tests.user_model_data:wrong_shape_dataset",
     r"config.dataset=.*train_inputs has shape \[768, 11\], but the model takes examples of shape \[12\]"),
    (MODEL, "tests.user_model_data:labels_out_of_range_dataset",
     r"config.dataset=.*train_targets range from 1 to 3, outside the model's 3 outputs"),
    ("gpt_tiny", DATASET, r"config.dataset=.*train_inputs has shape \[768, 12\], but the model takes examples of "
                          r"shape \[16\]"),
])
def test_bad_model_or_dataset_is_one_config_error_naming_the_setting(model, dataset, message):
  config = _config(model=model, dataset=dataset)
  settings = job_config.resolve_job(config)
  with pytest.raises(ConfigError, match=message):
    spec, _ = run_context.prepare(settings, world_size=3, check_local_devices=False)
    run_context.load_data(settings.data, spec)


def test_malformed_dataset_name_fails_with_the_settings_check():
  with pytest.raises(ConfigError, match=r"config.dataset='imagenet' is unknown: give 'fashion_mnist', 'text', or"):
    job_config.resolve_settings(_config(dataset="imagenet"))


def test_train_cli_bad_factory_is_one_error_line_and_no_work(tmp_path):
  workdir = tmp_path / "never"
  proc = subprocess.run(
      [sys.executable, "-m", "hetpipe_jax.train", "--mode=virtual", "--config=experiments/configs/tiny.py",
       f"--workdir={workdir}", "--config.model=tests.user_model_data:not_a_spec", "--config.emulate_stage_ms=1,1"],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
      env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 2, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert errors == ["error: config.model='tests.user_model_data:not_a_spec': not_a_spec() returned dict, not a "
                    "ModelSpec; give 'package.module:factory' where factory() returns a hetpipe_jax.models.ModelSpec"]
  assert not workdir.exists()
