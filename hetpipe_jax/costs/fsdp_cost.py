"""Fully sharded data parallelism (ZeRO-3 / PyTorch FSDP / ``jax.sharding`` over a data axis): time, memory, split.

Costs layer: standard library and numpy only. Method ``fsdp`` of :mod:`hetpipe_jax.rules.methods`.

Setting. Every GPU g of the cluster runs the whole model on its own ``b_g`` examples of a step's global batch
``B = N x batch`` (the examples per step of Horovod with one worker per GPU) and holds a shard ``f_g`` of every
layer's parameters, gradients and optimizer state (``sum_g f_g = 1``). Per step and layer l (``P_l`` parameter
bytes), as ZeRO-3 (Rajbhandari et al., SC'20, §5.3) and FSDP do:

* forward: all-gather layer l's parameters (``AG_l``), run its forward; the gathered copy is freed;
* backward: all-gather them again (``AG_l``), run its backward, reduce-scatter its gradient (``RS_l``: each GPU
  receives the sum over GPUs of its own shard);
* the optimizer step on the local shard (memory-bound and small; not timed, as no method's optimizer step is).

The collectives are per layer of the profile (FSDP's wrapping unit: a transformer block, a ResNet bottleneck).

Collectives: the ring rule of :mod:`hetpipe_jax.costs.allreduce_cost`, once. An all-gather or a reduce-scatter of
P bytes among N GPUs is half a ring all-reduce of P: ``(N-1)/N x P / bandwidth + (N-1) x latency``
(``allreduce_cost.ring_groups_time_s``, halved; the group is every GPU, a ring over the inter-node link when it spans
nodes, with the same shared-NIC rule as the all-reduce methods). Uneven shards are padded to the largest (NCCL's
collectives take equal buffers): ``P -> N x max_g f_g x P``. So each GPU sends ``3 (N-1)/N x P`` bytes per step with
even shards (ZeRO's 1.5x of a data-parallel all-reduce).

Time. The per-layer collectives hold the GPUs in lock-step, so layer l's forward (backward) lasts ``F_l = max_g
F_{g,l}`` (``B_l``), where ``F_{g,l}`` is the cost model's forward time of l on g's type scaled by ``b_g / batch``
(linear in examples, as :func:`~hetpipe_jax.costs.profile_format.micro_batch_profile`). Stated assumption,
overlap (FSDP's prefetch): the gather of a layer runs while the previous one computes and a reduce-scatter while
the next backward computes, so ``step = sum_l max(F_l, AG_l) + sum_l max(B_l, AG_l + RS_l)``. Beside it, the
no-overlap bound ``step_serial = sum_l (F_l + B_l) + sum_l (2 AG_l + RS_l)``. Rate: ``B / step`` examples/s.

Memory of GPU g: ``f_g (2 P + O)`` (its shard of parameters, gradients and optimizer state) ``+ 3 max_l P_l`` (two
gathered layers, the one computing and the one prefetched, and one layer's unsharded gradient before its
reduce-scatter) ``+ b_g / batch x (max(stash, input) + workspace)`` (its examples' activations: the whole model as
one stage under :mod:`hetpipe_jax.costs.cost_model`'s stash and workspace rule, linear in examples). With
``remat`` (activation checkpointing per layer, the usual FSDP setting for transformers) a GPU keeps each layer's
input (or its stash where that is smaller), plus one layer's stash and workspace (the layer being recomputed and differentiated), instead of the whole
stash, and every backward first recomputes its layer's forward (``B_l -> F_l + B_l``).

Variants (``VARIANTS``):

* ``even`` (ZeRO-3): ``f_g = 1/N``, ``b_g = batch``;
* ``hetero`` (Cephalo, Guo et al., arXiv 2411.01075: compute from speed, training state from memory, decoupled):
  ``b_g`` minimises the slowest GPU's compute ``max_g b_g tau_g`` (``tau_g``: g's compute per example) subject to
  ``sum_g b_g = B`` and g's activations fitting its memory (greedy, one example at a time to the GPU that would
  finish it first: optimal for a min-max of linear costs); then the shards follow memory: ``f_g`` minimises the
  largest shard subject to every GPU holding its own (``f_g S + fixed_g <= cap_g``, ``S = 2 P + O``, ``fixed_g``
  the rest of g's memory; water-filling). So a GPU whose free memory cannot hold an even share gets what it holds
  and the others share the rest evenly. Not shards proportional to capacity: with collectives padded to the largest
  shard, those would cost ``N max_g f_g`` times the even shards' communication (1.92x on HetPipe's cluster) for
  memory that is not needed; the smallest largest shard is the cheapest sharding that fits. The examples' memory cap
  is tried two ways, the memory left after the gathered layers and that left after an even shard too (no padding, a
  small-memory fast GPU gets fewer examples); the plan with the shorter step is kept.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

import numpy as np

from hetpipe_jax.costs import allreduce_cost
from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.costs import cost_model
from hetpipe_jax.costs.cluster import ClusterSpec, Gpu
from hetpipe_jax.costs.profile_format import ModelProfile

VARIANTS = ("even", "hetero")
VARIANT_LABELS = {"even": "even shards (ZeRO-3)", "hetero": "shards by memory, batch by speed"}
MS_PER_S = 1e3


class FsdpInfeasibleError(ValueError):
  """The model does not fit the cluster under fsdp (the message names the GPU and the bytes)."""


@dataclasses.dataclass(frozen=True)
class FsdpPlan:
  """One fsdp configuration and its closed-form costs (module docstring).

  Attributes (the configuration and the step's totals first, then per GPU ``[N]`` and per layer ``[L]``):
    variant: one of :data:`VARIANTS`.
    remat: activation checkpointing per layer.
    batch_size: the profile's batch (the per-GPU batch of the even variant).
    step_s: one step under the overlap assumption (shared NICs), seconds.
    step_no_overlap_s: the no-overlap bound (shared NICs), seconds.
    step_no_shared_nic_s: ``step_s`` with every ring at full link speed.
    bytes_sent_per_gpu: bytes each GPU sends per step (two all-gathers and a reduce-scatter of every layer).
    cross_node_bytes: bytes crossing nodes per step.
    gpus: every GPU of the cluster, in ``cluster.gpus()`` order.
    examples: ``b_g`` per GPU; they sum to ``global_batch``.
    shards: ``f_g`` per GPU; they sum to 1.
    memory_bytes, capacity_bytes: per GPU, its memory need and its usable memory.
    compute_s: per GPU, forward+backward of its examples alone (no collectives), seconds.
    layer_forward_s, layer_backward_s: per layer, the slowest GPU's forward (backward) time, seconds. ``[L]``.
    allgather_s: per layer, one all-gather of its (padded) parameters, seconds (= one reduce-scatter), with the
      shared-NIC rule. ``[L]``.
    allgather_no_shared_nic_s: the same, every ring at full link speed.
  """

  variant: str
  remat: bool
  batch_size: int
  step_s: float
  step_no_overlap_s: float
  step_no_shared_nic_s: float
  bytes_sent_per_gpu: float
  cross_node_bytes: float
  gpus: tuple[Gpu, ...]
  examples: tuple[int, ...]
  shards: tuple[float, ...]
  memory_bytes: tuple[float, ...]
  capacity_bytes: tuple[float, ...]
  compute_s: tuple[float, ...]
  layer_forward_s: tuple[float, ...]
  layer_backward_s: tuple[float, ...]
  allgather_s: tuple[float, ...]
  allgather_no_shared_nic_s: tuple[float, ...]

  @property
  def global_batch(self) -> int:
    return int(sum(self.examples))

  @property
  def examples_per_s(self) -> float:
    return self.global_batch / self.step_s

  @property
  def examples_per_s_no_overlap(self) -> float:
    return self.global_batch / self.step_no_overlap_s

  @property
  def memory_use(self) -> float:
    """The fullest GPU's memory over its capacity."""
    return max(m / c for m, c in zip(self.memory_bytes, self.capacity_bytes))

  def exposed_comm_s(self, shared_nic: bool = True) -> float:
    """The step's time beyond the slowest GPU's compute: the collectives the overlap does not hide."""
    return (self.step_s if shared_nic else self.step_no_shared_nic_s) - max(self.compute_s)

  def notes(self) -> list[str]:
    types = {}
    for g, b, f in zip(self.gpus, self.examples, self.shards):
      types.setdefault(g.gpu_type, (b, f))
    split = ", ".join(f"{t}: {b} examples, {100 * f:.1f}% of the state" for t, (b, f) in types.items())
    name = f"fsdp {self.variant}{' remat' if self.remat else ''}"
    return [f"{name}: per GPU {split}",
            f"{name}: communication overlapped with compute (assumed); with no overlap "
            f"{self.examples_per_s_no_overlap:.1f} examples/s (step {1e3 * self.step_no_overlap_s:.1f} ms instead of "
            f"{1e3 * self.step_s:.1f} ms); each GPU sends {self.bytes_sent_per_gpu / 2**20:.1f} MiB per step"]


def per_example_layer_ms(profile: ModelProfile, cluster: ClusterSpec, config: cost_model.CostModelConfig
                         ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Per GPU type, ``(forward ms [L], backward ms [L])`` of one example (the profile's times over its batch)."""
  fwd_prefix = cost_model.forward_prefix_ms(profile, cluster, config)
  out = {}
  for name, t in cluster.gpu_types.items():
    total = cost_model.layer_times_ms(profile, t, config)
    fwd = np.minimum(np.diff(fwd_prefix[name]), total)
    out[name] = (fwd / profile.batch_size, (total - fwd) / profile.batch_size)
  return out


def activation_bytes_per_example(profile: ModelProfile, remat: bool = False) -> float:
  """One example's activation memory (module docstring), from the cost model's stash and workspace rule
  (:func:`hetpipe_jax.costs.cost_model.build_stage_costs`, ``workspace_max``): the whole model as one stage,
  ``(max(stash, input) + workspace[0, L]) / batch``; with ``remat``, every checkpointed layer's input kept (a
  layer whose stash is smaller than its input, e.g. a ReLU's mask, keeps its stash: checkpointing it saves nothing)
  plus the largest ``stash_k + workspace[k, k + 1]`` (layer k recomputed and differentiated alone), over
  ``batch``."""
  costs = _memory_costs(profile)
  n = profile.num_layers
  if remat:
    stash = np.diff(costs.stash_prefix)
    kept = float(np.sum(np.minimum(costs.boundary_bytes[:n], stash)))  # a layer whose stash is smaller keeps it
    one = max(float(stash[k] + costs.workspace_max[k, k + 1]) for k in range(n))
    return (kept + one) / profile.batch_size
  whole = max(float(costs.stash_prefix[n]), float(costs.boundary_bytes[0])) + float(costs.workspace_max[0, n])
  return whole / profile.batch_size


def _memory_costs(profile: ModelProfile) -> cost_model.StageCosts:
  """The cost model's per-range memory terms of ``profile`` (no GPU type needed: a one-type placeholder cluster)."""
  placeholder = cluster_lib.cluster_from_dict({
      "name": "memory_terms", "gpu_types": [{"name": "t", "peak_fp32_flops_per_s": 1.0, "peak_fp16_flops_per_s": 1.0,
                                              "memory_bytes": 1, "memory_bandwidth_bytes_per_s": 1.0}],
      "nodes": [{"name": "n", "gpus": ["t"]}], "intra_node_link": {"name": "l", "bandwidth_bytes_per_s": 1.0},
      "inter_node_link": {"name": "l", "bandwidth_bytes_per_s": 1.0}})
  return cost_model.build_stage_costs(profile, placeholder)


def state_bytes(profile: ModelProfile) -> float:
  """``S = 2 P + O``: parameters, gradients and optimizer state of the whole model, the bytes that are sharded."""
  return float(sum(2 * l.param_bytes + l.optimizer_state_bytes for l in profile.layers))


def gathered_bytes(profile: ModelProfile) -> float:
  """``3 max_l P_l``: two gathered layers and one layer's unsharded gradient."""
  return 3.0 * max((l.param_bytes for l in profile.layers), default=0)


def split_examples(per_example_s: Sequence[float], total: int, caps: Sequence[int]) -> list[int]:
  """Integer ``b_g`` (summing to ``total``, each at most ``caps[g]``) minimising ``max_g b_g x per_example_s[g]``.

  Greedy: each example goes to the GPU that would finish its share soonest (ties: the lower index).

  Raises:
    FsdpInfeasibleError: the caps sum to less than ``total``.
  """
  if sum(caps) < total:
    raise FsdpInfeasibleError(f"the GPUs' memory holds the activations of {sum(caps)} examples, the step has "
                              f"{total}")
  b = [0] * len(per_example_s)
  heap = [(per_example_s[g], g) for g in range(len(b)) if caps[g] > 0]
  heapq.heapify(heap)
  for _ in range(total):
    _, g = heapq.heappop(heap)
    b[g] += 1
    if b[g] < caps[g]:
      heapq.heappush(heap, ((b[g] + 1) * per_example_s[g], g))
  return b


def memory_shards(state: float, fixed: Sequence[float], capacity: Sequence[float]) -> list[float]:
  """Shards ``f_g`` (summing to 1, each >= 0) with the smallest largest shard such that every GPU's memory holds its
  shard: ``f_g state + fixed[g] <= capacity[g]``.

  Water-filling: ``f_g = min(t, (capacity[g] - fixed[g]) / state)`` at the level ``t`` where they sum to 1 (even
  shards when every GPU holds 1/N).

  Raises:
    FsdpInfeasibleError: the GPUs' free memory holds less than the whole state (names the shortfall).
  """
  room = np.maximum(0.0, np.asarray(capacity, np.float64) - np.asarray(fixed, np.float64))
  if state <= 0:
    return [1.0 / len(room)] * len(room)
  room = room / state
  if room.sum() < 1.0:
    raise FsdpInfeasibleError(f"the GPUs' memory left after activations and gathered layers holds "
                              f"{100 * room.sum():.0f}% of the {state / 2**30:.2f} GiB of sharded state")
  lo, hi = 0.0, 1.0
  for _ in range(200):
    t = 0.5 * (lo + hi)
    if np.minimum(t, room).sum() >= 1.0:
      hi = t
    else:
      lo = t
  f = np.minimum(hi, room)
  return [float(x) for x in f / f.sum()]


def plan_fsdp(cluster: ClusterSpec, profile: ModelProfile, variant: str = "even",
              config: cost_model.CostModelConfig = cost_model.CostModelConfig(), remat: bool = False) -> FsdpPlan:
  """The fsdp configuration ``variant`` (with or without ``remat``) on every GPU of ``cluster`` and its costs (module
  docstring).

  Raises:
    ValueError: unknown variant.
    FsdpInfeasibleError: a GPU's memory does not hold its shard, gathered layers and activations.
  """
  if variant not in VARIANTS:
    raise ValueError(f"unknown fsdp variant {variant!r}: use one of {list(VARIANTS)}")
  gpus = tuple(cluster.gpus())
  n, batch = len(gpus), profile.batch_size
  per_ex = per_example_layer_ms(profile, cluster, config)
  cap = [float(cluster.gpu_types[g.gpu_type].memory_bytes - cluster.gpu_types[g.gpu_type].reserved_bytes)
         for g in gpus]
  act, state, gathered = activation_bytes_per_example(profile, remat), state_bytes(profile), gathered_bytes(profile)
  name = f"fsdp {variant}{' remat' if remat else ''}"
  if variant == "even":
    return _plan(cluster, profile, variant, remat, gpus, per_ex, cap, [batch] * n, [1.0 / n] * n)
  tau = [float(per_ex[g.gpu_type][0].sum() + per_ex[g.gpu_type][1].sum()) for g in gpus]
  # Two memory caps on the examples: the memory left after the gathered layers (the shards then follow memory and may
  # be uneven, padding the collectives), and the memory left after an even shard as well (no padding); the faster.
  candidates, errors = [], []
  for reserved in (0.0, state / n):
    caps = [int(max(0.0, c - gathered - reserved) // act) if act > 0 else n * batch for c in cap]
    try:
      examples = split_examples(tau, n * batch, caps)
      shards = memory_shards(state, [gathered + b * act for b in examples], cap)
      candidates.append(_plan(cluster, profile, variant, remat, gpus, per_ex, cap, examples, shards))
    except FsdpInfeasibleError as e:
      errors.append(str(e))
  if not candidates:
    raise FsdpInfeasibleError(f"{name} does not fit: {errors[0]} (activations of {act / 2**30:.2f} GiB per example)")
  return min(candidates, key=lambda p: p.step_s)


def _plan(cluster: ClusterSpec, profile: ModelProfile, variant: str, remat: bool, gpus: tuple[Gpu, ...],
          per_ex: dict[str, tuple[np.ndarray, np.ndarray]], cap: Sequence[float], examples: Sequence[int],
          shards: Sequence[float]) -> FsdpPlan:
  """The costs of one split (module docstring).

  Raises:
    FsdpInfeasibleError: a GPU's memory does not hold its shard, gathered layers and activations.
  """
  n, batch = len(gpus), profile.batch_size
  act, state, gathered = activation_bytes_per_example(profile, remat), state_bytes(profile), gathered_bytes(profile)
  memory = [f * state + gathered + b * act for f, b in zip(shards, examples)]
  for g, m, c, b in zip(gpus, memory, cap, examples):
    if m > c * (1 + 1e-9):
      raise FsdpInfeasibleError(f"fsdp {variant}{' remat' if remat else ''} does not fit: {g.gpu_id} ({g.gpu_type}) "
                                f"needs {m / 2**30:.2f} GiB > {c / 2**30:.2f} GiB usable (its shard of "
                                f"{state / 2**30:.2f} GiB of state, 3 gathered layers, {b} examples' activations of "
                                f"{act / 2**30:.2f} GiB each)")
  fwd = np.array([b * per_ex[g.gpu_type][0] for g, b in zip(gpus, examples)]) / MS_PER_S  # [N, L] seconds
  bwd = np.array([b * per_ex[g.gpu_type][1] for g, b in zip(gpus, examples)]) / MS_PER_S
  if remat:
    bwd = bwd + fwd  # each backward recomputes its layer's forward
  pad = n * max(shards)
  params = [float(l.param_bytes) for l in profile.layers]
  ag = np.array([0.5 * allreduce_cost.ring_groups_time_s([(pad * p, gpus)], cluster, True) for p in params])
  ag_free = np.array([0.5 * allreduce_cost.ring_groups_time_s([(pad * p, gpus)], cluster, False) for p in params])
  f_l, b_l = fwd.max(axis=0), bwd.max(axis=0)

  def overlapped(a):
    return float(np.sum(np.maximum(f_l, a)) + np.sum(np.maximum(b_l, 2 * a)))

  total = sum(params)
  return FsdpPlan(
      variant=variant, remat=remat, gpus=gpus, batch_size=batch, examples=tuple(examples), shards=tuple(shards),
      memory_bytes=tuple(memory), capacity_bytes=tuple(cap), compute_s=tuple(float(x) for x in (fwd + bwd).sum(1)),
      layer_forward_s=tuple(float(x) for x in f_l), layer_backward_s=tuple(float(x) for x in b_l),
      allgather_s=tuple(float(x) for x in ag), allgather_no_shared_nic_s=tuple(float(x) for x in ag_free),
      step_s=overlapped(ag), step_no_overlap_s=float(f_l.sum() + b_l.sum() + 3 * ag.sum()),
      step_no_shared_nic_s=overlapped(ag_free),
      bytes_sent_per_gpu=3.0 * (n - 1) / n * pad * total if n > 1 else 0.0,
      cross_node_bytes=1.5 * allreduce_cost.ring_groups_cross_node_bytes([(pad * total, gpus)]))
