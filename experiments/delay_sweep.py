r"""What a fixed gradient delay costs a language model, and which optimizer settings pay for it: a fast, independent
stand-in for one HetPipe VW (issue 25).

Inside one HetPipe VW with D = 0 (HetPipe §4), minibatch p is injected when minibatch p − Nm completes, so its
forward and backward run on the weights after the first max(0, p − (Nm − 1)) updates: a gradient delay of Nm − 1.
This script trains plain, sequentially, with exactly that rule (written here from the closed form, not from the
runtime's records) and reports held-out bits/byte, so a grid of optimizer settings costs minutes instead of the
hours of full virtual-time runs (`experiments/staleness_study.py`). Its numerics are the runtime's: on `gpt_bytes`
it reproduces the study's virtual-time runs at Nm = 1 and Nm = 2 (with and without weight prediction) to 4 decimals
(docs/measurements/lm_delay_sweep.md), and `tests/test_delay_sweep.py` checks it against a pipelined VW.

  .venv/bin/python experiments/delay_sweep.py --variants=adam:0,adam:1,adam_clip:1  # ~3 min a variant on 2 cores
  .venv/bin/python experiments/delay_sweep.py --smoke --text_dir=DIR                 # CI: seconds

A variant is ``NAME:DELAY[:key=value...]``, NAME one of :data:`PRESETS` (an optimizer setting), DELAY = Nm − 1 and
the keys overriding the preset: ``lr`` (peak rate of the warm-up + cosine schedule), ``b1``, ``b2``, ``clip``
(global-norm clip, 0: off), ``predict`` (1: weight prediction at injection, Ŵ = W − η·s·d from the state that goes
with W, d Adam's m̂/(√v̂ + ε) or Muon's own step for its momentum, written here apart from
:mod:`hetpipe_jax.rules.weight_prediction`), ``rms`` (Muon's ``consistent_rms``). The JSON
gives per variant the bits/byte at every ``--eval_every`` minibatches and, beside each variant with DELAY > 0, its
gap to the same settings at DELAY 0 when that ran too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=wrong-import-position

from hetpipe_jax import flag_checks  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS

PRESETS = {  # name -> (optimizer, settings); the LM config's Adam is "adam"
    "adam": ("adam", {}),
    "adam_clip": ("adam", {"clip": 1.0}),
    "adam_b95": ("adam", {"b2": 0.95}),
    "nadam99": ("nadam", {"b1": 0.99}),
    "muon": ("muon", {"rms": 0.2}),
}
_KEYS = ("lr", "b1", "b2", "clip", "predict", "rms")


def _define_flags() -> None:
  """The CLI's flags, defined only when run as a script (tests import this module beside other scripts' flags)."""
  flags.DEFINE_list("variants", ["adam:0", "adam:1"], "NAME:DELAY[:key=value...] (module docstring).")
  flags.DEFINE_integer("minibatches", 600, "Minibatches (updates) per variant; the schedule's length.")
  flags.DEFINE_integer("eval_every", 150, "Held-out bits/byte every this many minibatches.")
  flags.DEFINE_float("learning_rate", 1e-3, "Peak learning rate of a variant without an lr key (lm.py's).")
  flags.DEFINE_integer("warmup_minibatches", 100, "Linear warm-up before the cosine decay.")
  flags.DEFINE_integer("batch_size", 32, "Windows per minibatch.")
  flags.DEFINE_integer("seed", 0, "Initial weights (jax.random.key(seed)) and data order, as the job's.")
  flags.DEFINE_string("model", "gpt_bytes", "A text model of the registry.")
  flags.DEFINE_string("text_dir", "", "Text files or directories ('': /usr/share/games/fortunes).")
  flags.DEFINE_bool("smoke", False, "gpt_tiny, 6 minibatches, adam at delays 0 and 1, and at rate 0 (CI).")


@dataclasses.dataclass(frozen=True)
class Variant:
  """One row: an optimizer setting at a gradient delay (``delay`` = Nm − 1); ``name`` (the text it came from) is not
  compared."""
  name: str = dataclasses.field(compare=False)
  delay: int
  optimizer: str
  lr: float
  b1: float = 0.9
  b2: float = 0.999
  clip: float = 0.0
  predict: bool = False
  rms: float | None = None

  def reference_key(self) -> tuple:
    """The same settings at delay 0."""
    return dataclasses.replace(self, delay=0, predict=False)


def parse_variant(text: str, lr: float) -> Variant:
  """``NAME:DELAY[:key=value...]`` -> :class:`Variant`.

  Raises:
    ValueError: an unknown preset or key, a negative delay, or ``predict`` with an optimizer other than Adam or
      Muon; the message names the variant.
  """
  name, *rest = text.split(":")
  if name not in PRESETS or not rest:
    raise ValueError(f"--variants: {text!r} must be NAME:DELAY[:key=value...] with NAME one of {sorted(PRESETS)}")
  optimizer, settings = PRESETS[name]
  delay = int(rest[0])
  if delay < 0:
    raise ValueError(f"--variants: {text!r}: the delay (Nm - 1) must be >= 0")
  fields = {"lr": lr, **settings}
  for kv in rest[1:]:
    key, _, value = kv.partition("=")
    if key not in _KEYS:
      raise ValueError(f"--variants: {text!r}: unknown key {key!r} (one of {', '.join(_KEYS)})")
    fields[key] = bool(int(value)) if key == "predict" else float(value)
  if fields.get("predict") and optimizer not in ("adam", "muon"):
    raise ValueError(f"--variants: {text!r}: predict=1 is written here for Adam and Muon only")
  return Variant(text, delay, optimizer, **fields)


def variant_optimizer(v: Variant, params, schedule):
  """The variant's optax optimizer (the clip first, as ``grad_clip_norm`` clips before the job's optimizer)."""
  import optax  # pylint: disable=g-import-not-at-top
  if v.optimizer == "muon":
    from hetpipe_jax.runtime import optimizers  # pylint: disable=g-import-not-at-top
    tx = optax.contrib.muon(schedule, beta=0.95, adam_b1=v.b1, adam_b2=v.b2, consistent_rms=v.rms,
                            muon_weight_dimension_numbers=optimizers.muon_dimension_numbers(params))
  else:
    tx = optax.chain(optax.scale_by_adam(b1=v.b1, b2=v.b2, nesterov=v.optimizer == "nadam"),
                     optax.scale_by_learning_rate(schedule))
  return optax.chain(optax.clip_by_global_norm(v.clip), tx) if v.clip else tx


def train_delayed(v: Variant, spec, params0, get_minibatch, num_minibatches: int, schedule, on_eval=None,
                  eval_every: int = 0):
  """Sequential training where minibatch p's gradient is taken at the weights after max(0, p − delay) updates.

  Args:
    v: the variant.
    spec: the model.
    params0: initial per-layer params.
    get_minibatch: ``p -> (inputs, targets)``.
    num_minibatches: updates.
    schedule: the learning rate, ``step count -> rate``.
    on_eval: ``(minibatches done, params) -> None``, every ``eval_every`` minibatches.

  Returns:
    The final per-layer params.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from hetpipe_jax import models  # pylint: disable=g-import-not-at-top
  from hetpipe_jax.runtime import objectives  # pylint: disable=g-import-not-at-top

  objective = objectives.get_objective(spec.objective)
  grad = jax.jit(jax.grad(lambda p, x, y: objective.loss(models.apply_layers(spec.layers, p, x), y)))
  tx = variant_optimizer(v, params0, schedule)

  @jax.jit
  def apply(g, state, params):  # one compiled step (Muon's Newton-Schulz loop op by op exhausts LLVM's memory)
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  # Muon's prediction: optax's own step at rate 1 for the gradient that leaves its momentum in place (the constant
  # schedule keeps the state's structure)
  unit_step = jax.jit(variant_optimizer(v, params0, lambda count: 1.0).update) if v.optimizer == "muon" else None
  params, state = params0, tx.init(params0)
  kept = {0: (params0, state)}  # updates applied -> (weights, optimizer state)
  for p in range(num_minibatches):
    used = max(0, p - v.delay)
    w, w_state = kept[used]
    s = p - used  # updates that land before p's
    if v.predict and s and v.optimizer == "muon":
      w = _muon_predicted(v, w, w_state, unit_step, schedule, s)
    elif v.predict and s:
      adam = w_state[1][0] if v.clip else w_state[0]  # optax's ScaleByAdamState
      c = adam.count.astype(jnp.float32) + 1.0
      rate = sum(float(schedule(int(adam.count) + k)) for k in range(s))
      w = jax.tree.map(lambda w_, m, n: w_ - rate * (m / (1 - v.b1 ** c)) / (jnp.sqrt(n / (1 - v.b2 ** c)) + 1e-8),
                       w, adam.mu, adam.nu)
    x, y = get_minibatch(p)
    params, state = apply(grad(w, x, y), state, params)
    kept[p + 1] = (params, state)
    kept.pop(p - v.delay, None)  # no later minibatch uses these weights
    if on_eval is not None and eval_every and (p + 1) % eval_every == 0:
      on_eval(p + 1, params)
  return params


def _muon_predicted(v: Variant, w, w_state, unit_step, schedule, s: int):
  """Muon's Ŵ = W − (η_c + … + η_{c+s−1}) · d, c its step count: on its matrices d is optax's own step at rate 1 (over
  −1) for the gradient μ (its momentum), which leaves μ in place; on the other leaves (Muon's Adam part, Nesterov
  Adam) d = (β1·m/(1 − β1^(c+2)) + (1 − β1)·m/(1 − β1^(c+1))) / (√(v/(1 − β2^(c+1))) + 1e-8)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from optax.contrib import MuonState  # pylint: disable=g-import-not-at-top
  from optax.transforms import MaskedNode  # pylint: disable=g-import-not-at-top

  found = {}
  jax.tree.map(lambda x: x, w_state, is_leaf=lambda x: isinstance(x, (MuonState, optax.ScaleByAdamState))
               and found.setdefault(type(x), x) is not None)
  muon, adam = found[MuonState], found[optax.ScaleByAdamState]
  masked = lambda x: isinstance(x, MaskedNode)  # noqa: E731
  g = jax.tree.map(lambda m_muon, m_adam: m_adam if masked(m_muon) else m_muon, muon.mu, adam.mu, is_leaf=masked)
  step, _ = unit_step(g, w_state, w)
  c = int(muon.count)
  rate = sum(float(schedule(c + k)) for k in range(s))
  b1, b2 = v.b1, v.b2

  def leaf(w_, st, m_muon, m, n):
    if not masked(m_muon):
      return w_ + rate * st
    m_hat = b1 * m / (1 - b1 ** (c + 2)) + (1 - b1) * m / (1 - b1 ** (c + 1))
    return w_ - rate * m_hat / (jnp.sqrt(n / (1 - b2 ** (c + 1))) + 1e-8)

  return jax.tree.map(leaf, w, step, muon.mu, adam.mu, adam.nu, is_leaf=masked)


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from hetpipe_jax import models  # pylint: disable=g-import-not-at-top
  from hetpipe_jax.data import sharding, text  # pylint: disable=g-import-not-at-top

  model, minibatches, every = FLAGS.model, FLAGS.minibatches, FLAGS.eval_every
  variant_texts, warmup = FLAGS.variants, FLAGS.warmup_minibatches
  if FLAGS.smoke:
    flag_checks.refuse_replaced("--smoke", ["model", "minibatches", "eval_every", "warmup_minibatches", "variants"])
    model, minibatches, every, warmup = "gpt_tiny", 6, 3, 2
    variant_texts = ["adam:0", "adam:1", "adam:1:predict=1", "adam:0:lr=0"]
  try:
    variants = [parse_variant(t, FLAGS.learning_rate) for t in variant_texts]  # every error before any work
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  spec = models.get_model(model)
  data = text.load_text_dataset(text.parse_paths(FLAGS.text_dir), seq_len=spec.input_shape[0])
  ex, ey = data.eval_inputs, data.eval_targets

  @jax.jit
  def loss_sum(p, x, y):
    logp = jax.nn.log_softmax(models.apply_layers(spec.layers, p, x))
    return -jnp.take_along_axis(logp, y[..., None], -1).sum()

  def bits_per_byte(p) -> float:
    total = sum(float(loss_sum(p, ex[i:i + 500], ey[i:i + 500])) for i in range(0, ex.shape[0], 500))
    return total / ex.size / float(np.log(2))

  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(FLAGS.seed)))
  rows, by_key = [], {}
  for v in variants:
    source = sharding.ShardedMinibatches(data, 1, 0, FLAGS.batch_size, FLAGS.seed)
    curve: dict[int, float] = {}
    t0 = time.time()
    schedule = optax.warmup_cosine_decay_schedule(0.0, v.lr, warmup, minibatches)  # the variant's own peak rate
    train_delayed(v, spec, params0, source.get, minibatches, schedule,
                  on_eval=lambda n, p, curve=curve: curve.__setitem__(n, round(bits_per_byte(p), 4)), eval_every=every)
    row = {**dataclasses.asdict(v), "bits_per_byte": curve, "seconds": round(time.time() - t0, 1)}
    by_key[v] = row
    rows.append(row)
    print(json.dumps(row), file=sys.stderr, flush=True)
  for v, row in by_key.items():
    ref = by_key.get(v.reference_key())
    if v.delay and ref is not None:
      last = max(row["bits_per_byte"], default=None)
      if last is not None:
        row["gap_to_delay_0"] = round(row["bits_per_byte"][last] / ref["bits_per_byte"][last] - 1.0, 4)
  print(json.dumps({"model": model, "minibatches": minibatches, "batch_size": FLAGS.batch_size, "seed": FLAGS.seed,
                    "learning_rate": FLAGS.learning_rate, "warmup_minibatches": warmup, "smoke": FLAGS.smoke,
                    "text_dir": FLAGS.text_dir or "/usr/share/games/fortunes", "variants": rows}, indent=1))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
