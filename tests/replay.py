"""Sequential replay oracle for multi-VW WSP runs: recompute every update from the recorded weight versions.

A record ``(vw v, minibatch p, version_vector_clock vc, version_local_updates m)`` says minibatch p of VW v used

  ``W(vc, m) = G(vc) + sum_{j: vc[v] * Nm <= j < m} u[v, j]``

where ``u[v, j]`` is VW v's optax update of its minibatch j and ``G(vc)`` the global weights its last pull carried
(HetPipe §5). The PS adds wave updates ``U[v, c]`` (the sum of VW v's minibatch updates of wave c) in the order it
logs (``ps_applied.jsonl``: arrival order under ``ps_apply="on_receipt"``, wave by wave in VW order under
``"clock_aligned"``), so ``G(vc) = W0 + the first sum(vc) logged updates``, and those must be VW u's waves
``0..vc[u]-1`` for every u. Replaying the records in any order that respects those dependencies, one minibatch at a
time on one device, gives the final global weights (W0 + every logged update) that a correct runtime (or
virtual-time run) must reproduce.
"""

from __future__ import annotations

import json
from typing import Sequence

import jax
import numpy as np
import optax

from hetpipe_jax import models
from hetpipe_jax.runtime.param_layout import ParamLayout
from tests.pipeline_util import model_step_fn


def read_applied_order(workdir, shard: int | None = None) -> list[tuple[int, int]]:
  """The PS's ``(wave_id, vw_id)`` application order from a run's ``ps_applied.jsonl`` (sharded PS: that shard's)."""
  with open(f"{workdir}/ps_applied.jsonl", encoding="utf-8") as f:
    return [(r["wave_id"], r["vw_id"]) for r in map(json.loads, f) if shard is None or r.get("shard", 0) == shard]


def read_applied_scales(workdir) -> list[float]:
  """Per applied wave, the factor the PS applied it with (``ps_applied.jsonl``'s ``scale``; 1.0 where absent)."""
  with open(f"{workdir}/ps_applied.jsonl", encoding="utf-8") as f:
    return [float(r.get("scale", 1.0)) for r in map(json.loads, f)]


class ShardedReplay:
  """Sharded parameter servers (HetPipe §8.1): one :class:`Replay` per shard over the same updates, each following
  its shard's log; a version's weights take each shard's slice from that shard's replay at the shard's vector clock.

  Args:
    replays: per shard, a :class:`Replay` sharing one ``updates`` list.
    index: per shard, its flat element indices (every element in exactly one shard).
  """

  def __init__(self, replays: Sequence[Replay], index: Sequence[np.ndarray]):
    self.replays = list(replays)
    self.index = [np.asarray(i) for i in index]
    self.updates = self.replays[0].updates

  def local_weights(self, v: int, shard_vector_clocks: Sequence[Sequence[int]], m: int) -> np.ndarray:
    out = np.zeros_like(self.replays[0].w0)
    for r, idx, vc in zip(self.replays, self.index, shard_vector_clocks):
      out[idx] = r.local_weights(v, vc, m)[idx]
    return out

  def final_global_weights(self) -> np.ndarray:
    out = np.zeros_like(self.replays[0].w0)
    for r, idx in zip(self.replays, self.index):
      out[idx] = r.final_global_weights()[idx]
    return out


class Replay:
  """The replayed updates of every VW and the global weights they imply.

  Attributes:
    w0: flat initial weights.
    updates: per replayed VW, minibatch id -> its flat update.
    fixed_waves: per scripted VW (ids after the replayed ones), its given flat wave updates.
    num_inflight: Nm.
    applied_order: the PS's ``(wave, vw)`` application order, or None for the clock-aligned order.
    applied_scales: per entry of ``applied_order``, the factor the PS added it with (``ps_staleness_scaling``);
      None: 1 each.
  """

  def __init__(self, w0: np.ndarray, updates: list, fixed_waves: Sequence[Sequence[np.ndarray]], num_inflight: int,
               applied_order: Sequence[Sequence[int]] | None = None,
               applied_scales: Sequence[float] | None = None):
    self.applied_scales = None if applied_scales is None else [float(x) for x in applied_scales]
    self.w0 = w0
    self.updates = updates
    self.num_inflight = num_inflight
    self.fixed_waves = [list(w) for w in fixed_waves]
    self.applied_order = None if applied_order is None else [(int(c), int(v)) for c, v in applied_order]
    self._global = {0: w0}
    self._prefix = {0: w0}

  @property
  def num_vws(self) -> int:
    return len(self.updates) + len(self.fixed_waves)

  def wave_sum(self, v: int, c: int) -> np.ndarray:
    """VW ``v``'s update of wave ``c``."""
    if v >= len(self.updates):
      return np.asarray(self.fixed_waves[v - len(self.updates)][c], np.float32)
    total = np.zeros_like(self.w0)
    for j in range(c * self.num_inflight, (c + 1) * self.num_inflight):
      total += self.updates[v][j]
    return total

  def global_weights(self, g: int) -> np.ndarray:
    """``W0 + sum_{c<g} sum_v U[v, c]``, VWs in order within a wave (the clock-aligned PS's order)."""
    if g not in self._global:
      w = self.global_weights(g - 1).copy()
      for v in range(self.num_vws):
        w += self.wave_sum(v, g - 1)
      self._global[g] = w
    return self._global[g]

  def check_prefix(self, vector_clock: Sequence[int]) -> None:
    """Asserts that the first ``sum(vc)`` logged updates are exactly VW u's waves ``0..vc[u]-1`` for every u."""
    k = sum(vector_clock)
    assert k <= len(self.applied_order), f"vector clock {list(vector_clock)} beyond the PS log ({k} > " \
                                         f"{len(self.applied_order)})"
    counts = [0] * self.num_vws
    for c, v in self.applied_order[:k]:
      assert c == counts[v], f"PS log applies VW {v}'s wave {c} before its wave {counts[v]}"
      counts[v] += 1
    assert counts == list(vector_clock), f"vector clock {list(vector_clock)} is not a prefix of the PS log " \
                                         f"(its first {k} entries hold {counts})"

  def global_weights_at(self, vector_clock: Sequence[int]) -> np.ndarray:
    """G(vc): W0 plus the PS's first ``sum(vc)`` logged updates, in its order."""
    if self.applied_order is None:
      g = min(vector_clock)
      assert all(c == g for c in vector_clock), f"vector clock {list(vector_clock)} needs the PS's log"
      return self.global_weights(g)
    self.check_prefix(vector_clock)
    k = sum(vector_clock)
    if k not in self._prefix:
      j = max(i for i in self._prefix if i < k)
      w = self._prefix[j].copy()
      for i, (c, v) in enumerate(self.applied_order[j:k], start=j):
        if self.applied_scales is None:
          w += self.wave_sum(v, c)
        else:
          w += np.float32(self.applied_scales[i]) * self.wave_sum(v, c)
      self._prefix[k] = w
    return self._prefix[k]

  def final_global_weights(self, applied_order: Sequence[Sequence[int]] | None = None) -> np.ndarray:
    """W0 plus every logged update; ``applied_order`` replaces the log first (e.g. once scripted peers finished)."""
    if applied_order is not None:
      self.applied_order = [(int(c), int(v)) for c, v in applied_order]
    counts = [0] * self.num_vws
    for _, v in self.applied_order:
      counts[v] += 1
    return self.global_weights_at(counts)

  def local_weights(self, v: int, vector_clock: Sequence[int] | int, m: int) -> np.ndarray:
    """``W(vc, m)`` of VW ``v``: G(vc) plus its own updates ``vc[v] * Nm .. m - 1`` (an int g means vc = (g,)*N)."""
    if isinstance(vector_clock, (int, np.integer)):
      vector_clock = (int(vector_clock),) * self.num_vws
    w = self.global_weights_at(vector_clock).copy()
    for j in range(vector_clock[v] * self.num_inflight, m):
      w += self.updates[v][j]
    return w


def replay(records: list[dict], spec: models.ModelSpec, params0: list, tx: optax.GradientTransformation,
           sources: list, num_inflight: int, fixed_waves: Sequence[Sequence[np.ndarray]] = (),
           applied_order: Sequence[Sequence[int]] | None = None,
           shards: Sequence[tuple[np.ndarray, Sequence[Sequence[int]]]] | None = None,
           applied_scales: Sequence[float] | None = None) -> "Replay | ShardedReplay":
  """Replays every record of VWs ``0..len(sources)-1`` one minibatch at a time at its recorded version.

  Args:
    records: dicts as in minibatches.jsonl (``vw_id``, ``minibatch_id``, ``version_vector_clock``,
      ``version_global_clock``, ``version_local_updates``).
    spec, params0, tx: the model, W0 (per-layer params) and the optimizer (one state per VW).
    sources: per replayed VW, its minibatches (``.get(minibatch_id) -> (images, labels)``).
    num_inflight: Nm.
    fixed_waves: VWs ``len(sources)..`` whose wave updates are given (scripted peers), flat float32 each.
    applied_order: the PS's ``(wave_id, vw_id)`` log (``ps_applied.jsonl``); None: the clock-aligned order, which
      then requires every record's vector clock to be uniform.
    shards: sharded parameter servers: per shard ``(flat element indices, its (wave_id, vw_id) log)``; the records
      then carry ``version_shard_vector_clocks`` and each shard's slice follows its own log.
    applied_scales: per entry of ``applied_order``, the factor the PS applied it with (``ps_applied.jsonl``'s
      ``scale``); None: 1 each.

  Raises:
    AssertionError: the records' versions cannot be satisfied in any order (a WSP violation).
  """
  layout = ParamLayout.from_layer_params(params0)
  num_vws = len(sources)

  grad_fn = model_step_fn(spec, jax.grad)  # jax.jit(jax.grad(loss)), shared by every replay of the model
  by_vw = [sorted((r for r in records if r["vw_id"] == v), key=lambda r: r["minibatch_id"]) for v in range(num_vws)]
  result = Replay(layout.flatten(params0), [{} for _ in range(num_vws)], fixed_waves, num_inflight, applied_order,
                  applied_scales)
  if shards is not None:
    result = ShardedReplay([Replay(result.w0, result.updates, fixed_waves, num_inflight, log) for _, log in shards],
                           [idx for idx, _ in shards])
  total_vws = num_vws + len(fixed_waves)
  states = [tx.init(params0) for _ in range(num_vws)]
  done = [0] * num_vws
  total = sum(len(b) for b in by_vw)
  while sum(done) < total:
    progressed = False
    for v in range(num_vws):
      if done[v] == len(by_vw[v]):
        continue
      r = by_vw[v][done[v]]
      vc, m = tuple(r["version_vector_clock"]), r["version_local_updates"]
      assert len(vc) == total_vws and min(vc) == r["version_global_clock"], r
      shard_vcs = [tuple(c) for c in r["version_shard_vector_clocks"]] if shards is not None else [vc]
      if shards is not None:
        assert len(shard_vcs) == len(shards) and all(
            min(c[u] for c in shard_vcs) == vc[u] for u in range(total_vws)), r
      if not all(done[u] >= max(c[u] for c in shard_vcs) * num_inflight for u in range(num_vws)):
        continue
      assert all(len(w) >= c for w, c in zip(fixed_waves, vc[num_vws:])), \
          f"VW {v} minibatch {r['minibatch_id']} used vector clock {vc}"
      params = layout.unflatten(result.local_weights(v, shard_vcs if shards is not None else vc, m))
      grads = grad_fn(params, *sources[v].get(r["minibatch_id"]))
      u, states[v] = tx.update(grads, states[v], params)
      result.updates[v][r["minibatch_id"]] = layout.flatten(jax.device_get(u))
      done[v] += 1
      progressed = True
    assert progressed, f"records cannot be replayed: versions wait on each other (done per VW: {done})"
  return result


def replay_final_weights(records: list[dict], spec: models.ModelSpec, params0: list, tx: optax.GradientTransformation,
                         sources: list, num_inflight: int, applied_order: Sequence[Sequence[int]],
                         shards: Sequence[tuple[np.ndarray, Sequence[Sequence[int]]]] | None = None,
                         applied_scales: Sequence[float] | None = None) -> np.ndarray:
  """Returns the flat final global weights implied by ``records`` (dicts as in minibatches.jsonl) and the PS's
  ``applied_order`` (``(wave_id, vw_id)`` as in ps_applied.jsonl).

  Raises:
    AssertionError: the records' versions cannot be satisfied in any order (a WSP violation), or the log does not
      hold every VW's waves once each.
  """
  result = replay(records, spec, params0, tx, sources, num_inflight, applied_order=applied_order, shards=shards,
                  applied_scales=applied_scales)
  num_vws = len(sources)
  num_waves = min(sum(1 for r in records if r["vw_id"] == v) for v in range(num_vws)) // num_inflight
  for log in ([applied_order] if shards is None else [log for _, log in shards]):
    assert sorted(log) == sorted((c, v) for c in range(num_waves) for v in range(num_vws)), \
        "the PS log (every shard's) must apply every VW's waves exactly once"
  return result.final_global_weights()
