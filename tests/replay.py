"""Sequential replay oracle for multi-VW WSP runs: recompute every update from the recorded weight versions.

A record ``(vw, p, version_global_clock g, version_local_updates m)`` says minibatch p of VW v used
``W(g, m) = W0 + sum_{c<g} sum_v' U[v', c] + sum_{j<m, wave(j) >= g} u[v, j]`` where ``u[v, j]`` is VW v's optax
update of its minibatch j and ``U[v, c]`` the sum of its wave c (HetPipe §5). Replaying the records in any order
that respects those dependencies, one minibatch at a time on one device, gives the final global weights
``W0 + sum_c sum_v U[v, c]`` that a correct runtime (or virtual-time run) must reproduce.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
import optax

from hetpipe_jax import models
from hetpipe_jax.runtime import stages as stages_lib
from hetpipe_jax.runtime.param_layout import ParamLayout


class Replay:
  """The replayed updates of every VW and the global weights they imply.

  Attributes:
    w0: flat initial weights.
    updates: per replayed VW, minibatch id -> its flat update.
    fixed_waves: per scripted VW (ids after the replayed ones), its given flat wave updates.
    num_inflight: Nm.
  """

  def __init__(self, w0: np.ndarray, updates: list, fixed_waves: Sequence[Sequence[np.ndarray]], num_inflight: int):
    self.w0 = w0
    self.updates = updates
    self.num_inflight = num_inflight
    self.fixed_waves = [list(w) for w in fixed_waves]
    self._global = {0: w0}

  def wave_sum(self, v: int, c: int) -> np.ndarray:
    """VW ``v``'s update of wave ``c``."""
    if v >= len(self.updates):
      return np.asarray(self.fixed_waves[v - len(self.updates)][c], np.float32)
    total = np.zeros_like(self.w0)
    for j in range(c * self.num_inflight, (c + 1) * self.num_inflight):
      total += self.updates[v][j]
    return total

  def global_weights(self, g: int) -> np.ndarray:
    """``W0 + sum_{c<g} sum_v U[v, c]``, VWs in order within a wave (the PS's order)."""
    if g not in self._global:
      w = self.global_weights(g - 1).copy()
      for v in range(len(self.updates) + len(self.fixed_waves)):
        w += self.wave_sum(v, g - 1)
      self._global[g] = w
    return self._global[g]

  def local_weights(self, v: int, g: int, m: int) -> np.ndarray:
    """``W(g, m)`` of VW ``v``: global weights of clock g plus its own updates ``g * Nm .. m - 1``."""
    w = self.global_weights(g).copy()
    for j in range(g * self.num_inflight, m):
      w += self.updates[v][j]
    return w


def replay(records: list[dict], spec: models.ModelSpec, params0: list, tx: optax.GradientTransformation,
           sources: list, num_inflight: int, fixed_waves: Sequence[Sequence[np.ndarray]] = ()) -> Replay:
  """Replays every record of VWs ``0..len(sources)-1`` one minibatch at a time at its recorded version.

  Args:
    records: dicts as in minibatches.jsonl (``vw_id``, ``minibatch_id``, ``version_global_clock``,
      ``version_local_updates``).
    spec, params0, tx: the model, W0 (per-layer params) and the optimizer (one state per VW).
    sources: per replayed VW, its minibatches (``.get(minibatch_id) -> (images, labels)``).
    num_inflight: Nm.
    fixed_waves: VWs ``len(sources)..`` whose wave updates are given (scripted peers), flat float32 each.

  Raises:
    AssertionError: the records' versions cannot be satisfied in any order (a WSP violation).
  """
  layout = ParamLayout.from_layer_params(params0)
  num_vws = len(sources)

  def loss(params, x, y):
    return stages_lib.cross_entropy_loss(models.apply_layers(spec.layers, params, x), y)

  grad_fn = jax.jit(jax.grad(loss))
  by_vw = [sorted((r for r in records if r["vw_id"] == v), key=lambda r: r["minibatch_id"]) for v in range(num_vws)]
  result = Replay(layout.flatten(params0), [{} for _ in range(num_vws)], fixed_waves, num_inflight)
  states = [tx.init(params0) for _ in range(num_vws)]
  done = [0] * num_vws
  total = sum(len(b) for b in by_vw)
  while sum(done) < total:
    progressed = False
    for v in range(num_vws):
      if done[v] == len(by_vw[v]):
        continue
      r = by_vw[v][done[v]]
      g, m = r["version_global_clock"], r["version_local_updates"]
      if not all(done[u] >= g * num_inflight for u in range(num_vws)):
        continue
      assert all(len(w) >= g for w in fixed_waves), f"VW {v} minibatch {r['minibatch_id']} used global clock {g}"
      params = layout.unflatten(result.local_weights(v, g, m))
      grads = grad_fn(params, *sources[v].get(r["minibatch_id"]))
      u, states[v] = tx.update(grads, states[v], params)
      result.updates[v][r["minibatch_id"]] = layout.flatten(jax.device_get(u))
      done[v] += 1
      progressed = True
    assert progressed, f"records cannot be replayed: versions wait on each other (done per VW: {done})"
  return result


def replay_final_weights(records: list[dict], spec: models.ModelSpec, params0: list, tx: optax.GradientTransformation,
                         sources: list, num_inflight: int) -> np.ndarray:
  """Returns the flat final global weights implied by ``records`` (dicts as in minibatches.jsonl).

  Raises:
    AssertionError: the records' versions cannot be satisfied in any order (a WSP violation).
  """
  result = replay(records, spec, params0, tx, sources, num_inflight)
  num_vws = len(sources)
  num_waves = min(sum(1 for r in records if r["vw_id"] == v) for v in range(num_vws)) // num_inflight
  return result.global_weights(num_waves)
