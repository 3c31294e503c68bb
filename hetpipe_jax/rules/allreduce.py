"""All-reduce BSP across virtual workers (GPipe, 1F1B-flush and Horovod across VWs; Megatron/DeepSpeed's PP x DP).

Planning layer: pure Python. Every step, each VW runs M micro-batches through its pipeline; when the step's last
micro-batch completes the VW's gradients (accumulated over the M micro-batches) are summed over all VWs by an
all-reduce, and every replica applies the same optimizer step with the mean gradient. There is no parameter server.

Reduction groups: the model's layers are cut into *segments* at every VW's stage boundaries
(:func:`reduce_segments`); a segment's gradients are reduced among the GPUs that hold it, one per VW (the stage
group of Megatron's PP x DP when every VW has the same partition, where segments are the stages). In the runtime a
segment is a contiguous slice of the flat, layer-ordered gradient vector, reduced with one ``MPI.Allreduce``.

Each rule lives here once: :class:`AllReduceSyncState` (one VW: steps, when the next step may be injected, which
step to reduce) is driven by ``VirtualWorker.run`` under MPI and by the engine in the engine and virtual time, as
:class:`hetpipe_jax.rules.wsp.VWSyncState` is for WSP; :class:`AllReduceState` is the collective's bookkeeping
(which VWs have reached a step's all-reduce) for the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass
class AllReduceSyncState:
  """One VW's side of all-reduce BSP, without tensors.

  Same interface as :class:`hetpipe_jax.rules.wsp.VWSyncState` where the drivers share code
  (``wsp.injection_step``, ``on_minibatch_complete``): the gate never waits for a PS, but ``max_injected`` caps the
  micro-batches injected so far at the end of the step whose update is applied next (a step's micro-batches start
  only on the weights of every earlier step: the flush).

  Args:
    num_microbatches: M >= 1 micro-batches per step (the rules' ``num_inflight``).

  Attributes:
    local_clock: steps whose micro-batches all completed (their all-reduce entered).
    applied_steps: steps whose reduced update is applied (the weights every new micro-batch uses).
    max_injected: micro-batches that may have been injected: ``(applied_steps + 1) * M``.
  """

  num_microbatches: int
  local_clock: int = 0
  applied_steps: int = 0
  max_injected: int = 0
  pull_every_wave = False  # the WSP fields the drivers read (no PS, no pulls)
  pull_required = None
  staleness_bound = 0

  def __post_init__(self):
    if self.num_microbatches < 1:
      raise ValueError(f"num_microbatches (M) must be >= 1, got {self.num_microbatches}")
    self.max_injected = (self.applied_steps + 1) * self.num_microbatches

  @property
  def num_inflight(self) -> int:
    return self.num_microbatches

  @property
  def weights_global_clock(self) -> int:
    """Steps in the VW's weights (every VW's, all-reduced)."""
    return self.applied_steps

  def injection_gate(self) -> tuple[bool, None]:
    """Never refuses (``max_injected`` is the flush); no pull to request."""
    return True, None

  def on_minibatch_complete(self, minibatch_id: int) -> tuple[int | None, None]:
    """Returns ``(step to all-reduce, None)`` when ``minibatch_id`` is its step's last micro-batch, else ``(None,
    None)``."""
    if (minibatch_id + 1) % self.num_microbatches:
      return None, None
    step = minibatch_id // self.num_microbatches
    if step != self.local_clock:
      raise AssertionError(f"step {step} ended, expected step {self.local_clock}")
    self.local_clock = step + 1
    return step, None

  def on_reduced(self, step: int) -> None:
    """The all-reduced update of ``step`` is applied: the next step's micro-batches may start.

    Raises:
      AssertionError: steps applied out of order, or before the step ended.
    """
    if step != self.applied_steps or step >= self.local_clock:
      raise AssertionError(f"step {step} reduced, expected step {self.applied_steps} (local clock "
                           f"{self.local_clock})")
    self.applied_steps += 1
    self.max_injected = (self.applied_steps + 1) * self.num_microbatches


@dataclasses.dataclass
class AllReduceState:
  """The collective's bookkeeping: which VWs have entered each step's all-reduce (it completes when all have).

  Args:
    num_virtual_workers: N >= 1.
  """

  num_virtual_workers: int
  entered: list[int] = dataclasses.field(default_factory=list)  # per VW: steps whose all-reduce it entered
  reduced_steps: int = 0  # steps whose all-reduce every VW entered

  def __post_init__(self):
    if self.num_virtual_workers < 1:
      raise ValueError(f"num_virtual_workers must be >= 1, got {self.num_virtual_workers}")
    if not self.entered:
      self.entered = [0] * self.num_virtual_workers

  def enter(self, vw_id: int, step: int) -> bool:
    """VW ``vw_id`` enters the all-reduce of ``step``; True when it is the last VW to do so (the step reduces).

    Raises:
      ValueError: unknown VW, or a step entered twice or out of order.
    """
    if not 0 <= vw_id < self.num_virtual_workers:
      raise ValueError(f"all-reduce entered by unknown VW {vw_id} (have {self.num_virtual_workers})")
    if step != self.entered[vw_id]:
      raise ValueError(f"VW {vw_id} entered the all-reduce of step {step}, expected step {self.entered[vw_id]}")
    self.entered[vw_id] += 1
    if min(self.entered) > self.reduced_steps:
      self.reduced_steps += 1
      return True
    return False


def reduce_segments(partitions: Sequence[Sequence[Sequence[int]]]) -> list[tuple[int, int]]:
  """The layer segments reduced as one buffer each: the model cut at every VW's stage boundaries.

  Args:
    partitions: per VW its half-open layer ranges (each covering the same layers ``0..L``).

  Returns:
    Contiguous half-open ranges covering ``0..L``, in layer order (the stages when every VW has the same
    partition).

  Raises:
    ValueError: no partitions, or VWs that cover different layers.
  """
  if not partitions:
    raise ValueError("no partitions")
  ends = {p[-1][1] for p in partitions}
  if len(ends) != 1 or any(p[0][0] != 0 for p in partitions):
    raise ValueError(f"partitions cover different layers: {[list(map(list, p)) for p in partitions]}")
  cuts = sorted({int(r[0]) for p in partitions for r in p} | ends)
  return list(zip(cuts[:-1], cuts[1:]))


def segment_stages(partition: Sequence[Sequence[int]], segments: Sequence[Sequence[int]]) -> list[int]:
  """For each segment, the stage of ``partition`` that holds it."""
  out = []
  for start, end in segments:
    for s, (i, j) in enumerate(partition):
      if i <= start and end <= j:
        out.append(s)
        break
    else:
      raise ValueError(f"segment [{start}, {end}) is not inside one stage of {list(map(list, partition))}")
  return out
