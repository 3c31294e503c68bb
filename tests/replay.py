"""Sequential replay oracle for multi-VW WSP runs: recompute every update from the recorded weight versions.

A record ``(vw, p, version_global_clock g, version_local_updates m)`` says minibatch p of VW v used
``W(g, m) = W0 + sum_{c<g} sum_v' U[v', c] + sum_{j<m, wave(j) >= g} u[v, j]`` where ``u[v, j]`` is VW v's optax
update of its minibatch j and ``U[v, c]`` the sum of its wave c (HetPipe §5). Replaying the records in any order
that respects those dependencies, one minibatch at a time on one device, gives the final global weights
``W0 + sum_c sum_v U[v, c]`` that a correct runtime (or virtual-time run) must reproduce.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from hetpipe_jax import models
from hetpipe_jax.runtime import stages as stages_lib
from hetpipe_jax.runtime.param_layout import ParamLayout


def replay_final_weights(records: list[dict], spec: models.ModelSpec, params0: list, tx: optax.GradientTransformation,
                         sources: list, num_inflight: int) -> np.ndarray:
  """Returns the flat final global weights implied by ``records`` (dicts as in minibatches.jsonl).

  Raises:
    AssertionError: the records' versions cannot be satisfied in any order (a WSP violation).
  """
  layout = ParamLayout.from_layer_params(params0)
  w0 = layout.flatten(params0)
  num_vws = len(sources)

  def loss(params, x, y):
    return stages_lib.cross_entropy_loss(models.apply_layers(spec.layers, params, x), y)

  grad_fn = jax.jit(jax.grad(loss))
  by_vw = [sorted((r for r in records if r["vw_id"] == v), key=lambda r: r["minibatch_id"]) for v in range(num_vws)]
  updates: list[dict[int, np.ndarray]] = [{} for _ in range(num_vws)]  # vw -> minibatch -> flat update
  states = [tx.init(params0) for _ in range(num_vws)]
  done = [0] * num_vws

  def wave_sum(v: int, c: int) -> np.ndarray:
    total = np.zeros_like(w0)
    for j in range(c * num_inflight, (c + 1) * num_inflight):
      total += updates[v][j]
    return total

  global_cache = {0: w0}

  def global_weights(g: int) -> np.ndarray:
    if g not in global_cache:
      w = global_weights(g - 1).copy()
      for v in range(num_vws):
        w += wave_sum(v, g - 1)
      global_cache[g] = w
    return global_cache[g]

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
      w = global_weights(g).copy()
      for j in range(g * num_inflight, m):
        w += updates[v][j]
      params = layout.unflatten(w)
      grads = grad_fn(params, *sources[v].get(r["minibatch_id"]))
      u, states[v] = tx.update(grads, states[v], params)
      updates[v][r["minibatch_id"]] = layout.flatten(jax.device_get(u))
      done[v] += 1
      progressed = True
    assert progressed, f"records cannot be replayed: versions wait on each other (done per VW: {done})"
  num_waves = min(len(b) for b in by_vw) // num_inflight
  return global_weights(num_waves)
