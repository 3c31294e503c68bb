"""The optimizers made for delay (issue 25, item 1): ``nadam``, ``nadamw``, Adam/NAdam with β1 up to 0.99, ``muon``.

Every run here has one VW, Nm = 1 (one micro-batch group per step for the flush methods) and D = 0, so whatever the
method, each minibatch's gradient is taken at the weights of all earlier updates: it must equal a plain optax loop on
the whole model (one state, one transformation) over the same minibatches. The reference transformations are built
here from optax by hand, not by ``make_optimizer``; Muon's matrices come from hand lists per model, written from the
model definitions (hetpipe_jax/models), not from the code's rule.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers
import pytest

from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding, text
from hetpipe_jax.jobs import checkpoint, job_config, run_context, training_setup, virtual_job
from hetpipe_jax.runtime import optimizers
from tests.pipeline_util import assert_params_close, build_vw, sequential_replay, tiny_config

# Which leaves Muon orthogonalizes, "layer:path", by hand from the model definitions: the Dense kernels of every
# layer but the output layer. mlp_tiny = Flatten, Dense 32, Dense 32, Dense 10 (head); gpt_tiny = TokenEmbed (tables:
# not Muon), 2 Blocks (attention qkv and out, MLP fc and proj), Head (LayerNorm + logits: not Muon); cnn = 2 ConvReLU
# (4-D kernels: not Muon), pools, Flatten, Dense 256, Dense 10 (head); resnet = convolutions, GroupNorms and a Dense
# head only: nothing.
HAND_MUON = {
    "mlp_tiny": ["1:Dense_0/kernel", "2:Dense_0/kernel"],
    "gpt_tiny": [f"{b}:{leaf}" for b in (1, 2) for leaf in ("attn/qkv/kernel", "attn/out/kernel", "fc/kernel",
                                                            "proj/kernel")],
    "cnn": ["5:Dense_0/kernel"],
    "resnet": [],
}

# (optimizer, its settings): β1 = 0.99 throughout (Ajanthan et al.'s delay-tolerant NAdam), weight decay > 0 where
# the optimizer takes it, Muon's momentum off its default.
CASES = [
    ("adam", {"adam_b1": 0.99}),
    ("nadam", {"adam_b1": 0.99, "adam_b2": 0.98}),
    ("nadamw", {"adam_b1": 0.99, "weight_decay": 0.1}),
    ("muon", {"adam_b1": 0.99, "weight_decay": 0.05, "muon_beta": 0.9}),
]
SEQ = 16  # gpt_tiny's context



def _make_optimizer(config, num_minibatches, spec=None):
  return training_setup.make_optimizer(job_config.resolve_job(config).optim, num_minibatches, spec)

def _name(i: int, path) -> str:
  return f"{i}:" + "/".join(k.key for k in path)


def hand_muon_dims(model: str, params: list) -> list:
  """The whole model's ``muon_weight_dimension_numbers`` from :data:`HAND_MUON` (x @ W: axes 0 and 1)."""
  return [jax.tree_util.tree_map_with_path(
      lambda path, _, i=i: MuonDimensionNumbers(0, 1) if _name(i, path) in HAND_MUON[model] else None, p)
      for i, p in enumerate(params)]


def reference_tx(name: str, settings: dict, lr, model: str, params: list) -> optax.GradientTransformation:
  """The whole model's optax transformation for ``config.optimizer = name`` with ``settings`` (optax defaults for
  the rest: b1 0.9, b2 0.999, weight decay 0, Muon's β 0.95)."""
  b1, b2 = settings.get("adam_b1", 0.9), settings.get("adam_b2", 0.999)
  decay = settings.get("weight_decay", 0.0)
  if name == "adam":
    return optax.adam(lr, b1=b1, b2=b2)
  if name == "nadam":
    return optax.nadam(lr, b1=b1, b2=b2)
  if name == "nadamw":
    return optax.nadamw(lr, b1=b1, b2=b2, weight_decay=decay)
  assert name == "muon"
  return optax.contrib.muon(lr, beta=settings.get("muon_beta", 0.95), weight_decay=decay, adam_b1=b1, adam_b2=b2,
                            adam_weight_decay=decay, muon_weight_dimension_numbers=hand_muon_dims(model, params),
                            consistent_rms=settings.get("muon_consistent_rms") or None)


def _shapes(model: str) -> list:
  spec = models.get_model(model)
  return jax.eval_shape(lambda: models.init_layer_params(spec, jax.random.key(0)))


def _muon_leaves_of_state(state, stage_params: list, first_layer: int) -> list[str]:
  """The leaves whose Muon momentum a stage's optax state holds (the others are ``optax.MaskedNode``)."""
  muon_mu = state.inner_states["muon"].inner_state[0].mu  # MaskedState -> chain -> MuonState
  names = []
  for i, (mu, p) in enumerate(zip(muon_mu, stage_params)):
    flat, _ = jax.tree_util.tree_flatten_with_path(mu, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    names += [_name(first_layer + i, path) for path, leaf in flat if not isinstance(leaf, optax.MaskedNode)]
  return sorted(names)


def assert_close_but_key_bias(actual: list, expected: list, max_drift: float) -> None:
  """rtol 1e-5 on every leaf, except the attention keys' bias (gpt: qkv bias entries d..2d): its gradient is zero in
  exact arithmetic (softmax ignores a shift of every score of a query), so Adam-type steps turn float noise into
  updates of up to the learning rate; there both sides only have to stay within ``max_drift``."""
  flat_a, _ = jax.tree_util.tree_flatten_with_path(list(actual))
  flat_e = jax.tree.leaves(list(expected))
  assert len(flat_a) == len(flat_e)
  for (path, a), e in zip(flat_a, flat_e):
    a, e = np.asarray(a), np.asarray(e)
    if jax.tree_util.keystr(path).endswith("['qkv']['bias']"):
      d = a.shape[0] // 3
      np.testing.assert_array_less(np.abs(a[d:2 * d] - e[d:2 * d]), max_drift)
      a, e = np.concatenate([a[:d], a[2 * d:]]), np.concatenate([e[:d], e[2 * d:]])
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
  rng = np.random.default_rng(0)
  words = [b"delay", b"stale", b"weights", b"wave", b"muon", b"adam", b"pipeline", b"of", b"the", b"is"]
  corpus = b" ".join(words[i] for i in rng.integers(0, len(words), 6000))
  d = tmp_path_factory.mktemp("text")
  (d / "a.txt").write_bytes(corpus)
  return text.load_text_dataset([d], SEQ)


# ------------------------------------------------------------------------------------------ Muon's rule


@pytest.mark.parametrize("model", sorted(HAND_MUON))
def test_muon_rule_picks_the_hand_listed_hidden_matrices(model):
  assert sorted(optimizers.muon_leaf_names(_shapes(model))) == sorted(HAND_MUON[model])


@pytest.mark.parametrize("model,partition", [
    ("gpt_tiny", [(0, 4)]), ("gpt_tiny", [(0, 2), (2, 4)]), ("gpt_tiny", [(0, 1), (1, 3), (3, 4)]),
    ("mlp_tiny", [(0, 2), (2, 4)]), ("mlp_tiny", [(0, 1), (1, 2), (2, 3), (3, 4)]), ("cnn", [(0, 5), (5, 7)]),
])
def test_each_stage_gives_muon_the_same_leaves_whichever_stage_holds_them(model, partition):
  """The state each stage's transformation builds holds Muon momentum exactly for the hand-listed leaves of its
  layers (a stage of no such leaf, e.g. the head's, holds none)."""
  spec = models.get_model(model)
  params = models.init_layer_params(spec, jax.random.key(0))
  tx = _make_optimizer(tiny_config(model=model, optimizer="muon"), 10, spec)
  got = []
  for start, end in partition:
    state = jax.eval_shape(optimizers.for_layers(tx, start, end).init, params[start:end])
    got += _muon_leaves_of_state(state, params[start:end], start)
  assert got == sorted(HAND_MUON[model])


# ------------------------------------------------------------------------------------------ in process


# ... and Muon with its updates scaled to a consistent RMS (optax's consistent_rms; lm_delay_sweep.md).
PIPELINED_CASES = CASES + [("muon", {"muon_consistent_rms": 0.2})]


@pytest.mark.parametrize("optimizer,settings", PIPELINED_CASES,
                         ids=[c[0] + ("_rms" if "muon_consistent_rms" in c[1] else "") for c in PIPELINED_CASES])
@pytest.mark.parametrize("model,partition", [("gpt_tiny", [(0, 2), (2, 4)]), ("mlp_tiny", [(0, 1), (1, 3), (3, 4)])])
def test_pipelined_vw_equals_whole_model_optax(synthetic_data_dir, text_data, optimizer, settings, model, partition):
  """One VW, Nm = 1, D = 0, each stage with its own state: the final weights equal one optax loop on the whole model
  (rtol 1e-5), and they differ from the same optimizer at its default settings (the settings reached it)."""
  steps, lr = 6, 3e-3
  spec = models.get_model(model)
  config = tiny_config(model=model, optimizer=optimizer, learning_rate=lr, lr_schedule="constant", **settings)
  tx = _make_optimizer(config, steps, spec)  # the settings are valid
  vw, source, params0, _, server = build_vw(synthetic_data_dir, model=model, partition=partition, num_inflight=1,
                                            optimizer=tx, batch_size=8,
                                            dataset=text_data if model == "gpt_tiny" else None)
  vw.run(steps)
  batches = [source.get(p) for p in range(steps)]
  want = sequential_replay(spec, params0, reference_tx(optimizer, settings, lr, model, params0), batches,
                           list(range(steps)))
  assert_close_but_key_bias(vw.layer_params(), want, steps * lr)
  assert_close_but_key_bias(vw.layout.unflatten(server.weights), want, steps * lr)  # the PS's copy
  defaults = sequential_replay(spec, params0, reference_tx(optimizer, {}, lr, model, params0), batches,
                               list(range(steps)))
  gap = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(defaults)))
  assert gap > 1e-4, gap


def test_muon_state_moves_to_another_partition_through_a_checkpoint(tmp_path, text_data):
  """Muon's state split by layer (its momentum only on its matrices, optax MaskedNode elsewhere) is saved (orbax),
  restored onto another partition's stages and trained on: 3 + 3 steps equal 6 steps of the whole-model loop."""
  steps, lr, settings = 3, 3e-3, {"adam_b1": 0.99, "muon_beta": 0.9}
  spec = models.get_model("gpt_tiny")
  tx = _make_optimizer(tiny_config(model="gpt_tiny", optimizer="muon", learning_rate=lr,
                                          lr_schedule="constant", **settings), 2 * steps, spec)
  vw, source, params0, _, _ = build_vw(None, model="gpt_tiny", partition=[(0, 2), (2, 4)], num_inflight=1,
                                       optimizer=tx, batch_size=8, dataset=text_data)
  vw.run(steps)
  scalars, per_layer = vw.opt_state_by_layer()
  assert len(per_layer) == 4 and len(per_layer[0]) == 3  # Adam's mu and nu, Muon's mu
  store = checkpoint.TrainingCheckpoints(tmp_path / "ckpt", 2)
  store.save(1, vw.layer_params(), {0: (scalars, per_layer)}, {"num_layers": 4, "opt_parts_per_layer": 3})
  weights, opt_states, _ = store.restore(1)
  store.close()
  # A VW of another partition starting from the restored weights and state, fed minibatches 3..5.
  vw2 = _vw_from(weights, tx, text_data, [(0, 1), (1, 4)], offset=steps)
  vw2.load_opt_state(*opt_states[0])
  vw2.run(steps)
  want = sequential_replay(spec, params0, reference_tx("muon", settings, lr, "gpt_tiny", params0),
                           [source.get(p) for p in range(2 * steps)], list(range(2 * steps)))
  assert_close_but_key_bias(vw2.layer_params(), want, 2 * steps * lr)


def _vw_from(weights, tx, dataset, partition, offset):
  """One VW of gpt_tiny on ``partition`` from ``weights``, its minibatch p being the data's ``offset + p``."""
  from hetpipe_jax.ps import param_server
  from hetpipe_jax.runtime import stages as stages_lib
  from hetpipe_jax.runtime import virtual_worker
  from hetpipe_jax.runtime.param_layout import ParamLayout
  spec = models.get_model("gpt_tiny")
  layout = ParamLayout.from_layer_params(weights)
  source = sharding.ShardedMinibatches(dataset, 1, 0, 8, 0)
  server = param_server.ParameterServer(layout.flatten(weights), 1)
  stages = stages_lib.build_stages(spec, partition, jax.devices()[:len(partition)], tx)
  vw = virtual_worker.VirtualWorker(stages, layout, weights, virtual_worker.WSPSettings(0, 1, 1),
                                    virtual_worker.UpdateSettings(tx),
                                    virtual_worker.VWHooks(lambda p: source.get(offset + p),
                                                           param_server.LocalPSClient(server, 0)))
  return vw


# ------------------------------------------------------------------------------------------ jobs in virtual time


@pytest.mark.parametrize("method,stages,m,optimizer", [
    ("hetpipe", 3, 1, "muon"), ("hetpipe", 2, 1, "nadamw"), ("pipedream", 3, 1, "muon"), ("gpipe", 2, 2, "muon"),
    ("1f1b_flush", 3, 2, "nadam"), ("horovod", 1, 1, "muon"),
])
def test_every_method_in_virtual_time_equals_whole_model_optax(tmp_path, synthetic_data_dir, method, stages, m,
                                                               optimizer):
  """A job (config -> every stage's optimizer) of one VW, Nm = 1 (flush methods: M micro-batches of one step), D = 0,
  cosine schedule: the final weights equal the whole-model optax loop on the same minibatches; config.json and
  summary.json record the optimizer and its settings alike."""
  steps, lr, batch = 6, 3e-3, 16
  settings = dict(CASES)[optimizer]
  c = tiny_config(data_dir=str(synthetic_data_dir), check_counts=False, progress=False, method=method,
                  num_virtual_workers=1, num_stages=stages, num_inflight=m, staleness_bound=0, num_minibatches=steps,
                  optimizer=optimizer, learning_rate=lr, lr_schedule="cosine", batch_size=batch,
                  emulate_stage_ms=",".join(["10"] * stages), checkpoint_every_waves=0, **settings)
  summary = virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path))
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  source = sharding.ShardedMinibatches(dataset, 1, 0, batch, 0)
  tx = reference_tx(optimizer, settings, optax.cosine_decay_schedule(lr, steps), "mlp_tiny", params0)
  want = sequential_replay(spec, params0, tx, [source.get(k) for k in range(steps)], list(range(steps)))
  assert_params_close(checkpoint.restore_weights(tmp_path / "checkpoint"), want, rtol=1e-5, atol=1e-7)
  config_json = json.loads((tmp_path / "config.json").read_text())
  recorded = {"name": optimizer, "learning_rate": lr, "lr_schedule": "cosine", "warmup_minibatches": 0,
              "adam_b1": 0.99, "adam_b2": settings.get("adam_b2", 0.999)}
  recorded.update({k: v for k, v in (("weight_decay", settings.get("weight_decay", 0.0)),
                                     ("muon_beta", settings.get("muon_beta", 0.95)),
                                     ("muon_consistent_rms", settings.get("muon_consistent_rms", 0.0)))
                   if optimizer in {"weight_decay": ("nadamw", "muon"), "muon_beta": ("muon",),
                                    "muon_consistent_rms": ("muon",)}[k]})
  if optimizer == "muon":
    assert summary["optimizer"].pop("muon_params") == HAND_MUON["mlp_tiny"]
  assert summary["optimizer"] == recorded
  assert {k: config_json["optimizer" if k == "name" else k] for k in recorded} == recorded


# ------------------------------------------------------------------------------------------ bad settings


@pytest.mark.parametrize("overrides,message", [
    ({"optimizer": "nadam", "adam_b1": 1.0}, r"config.adam_b1=1.0 must be in \[0, 1\)"),
    ({"optimizer": "muon", "adam_b1": 1.5}, r"config.adam_b1=1.5 must be in \[0, 1\)"),
    ({"optimizer": "nadamw", "weight_decay": -0.1}, r"config.weight_decay=-0.1 must be >= 0"),
    ({"optimizer": "adam", "weight_decay": 0.1},
     r"config.weight_decay=0.1 is a weight-decay setting; config.optimizer='adam' \(it is used by 'nadamw', 'muon'"),
    ({"optimizer": "nadamw", "muon_beta": 0.9}, r"config.muon_beta=0.9 is a Muon setting; config.optimizer='nadamw'"),
    ({"optimizer": "muon", "muon_beta": 1.0}, r"config.muon_beta=1.0 must be in \[0, 1\)"),
    ({"optimizer": "muon", "muon_consistent_rms": -0.2}, r"config.muon_consistent_rms=-0.2 must be >= 0"),
    ({"optimizer": "adam", "muon_consistent_rms": 0.2},
     r"config.muon_consistent_rms=0.2 is a muon-consistent-rms setting; config.optimizer='adam' \(it is used by "
     r"'muon'\)"),
    ({"optimizer": "sgd", "adam_b2": 0.99}, r"config.adam_b2=0.99 is an Adam setting; config.optimizer='sgd'"),
    ({"optimizer": "lion"}, r"config.optimizer='lion' must be one of 'sgd', 'momentum', 'adam', 'nadam', 'nadamw'"),
])
def test_bad_optimizer_settings_are_one_error_each(overrides, message):
  with pytest.raises(job_config.ConfigError, match=message):
    job_config.resolve_settings(tiny_config(**overrides))


def test_the_upper_settings_are_accepted():
  for optimizer in ("adam", "nadam", "nadamw", "muon"):
    job_config.resolve_settings(tiny_config(optimizer=optimizer, adam_b1=0.99, adam_b2=0.9999))
  job_config.resolve_settings(tiny_config(optimizer="muon", weight_decay=0.1, muon_beta=0.99))


def test_muon_for_a_model_without_hidden_matrices_stops_before_any_output(tmp_path, synthetic_data_dir):
  """resnet: convolutions (4-D), GroupNorms and a Dense head only. The error names the setting and the model and
  comes from the checks before work starts (no config.json); the cnn (a Dense 256 before its head) is accepted."""
  c = tiny_config(data_dir=str(synthetic_data_dir), check_counts=False, progress=False, model="resnet",
                  optimizer="muon", num_stages=2, emulate_stage_ms="10,10")
  with pytest.raises(job_config.ConfigError,
                     match=r"config.optimizer='muon': model 'resnet' has no 2-D hidden weights"):
    virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path / "run"))
  assert not (tmp_path / "run" / "config.json").exists()
  c.model = "cnn"
  settings = job_config.resolve_job(c, "virtual")
  spec, _ = run_context.prepare(settings, settings.world_size, check_local_devices=False)
  assert isinstance(training_setup.make_optimizer(settings.optim, 10, spec), optimizers.PerStage)


# ------------------------------------------------------------------------------------------ MPI


@pytest.mark.mpi
@pytest.mark.parametrize("method,ranks,stages,m,optimizer,extra", [
    # PS + 1 VW; a checkpoint every 2 waves carries Muon's state to the PS
    ("hetpipe", 2, 2, 1, "muon", {"checkpoint_every_waves": 2}),
    # PS + the VW's driver (stage 0) + a stage rank (stage 1): each builds its own stage's transformation
    ("hetpipe", 3, 2, 1, "muon", {"stage_ranks": True, "checkpoint_every_waves": 0}),
    ("gpipe", 1, 2, 2, "nadamw", {"checkpoint_every_waves": 0}),  # all-reduce job: one rank
])
def test_mpi_job_equals_whole_model_optax(tmp_path, synthetic_data_dir, method, ranks, stages, m, optimizer, extra):
  from tests.mpi_util import run_job
  steps, lr, batch = 6, 3e-3, 16
  settings = dict(CASES)[optimizer]
  workdir = tmp_path / "run"
  proc = run_job(workdir, ranks, {"data_dir": synthetic_data_dir, "method": method, "num_virtual_workers": 1,
                                  "num_stages": stages, "num_inflight": m, "staleness_bound": 0,
                                  "num_minibatches": steps, "optimizer": optimizer, "learning_rate": lr,
                                  "lr_schedule": "constant", "batch_size": batch, **extra, **settings})
  assert proc.returncode == 0, proc.stderr[-3000:]
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  source = sharding.ShardedMinibatches(dataset, 1, 0, batch, 0)
  want = sequential_replay(spec, params0, reference_tx(optimizer, settings, lr, "mlp_tiny", params0),
                           [source.get(k) for k in range(steps)], list(range(steps)))
  assert_params_close(checkpoint.restore_weights(workdir / "checkpoint"), want, rtol=1e-5, atol=1e-7)
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["optimizer"]["name"] == optimizer and summary["optimizer"]["adam_b1"] == 0.99
  if extra.get("stage_ranks"):
    assert summary["stage_rank_of_stage"] == [[1, 2]]  # stage 1 really ran on its own rank
  if extra["checkpoint_every_waves"]:  # Muon's state went through the MPI bytes and orbax at every checkpoint
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4", "6"]
