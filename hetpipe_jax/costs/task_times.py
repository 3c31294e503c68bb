"""Per virtual worker and stage, how long each pipeline task and each PS transfer takes (HetPipe §4, §5, §7).

Costs layer: standard library and numpy only. The event engine (:mod:`hetpipe_jax.sim.engine`) and emulated devices
read these durations, in seconds; a plan file's are :func:`hetpipe_jax.planning.plan_times.task_times_from_plan`.

A task occupies its stage from its start until its output has reached its consumer (this is how the runtime,
:mod:`hetpipe_jax.runtime.virtual_worker`, observes a task as done), so a task's duration is its compute plus the
send of its output, serially, on the sender's side:

* forward on stage s < S-1: ``forward_s[s] + send_activation_s[s]`` (activation to stage s+1);
* backward on stage 0 < s < S-1: ``backward_s[s] + send_gradient_s[s-1]`` (gradient to stage s-1); on stage 0 the
  backward sends nothing (it completes the minibatch);
* forward+backward on the last stage: ``forward_backward_s + send_gradient_s[S-2]`` (nothing when S = 1).

Summed over a stage's tasks of one minibatch this is the cost model's stage time (compute plus the transfers at
both of the stage's cuts), so the engine and the planner agree on per-stage work.

Where the traffic goes (for the network rule, :mod:`hetpipe_jax.rules.network`): ``stage_nodes`` names each stage's
node, so the engine knows which sends cross nodes; ``push_legs`` / ``pull_legs`` split a wave push (pull reply) into
its per-(node, node) transfers; ``allreduce_shared_nic_s`` is the all-reduce with the rings crossing a node's NIC
served one after another. Synthetic times (:func:`uniform_task_times`) have none of these (no NIC is modelled).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from hetpipe_jax.costs import cost_model
from hetpipe_jax.costs import fsdp_cost  # noqa: F401  (type of fsdp_task_times' argument)
from hetpipe_jax.costs.cluster import ClusterSpec
from hetpipe_jax.rules.network import Leg
from hetpipe_jax.rules.schedule import Task, TaskKind

S_PER_MS = 1e-3


def _check_durations(name: str, values: Sequence[float], length: int) -> None:
  if len(values) != length:
    raise ValueError(f"{name} has {len(values)} entries, expected {length}")
  for i, v in enumerate(values):
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
      raise ValueError(f"{name}[{i}] must be a finite non-negative number of seconds, got {v!r}")


@dataclasses.dataclass(frozen=True)
class VWTaskTimes:
  """Durations (seconds) of one virtual worker's tasks and PS transfers.

  Attributes:
    forward_s: per non-last stage, forward compute of one minibatch. Length S-1.
    backward_s: per non-last stage, backward compute. Length S-1.
    forward_backward_s: last stage, forward+backward compute (one task, HetPipe §4).
    send_activation_s: per cut b (stage b -> b+1), sending one minibatch's activation. Length S-1.
    send_gradient_s: per cut b (stage b+1 -> b), sending the gradient back. Length S-1.
    push_s: sending one wave's aggregated update to the parameter server (HetPipe §5).
    pull_s: receiving the global weights from the parameter server.
    allreduce_s: all-reduce BSP methods: one step's all-reduce of the gradients, from the moment the last VW
      enters it until every replica holds the sum (the same for every VW of a job; the engine takes the largest),
      every ring at full link speed.
    stage_nodes: per stage, the name of its GPU's node (length S), or None (unknown: no send crosses a NIC).
    push_legs: the push as transfers ``Leg(src node, dst node, seconds)`` sent one after another; their seconds sum
      to ``push_s``. None: one transfer that touches no NIC.
    pull_legs: the same for a pull reply (PS shard nodes to the stages' nodes); they sum to ``pull_s``.
    allreduce_shared_nic_s: ``allreduce_s`` with shared NICs (:mod:`hetpipe_jax.costs.allreduce_cost`); None:
      the same as ``allreduce_s``.

  Raises:
    ValueError: a negative or non-finite duration, per-stage lists of different lengths, ``stage_nodes`` of the
      wrong length, or legs that do not sum to their transfer's seconds.
  """

  forward_s: tuple[float, ...]
  backward_s: tuple[float, ...]
  forward_backward_s: float
  send_activation_s: tuple[float, ...]
  send_gradient_s: tuple[float, ...]
  push_s: float
  pull_s: float
  allreduce_s: float = 0.0
  stage_nodes: tuple[str | None, ...] | None = None
  push_legs: tuple[Leg, ...] | None = None
  pull_legs: tuple[Leg, ...] | None = None
  allreduce_shared_nic_s: float | None = None

  def __post_init__(self):
    n = len(self.forward_s)
    for name in ("forward_s", "backward_s", "send_activation_s", "send_gradient_s"):
      object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
      _check_durations(name, getattr(self, name), n)
    # Plain Python floats (a numpy scalar given here would make every simulated time a numpy scalar: the same
    # values, several times slower to add and compare in the engine).
    for name in ("forward_backward_s", "push_s", "pull_s", "allreduce_s"):
      _check_durations(name, [getattr(self, name)], 1)
      object.__setattr__(self, name, float(getattr(self, name)))
    if self.allreduce_shared_nic_s is not None:
      _check_durations("allreduce_shared_nic_s", [self.allreduce_shared_nic_s], 1)
      object.__setattr__(self, "allreduce_shared_nic_s", float(self.allreduce_shared_nic_s))
    if self.stage_nodes is not None:
      object.__setattr__(self, "stage_nodes", tuple(self.stage_nodes))
      if len(self.stage_nodes) != n + 1:
        raise ValueError(f"stage_nodes has {len(self.stage_nodes)} entries for {n + 1} stages")
    for name, total in (("push_legs", self.push_s), ("pull_legs", self.pull_s)):
      legs = getattr(self, name)
      if legs is None:
        continue
      legs = tuple(Leg(*leg) for leg in legs)
      _check_durations(name, [leg.seconds for leg in legs], len(legs))
      legs = tuple(Leg(leg.src, leg.dst, float(leg.seconds)) for leg in legs)
      object.__setattr__(self, name, legs)
      if not math.isclose(sum(leg.seconds for leg in legs), total, rel_tol=1e-9, abs_tol=1e-12):
        raise ValueError(f"{name} sum to {sum(leg.seconds for leg in legs)} s, not {name[:4]}_s = {total} s")

  def allreduce_time_s(self, shared_nic: bool) -> float:
    """One step's all-reduce in seconds, with NICs shared (``allreduce_shared_nic_s``, when known) or not."""
    if shared_nic and self.allreduce_shared_nic_s is not None:
      return self.allreduce_shared_nic_s
    return self.allreduce_s

  def output_leg(self, task: Task) -> Leg | None:
    """The inter-node send at the end of ``task`` (its output to its consumer's node), or None when the output
    stays on the node (or the nodes are unknown)."""
    nodes, s = self.stage_nodes, task.stage_id
    if nodes is None:
      return None
    if task.kind is TaskKind.FORWARD:
      leg = Leg(nodes[s], nodes[s + 1], self.send_activation_s[s])
    elif s > 0:  # backward (or the last stage's forward+backward) sends the gradient to stage s - 1
      leg = Leg(nodes[s], nodes[s - 1], self.send_gradient_s[s - 1])
    else:
      return None
    return leg if leg.inter_node else None

  @property
  def num_stages(self) -> int:
    return len(self.forward_s) + 1

  def task_duration_s(self, task: Task) -> float:
    """Seconds ``task`` occupies its stage: compute plus sending its output to its consumer (module docstring).

    Raises:
      ValueError: the task's stage or kind does not exist in this pipeline.
    """
    s, last = task.stage_id, self.num_stages - 1
    if task.kind is TaskKind.FORWARD_BACKWARD:
      if s != last:
        raise ValueError(f"task {task}: forward+backward runs only on the last stage {last}")
      return self.forward_backward_s + (self.send_gradient_s[s - 1] if s > 0 else 0.0)
    if not 0 <= s < last:
      raise ValueError(f"task {task}: {task.kind.name.lower()} tasks run on stages 0..{last - 1}")
    if task.kind is TaskKind.FORWARD:
      return self.forward_s[s] + self.send_activation_s[s]
    return self.backward_s[s] + (self.send_gradient_s[s - 1] if s > 0 else 0.0)

  def stage_time_s(self, stage_id: int) -> float:
    """Total seconds stage ``stage_id`` works per minibatch (all its tasks of one minibatch)."""
    if stage_id == self.num_stages - 1:
      return self.task_duration_s(Task(stage_id, TaskKind.FORWARD_BACKWARD, 0))
    return (self.task_duration_s(Task(stage_id, TaskKind.FORWARD, 0))
            + self.task_duration_s(Task(stage_id, TaskKind.BACKWARD, 0)))


def uniform_task_times(stage_ms: Sequence[float], fwd_fraction: float = 1.0 / 3.0, send_ms: float = 0.0,
                       push_ms: float = 0.0, pull_ms: float = 0.0) -> VWTaskTimes:
  """Synthetic task times: stage s computes ``stage_ms[s]`` per minibatch, a fraction ``fwd_fraction`` forward.

  Args:
    stage_ms: per stage, forward+backward compute of one minibatch in ms (e.g. ``[100, 200, 400, 100]`` for
      speed ratios up to 4x). Length S >= 1.
    fwd_fraction: forward share of a non-last stage's compute, in [0, 1] (backward ~ 2x forward by default).
    send_ms: every activation and every gradient send, ms.
    push_ms: wave push to the PS, ms.
    pull_ms: pull of the global weights, ms.

  Raises:
    ValueError: empty ``stage_ms``, negative times, or ``fwd_fraction`` outside [0, 1].
  """
  if not len(stage_ms):
    raise ValueError("stage_ms is empty: a virtual worker has at least one stage")
  _check_durations("stage_ms", list(stage_ms), len(stage_ms))
  if not 0.0 <= fwd_fraction <= 1.0:
    raise ValueError(f"fwd_fraction must be in [0, 1], got {fwd_fraction}")
  for name, v in (("send_ms", send_ms), ("push_ms", push_ms), ("pull_ms", pull_ms)):
    _check_durations(name, [v], 1)
  n = len(stage_ms) - 1
  return VWTaskTimes(
      forward_s=tuple(fwd_fraction * t * S_PER_MS for t in stage_ms[:-1]),
      backward_s=tuple((1.0 - fwd_fraction) * t * S_PER_MS for t in stage_ms[:-1]),
      forward_backward_s=stage_ms[-1] * S_PER_MS, send_activation_s=(send_ms * S_PER_MS,) * n,
      send_gradient_s=(send_ms * S_PER_MS,) * n, push_s=push_ms * S_PER_MS, pull_s=pull_ms * S_PER_MS)


forward_prefix_ms = cost_model.forward_prefix_ms


def vw_task_times(gpus: Sequence, ranges: Sequence[Sequence[int]], costs: cost_model.StageCosts,
                  fwd_prefix: dict[str, np.ndarray], cluster: ClusterSpec, *, push_s: float = 0.0,
                  pull_s: float = 0.0, allreduce_s: float = 0.0, push_legs: Sequence[Leg] | None = None,
                  pull_legs: Sequence[Leg] | None = None, allreduce_shared_nic_s: float | None = None
                  ) -> VWTaskTimes:
  """One VW's task times from the cost model: ``gpus`` (:class:`~hetpipe_jax.costs.cluster.Gpu`) in stage order
  with their layer ranges; sends over the link between neighbouring stages' nodes (module docstring)."""
  fwd, bwd, send = [], [], []
  fb_ms = 0.0
  for s, (gpu, (i, j)) in enumerate(zip(gpus, ranges)):
    total_ms = costs.compute_ms(gpu.gpu_type, i, j)
    fwd_ms = min(float(fwd_prefix[gpu.gpu_type][j] - fwd_prefix[gpu.gpu_type][i]), total_ms)
    if s == len(gpus) - 1:
      fb_ms = total_ms
    else:
      fwd.append(fwd_ms * S_PER_MS)
      bwd.append((total_ms - fwd_ms) * S_PER_MS)
      link = cost_model.INTRA if gpu.node == gpus[s + 1].node else cost_model.INTER
      send.append(float(costs.recv_ms[link][j]) * S_PER_MS)
  del cluster
  return VWTaskTimes(forward_s=tuple(fwd), backward_s=tuple(bwd), forward_backward_s=fb_ms * S_PER_MS,
                     send_activation_s=tuple(send), send_gradient_s=tuple(send), push_s=push_s, pull_s=pull_s,
                     allreduce_s=allreduce_s, stage_nodes=tuple(g.node for g in gpus),
                     push_legs=None if push_legs is None else tuple(push_legs),
                     pull_legs=None if pull_legs is None else tuple(pull_legs),
                     allreduce_shared_nic_s=allreduce_shared_nic_s)


def fsdp_task_times(plan: "fsdp_cost.FsdpPlan") -> list[VWTaskTimes]:
  """The engine's task times of an fsdp configuration (:mod:`hetpipe_jax.costs.fsdp_cost`): one one-stage VW per
  GPU whose task is the GPU's forward+backward of its examples, and as the step's "all-reduce" the collectives'
  exposed time (the step beyond the slowest GPU's compute), with and without shared NICs. Run with method ``fsdp``
  and M = 1, the engine's step is the slowest GPU's compute plus that time: the closed form's step."""
  exposed, free = plan.exposed_comm_s(True), plan.exposed_comm_s(False)
  return [VWTaskTimes(forward_s=(), backward_s=(), forward_backward_s=c, send_activation_s=(), send_gradient_s=(),
                      push_s=0.0, pull_s=0.0, allreduce_s=free, stage_nodes=(g.node,),
                      allreduce_shared_nic_s=exposed) for g, c in zip(plan.gpus, plan.compute_s)]
