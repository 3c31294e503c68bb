"""A run replayed by a stranger from its outputs (issue 23, "Runs a stranger can replay").

The replay reads only the run's ``config.json`` (the initial weights' SHA-256 and rule, the settings),
``minibatches.jsonl`` (each minibatch's ``example_ids``) and the dataset's IDX files, and trains with a plain
jax/optax loop written here: its own IDX reader, its own W0 built by the recorded rule (each Flax layer's ``init``
with ``fold_in(key(seed), i)``), its own loss. From the project it takes only the model's layer list (the model is
an input of the run, like the data); nothing of the runtime, the data sharding, the flat layout or the checkpoint
reader. The replayed losses must equal the recorded ones and the final weights the run's checkpoint (read with orbax
directly).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest


def _read_idx(path: pathlib.Path) -> np.ndarray:
  """An IDX file (gzipped or not): magic 0x0000 08 ndim, big-endian int32 dims, then uint8 data."""
  raw = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
  ndim = raw[3]
  dims = [int.from_bytes(raw[4 + 4 * k:8 + 4 * k], "big") for k in range(ndim)]
  return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _train_split(data_dir) -> tuple[np.ndarray, np.ndarray]:
  d = pathlib.Path(data_dir)
  find = lambda stem: next(p for p in (d / f"{stem}.gz", d / stem) if p.exists())  # noqa: E731
  images = _read_idx(find("train-images-idx3-ubyte")).astype(np.float32) / np.float32(255.0)
  return images[..., None], _read_idx(find("train-labels-idx1-ubyte")).astype(np.int32)


def _layers(model: str):
  from hetpipe_jax import models  # the model's layer list only (an input of the run)
  spec = models.get_model(model)
  return spec.layers, spec.input_shape, spec.input_dtype


def _initial_weights(layers, input_shape, input_dtype, seed: int) -> list:
  """The recorded rule: layer i's params = layers[i].init(fold_in(key(seed), i), x_i)['params'], x_0 zeros."""
  x = jnp.zeros((1, *input_shape), input_dtype)
  params = []
  for i, layer in enumerate(layers):
    p = layer.init(jax.random.fold_in(jax.random.key(seed), i), x).get("params", {})
    params.append(jax.device_get(p))
    x = layer.apply({"params": p}, x)
  return params


def _sha256(params: list) -> str:
  flat = np.concatenate([np.asarray(leaf, "<f4").ravel() for p in params for leaf in jax.tree.leaves(p)])
  return hashlib.sha256(flat.tobytes()).hexdigest()


def _optimizer(cfg: dict):
  if cfg["lr_schedule"] != "constant":
    raise NotImplementedError(cfg["lr_schedule"])
  tx = {"sgd": lambda: optax.sgd(cfg["learning_rate"]),
        "momentum": lambda: optax.sgd(cfg["learning_rate"], momentum=cfg["momentum"]),
        "adam": lambda: optax.adam(cfg["learning_rate"], b1=cfg["adam_b1"], b2=cfg["adam_b2"])}[cfg["optimizer"]]()
  clip = cfg.get("grad_clip_norm", 0.0)
  return optax.chain(optax.clip_by_global_norm(clip), tx) if clip > 0 else tx


def replay_run(workdir, data_dir) -> tuple[list, list[float], list[float]]:
  """Replays a sequential run (every step's weights include every earlier step: one VW at Nm = 1, or all-reduce)
  from its outputs. Returns ``(final params, replayed losses per step, recorded losses per step)``."""
  workdir = pathlib.Path(workdir)
  cfg = json.loads((workdir / "config.json").read_text())
  rows = [json.loads(l) for l in (workdir / "minibatches.jsonl").read_text().splitlines()]
  layers, input_shape, input_dtype = _layers(cfg["model"])
  params = _initial_weights(layers, input_shape, input_dtype, cfg["replay"]["seed"])
  assert _sha256(params) == cfg["replay"]["initial_weights_sha256"]  # W0 by the recorded rule
  images, labels = _train_split(data_dir)
  flush = cfg["method"] in ("gpipe", "1f1b_flush", "horovod")
  per_step = cfg["num_inflight"] if flush else 1  # records per VW per optimizer step (micro-batches)
  steps: dict[int, list[dict]] = {}
  for r in rows:
    steps.setdefault(r["minibatch_id"] // per_step, []).append(r)
    if not flush:  # sequential: minibatch p ran on the weights after exactly p updates
      assert r["version_local_updates"] == r["minibatch_id"] and cfg["num_virtual_workers"] == 1

  def loss_fn(p, x, y):
    for layer, lp in zip(layers, p):
      x = layer.apply({"params": lp}, x)
    return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()

  grad_fn = jax.jit(jax.value_and_grad(loss_fn))
  tx = _optimizer(cfg)
  state = tx.init(params)
  replayed, recorded = [], []
  for k in sorted(steps):
    group = sorted(steps[k], key=lambda r: (r["vw_id"], r["minibatch_id"]))
    ids = np.concatenate([np.asarray(r["example_ids"], np.int64) for r in group])
    loss, g = grad_fn(params, images[ids], labels[ids])  # equal-sized parts: the mean over all of them
    u, state = tx.update(g, state, params)
    params = jax.device_get(optax.apply_updates(params, u))
    replayed.append(float(loss))
    recorded.append(float(np.mean([r["loss"] for r in group])))
  return params, replayed, recorded


def _checkpoint(workdir) -> list:
  with ocp.StandardCheckpointer() as ckptr:
    tree = ckptr.restore(pathlib.Path(workdir).absolute() / "checkpoint")
  return [jax.tree.map(np.asarray, tree[k]) for k in sorted(tree)]


def _check(workdir, data_dir, num_steps):
  params, replayed, recorded = replay_run(workdir, data_dir)
  assert len(replayed) == num_steps
  np.testing.assert_allclose(replayed, recorded, rtol=1e-5)
  got = _checkpoint(workdir)
  assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(params))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  rows = [json.loads(l) for l in (pathlib.Path(workdir) / "minibatches.jsonl").read_text().splitlines()]
  ids = [i for r in rows for i in r["example_ids"]]
  assert all(0 <= i < 512 for i in ids) and len(set(ids)) > len(ids) // 2  # real rows of the split, mostly distinct


VIRTUAL_CASES = {
    "hetpipe": {"method": "hetpipe", "num_virtual_workers": 1, "num_stages": 2, "num_inflight": 1,
                "staleness_bound": 0, "emulate_stage_ms": "10,20", "optimizer": "adam", "learning_rate": 0.01},
    "pipedream": {"method": "pipedream", "num_virtual_workers": 1, "num_stages": 2, "num_inflight": 1,
                  "staleness_bound": 0, "emulate_stage_ms": "10,20", "optimizer": "momentum", "momentum": 0.9,
                  "grad_clip_norm": 1.5},
    "gpipe": {"method": "gpipe", "num_virtual_workers": 2, "num_stages": 2, "num_inflight": 2,
              "partition": "0:2,2:4;0:3,3:4", "emulate_stage_ms": "10,20", "optimizer": "momentum",
              "momentum": 0.9, "grad_clip_norm": 1.5},
    "horovod": {"method": "horovod", "num_virtual_workers": 2, "num_stages": 1, "num_inflight": 1,
                "emulate_stage_ms": "10", "optimizer": "sgd"},
}


@pytest.mark.parametrize("case", sorted(VIRTUAL_CASES))
def test_a_virtual_time_run_replays_from_its_outputs_alone(tmp_path, synthetic_data_dir, case):
  from experiments.configs import tiny
  from hetpipe_jax.jobs import job_config, virtual_job
  steps = 6
  c = tiny.get_config()
  c.update({"data_dir": str(synthetic_data_dir), "check_counts": False, "progress": False, "batch_size": 16,
            "learning_rate": 0.05, "seed": 3, **VIRTUAL_CASES[case]})
  c.num_minibatches = steps
  virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path))
  _check(tmp_path, synthetic_data_dir, steps)


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["hetpipe", "horovod"])
def test_an_mpi_run_replays_from_its_outputs_alone(tmp_path, synthetic_data_dir, case):
  from tests.mpi_util import run_job
  steps = 5
  overrides = {"hetpipe": {"num_virtual_workers": 1, "num_stages": 2, "num_inflight": 1, "staleness_bound": 0,
                           "optimizer": "adam", "learning_rate": 0.01},
               "horovod": {"method": "horovod", "num_virtual_workers": 2, "num_stages": 1, "num_inflight": 1,
                           "optimizer": "momentum", "momentum": 0.9, "grad_clip_norm": 1.5}}[case]
  ranks = 2
  proc = run_job(tmp_path / "run", ranks, {"data_dir": synthetic_data_dir, "batch_size": 16, "learning_rate": 0.05,
                                           "num_minibatches": steps, "seed": 3, "log_every_waves": 1, **overrides})
  assert proc.returncode == 0, proc.stderr[-3000:]
  _check(tmp_path / "run", synthetic_data_dir, steps)
