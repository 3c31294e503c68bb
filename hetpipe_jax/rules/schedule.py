"""The per-GPU scheduling rules of a virtual worker's pipeline (HetPipe §4, "Partition Scheduling").

Planning layer: pure Python, shared by the real runtime (``hetpipe_jax.runtime.virtual_worker``) and the event
engine, so the rules exist once. The rules, per stage (= one GPU):

1. a forward task of minibatch p runs only after the forwards of every p' < p on that stage;
2. a backward task of minibatch p runs only after the backwards of every p' < p on that stage;
3. among ready tasks, first in, first out (FIFO by the moment the task became ready);
4. the last stage runs forward + backward of a minibatch as one task (``FB``);
5. at most Nm (``num_inflight``) minibatches are in flight in the VW: minibatch p may be injected into stage 0 only
   when minibatches 0..p-Nm have completed (local staleness ``s_local = Nm - 1``). A minibatch completes when its
   backward on stage 0 is done.

Other methods (``hetpipe_jax.rules.methods``: PipeDream's 1F1B, GPipe, 1F1B-flush, Horovod) replace rule 3 by a
static per-stage order (``order``, a :class:`hetpipe_jax.rules.methods.StageOrder`): a stage starts exactly the next
task of its order once that task is ready (its input arrived). Rules 1, 2, 4 and 5 hold for every method.

Tasks print as ``<stage><kind><minibatch>`` (``2F0`` = stage 2, forward, minibatch 0; ``3FB5``; ``0B1``) and parse
back, in the style of ``torch.distributed.pipelining`` actions.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import re


class TaskKind(enum.Enum):
  FORWARD = "F"
  BACKWARD = "B"
  FORWARD_BACKWARD = "FB"


@dataclasses.dataclass(frozen=True, init=False, slots=True)
class Task:
  """One unit of work on one stage: a forward, a backward, or (last stage) forward+backward of one minibatch."""

  stage_id: int
  kind: TaskKind
  minibatch_id: int

  def __init__(self, stage_id: int, kind: TaskKind, minibatch_id: int):
    # The generated frozen __init__ sets each field through object.__setattr__; the slots' own setters are the same
    # result at a fraction of the cost (the engine creates one Task per task it simulates), and slots make reading
    # a field cheap.
    _set_stage_id(self, stage_id)
    _set_kind(self, kind)
    _set_minibatch_id(self, minibatch_id)

  def __str__(self) -> str:
    return f"{self.stage_id}{self.kind.value}{self.minibatch_id}"

  @staticmethod
  def parse(text: str) -> "Task":
    """Parses ``"2F0"``-style text back into a :class:`Task`.

    Raises:
      ValueError: the text is not ``<int>(F|B|FB)<int>``.
    """
    m = re.fullmatch(r"(\d+)(FB|F|B)(\d+)", text.strip())
    if m is None:
      raise ValueError(f"cannot parse task {text!r}: expected <stage>(F|B|FB)<minibatch>, e.g. '2F0'")
    return Task(int(m.group(1)), TaskKind(m.group(2)), int(m.group(3)))


_set_stage_id, _set_kind, _set_minibatch_id = Task.stage_id.__set__, Task.kind.__set__, Task.minibatch_id.__set__
_FORWARD = TaskKind.FORWARD
_BACKWARD = TaskKind.BACKWARD
_FORWARD_BACKWARD = TaskKind.FORWARD_BACKWARD


def first_task(num_stages: int, minibatch_id: int) -> Task:
  """The task that injects ``minibatch_id`` into stage 0 (``FB`` when the pipeline has one stage)."""
  return Task(0, _FORWARD_BACKWARD if num_stages == 1 else _FORWARD, minibatch_id)


def successors(task: Task, num_stages: int) -> list[Task]:
  """Tasks whose data dependency is satisfied by ``task`` completing (its output arriving at the neighbour)."""
  s = task.stage_id
  if task.kind is _FORWARD:
    return [Task(s + 1, _FORWARD_BACKWARD if s + 2 == num_stages else _FORWARD, task.minibatch_id)]
  if s == 0:  # backward (or single-stage FB) on stage 0 completes the minibatch
    return []
  return [Task(s - 1, _BACKWARD, task.minibatch_id)]


def completes_minibatch(task: Task) -> bool:
  """True for the task whose completion completes its minibatch (backward on stage 0)."""
  return task.stage_id == 0 and task.kind is not _FORWARD


def _transition(stage_id: int, kind: TaskKind, num_stages: int) -> tuple[bool, int | None, TaskKind | None]:
  """What completing a ``kind`` task on ``stage_id`` does, from :func:`completes_minibatch` and :func:`successors`
  (neither depends on the minibatch): ``(completes its minibatch, successor's stage, successor's kind)``, the
  successor's fields None when it has none. :class:`PipelineRules` keeps one per stage and kind, so that
  ``complete`` asks these rules once per run, not once per task.

  Raises:
    ValueError: the task has more than one successor (a pipeline's tasks form a chain).
  """
  task = Task(stage_id, kind, 0)
  new = successors(task, num_stages)
  if len(new) > 1:
    raise ValueError(f"{task} has {len(new)} successors; a pipeline task has at most one")
  if not new:
    return completes_minibatch(task), None, None
  return completes_minibatch(task), new[0].stage_id, new[0].kind


def _key(task: Task | None):
  """A task's key among one stage's ready tasks (static orders): ``(minibatch, is a backward)``; None past the end."""
  return None if task is None else (task.minibatch_id, task.kind is _BACKWARD)


def check_max_held(max_held, num_stages: int, order=None) -> tuple[int, ...] | None:
  """``max_held`` (see :class:`PipelineRules`) as a tuple of ints, or None.

  Raises:
    ValueError: the wrong length, a cap < 1, or caps with a static stage order (the other methods' held counts
      are closed forms of their orders, :func:`hetpipe_jax.rules.methods.max_held_per_stage`).
  """
  if max_held is None:
    return None
  caps = tuple(int(h) for h in max_held)
  if len(caps) != num_stages:
    raise ValueError(f"max_held has {len(caps)} entries for {num_stages} stages")
  if any(h < 1 for h in caps):
    raise ValueError(f"max_held must be >= 1 on every stage (a stage must hold a minibatch to run it), got {caps}")
  if order is not None:
    raise ValueError("max_held (memory caps) applies to HetPipe's FIFO rule, not to a static stage order")
  return caps


class PipelineRules:
  """Pure state of one VW's pipeline under the HetPipe rules; the runtime and the engine both drive it.

  Usage: while ``can_inject()``: ``inject()``; for each stage ``pop_ready(stage)`` gives the next task to start
  (FIFO); when a task finishes call ``complete(task)``, which enqueues the tasks it made ready.

  Args:
    num_stages: number of pipeline stages S >= 1.
    num_inflight: Nm >= 1, the most minibatches in flight (HetPipe §4).
    order: None: HetPipe's FIFO rule 3; else the static per-stage order of another method
      (:class:`hetpipe_jax.rules.methods.StageOrder`): ``pop_ready(s)`` starts only the next task of stage s's order.
    max_held: FIFO only: per stage, the most minibatches it may hold (the memory rule: a stage holds minibatch p
      from the dispatch of its forward of p until its backward of p completes, what ``peak_held`` counts). A
      forward that would exceed its stage's cap waits, and a ready backward behind it starts first (it frees
      memory; forwards stay in order, backwards stay in order). The last stage's forward+backward holds its
      minibatch only while it runs and is never held back. With every cap >= 1 the pipeline cannot deadlock: the
      oldest minibatch a stage holds always moves on (the last stage never waits), so a backward completes and
      frees a slot. A plan made with ``inflight_memory="schedule"`` records the caps it counted memory for
      (``held_per_stage``), and enforcing them makes that count safe whatever the task times. None: no cap
      (at most Nm, rule 2).

  Raises:
    ValueError: on S < 1, Nm < 1, or ``max_held`` of the wrong length, with a cap < 1, or with a static order.
  """

  def __init__(self, num_stages: int, num_inflight: int, order=None, max_held=None):
    if num_stages < 1:
      raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_inflight < 1:
      raise ValueError(f"num_inflight (Nm) must be >= 1, got {num_inflight}")
    self.num_stages = num_stages
    self.num_inflight = num_inflight
    self.num_injected = 0
    self.num_completed = 0
    self._ready = [collections.deque() for _ in range(num_stages)]
    self._next_forward = [0] * num_stages  # next forward (or FB) minibatch each stage may start
    self._next_backward = [0] * num_stages
    self._running = [collections.deque() for _ in range(num_stages)]  # started, not completed (in order)
    # Minibatches whose forward is done on a stage and whose backward there is not (what the stage holds).
    self._held = [0] * num_stages
    self.peak_held = [0] * num_stages
    self.max_held = check_max_held(max_held, num_stages, order)
    self.order = order
    self._fifo = order is None and self.max_held is None  # HetPipe's rule 3 without memory caps
    # Per stage, per kind: what completing such a task does (_transition).
    self._after_forward = [_transition(s, _FORWARD, num_stages) for s in range(num_stages)]
    self._after_backward = [_transition(s, _BACKWARD, num_stages) for s in range(num_stages)]
    self._after_forward_backward = [_transition(s, _FORWARD_BACKWARD, num_stages) for s in range(num_stages)]
    if order is not None:
      if order.num_stages != num_stages:
        raise ValueError(f"the stage order has {order.num_stages} stages, the pipeline {num_stages}")
      # Ready tasks not yet started, any order, by key (minibatch, is a backward): unique on a stage, cheap to hash.
      self._ready_set = [{} for _ in range(num_stages)]
      self._position = [0] * num_stages  # index of the next task of each stage's order
      self._expected = [order.task(s, 0) for s in range(num_stages)]
      self._expected_key = [_key(t) for t in self._expected]

  @property
  def num_in_flight(self) -> int:
    return self.num_injected - self.num_completed

  def can_inject(self) -> bool:
    """Local-staleness rule: fewer than Nm minibatches in flight."""
    return self.num_in_flight < self.num_inflight

  def inject(self) -> Task:
    """Injects the next minibatch; returns its first task (now ready on stage 0).

    Raises:
      RuntimeError: Nm minibatches are already in flight.
    """
    if not self.can_inject():
      raise RuntimeError(f"cannot inject: {self.num_in_flight} minibatches in flight, Nm = {self.num_inflight}")
    task = first_task(self.num_stages, self.num_injected)
    self.num_injected += 1
    if self.order is not None:
      self._ready_set[0][_key(task)] = task
    else:
      self._ready[0].append(task)
    return task

  def has_ready(self, stage_id: int) -> bool:
    """True when ``pop_ready(stage_id)`` would start a task (FIFO: any ready one the memory cap allows; static
    order: its next one)."""
    if self.order is not None:
      return self._expected_key[stage_id] in self._ready_set[stage_id]
    if self.max_held is None:
      return bool(self._ready[stage_id])
    return self._startable(stage_id) is not None

  def _startable(self, stage_id: int) -> int | None:
    """FIFO with memory caps: the index in the stage's ready queue of the task to start next, or None. The head,
    unless it is a forward the cap holds back; then the first ready backward."""
    queue = self._ready[stage_id]
    if not queue:
      return None
    if queue[0].kind is not _FORWARD or self._held[stage_id] < self.max_held[stage_id]:
      return 0
    for i, task in enumerate(queue):
      if task.kind is _BACKWARD:
        return i
    return None

  def peek_ready(self, stage_id: int) -> Task | None:
    """The task :meth:`pop_ready` would start now on ``stage_id``, without starting it; None when nothing may
    start. (The runtime looks before it starts: a minibatch's first task is ready once it is injected, but its data
    may still be on its way to the stage.)"""
    if self.order is not None:
      return self._ready_set[stage_id].get(self._expected_key[stage_id])
    if self.max_held is None:
      queue = self._ready[stage_id]
      return queue[0] if queue else None
    i = self._startable(stage_id)
    return None if i is None else self._ready[stage_id][i]

  def pop_ready(self, stage_id: int) -> Task | None:
    """Starts the next task of ``stage_id`` (FIFO head, or the next of its static order if it is ready), checking
    rules 1–2; None when nothing may start."""
    if self._fifo:
      queue = self._ready[stage_id]
      if not queue:
        return None
      task = queue.popleft()
    elif self.order is not None:
      task = self._ready_set[stage_id].pop(self._expected_key[stage_id], None)
      if task is None:
        return None
      self._position[stage_id] += 1
      nxt = self._expected[stage_id] = self.order.task(stage_id, self._position[stage_id])
      self._expected_key[stage_id] = _key(nxt)
    else:
      i = self._startable(stage_id)
      if i is None:
        return None
      queue = self._ready[stage_id]
      task = queue[i]
      del queue[i]
    p = task.minibatch_id
    kind = task.kind
    if kind is _BACKWARD:
      expected = self._next_backward[stage_id]
      self._next_backward[stage_id] = p + 1
    else:
      expected = self._next_forward[stage_id]
      self._next_forward[stage_id] = p + 1
      held = self._held[stage_id] + 1  # the minibatches the stage holds once this task starts
      if kind is _FORWARD:
        self._held[stage_id] = held
      # else FB: it holds its minibatch only while it runs
      if held > self.peak_held[stage_id]:
        self.peak_held[stage_id] = held
    if p != expected:
      raise AssertionError(f"schedule rule violated on stage {stage_id}: {task} started, expected minibatch {expected}")
    self._running[stage_id].append(task)
    return task

  def complete(self, task: Task) -> list[Task]:
    """Marks a started task done; returns the tasks it made ready (already enqueued, FIFO)."""
    stage_id = task.stage_id
    running = self._running[stage_id]
    if not running or (running[0] is not task and running[0] != task):
      head = running[0] if running else None
      raise AssertionError(f"task {task} completed but the oldest running task on its stage is {head} (a stage "
                           "completes its tasks in the order they started)")
    running.popleft()
    kind = task.kind
    if kind is _BACKWARD:
      self._held[stage_id] -= 1
      completes, next_stage, next_kind = self._after_backward[stage_id]
    elif kind is _FORWARD:
      completes, next_stage, next_kind = self._after_forward[stage_id]
    else:
      completes, next_stage, next_kind = self._after_forward_backward[stage_id]
    if completes:  # completes_minibatch(task)
      if task.minibatch_id != self.num_completed:
        raise AssertionError(f"minibatch {task.minibatch_id} completed out of order (expected {self.num_completed})")
      self.num_completed += 1
    if next_stage is None:  # successors(task) is empty
      return []
    t = Task(next_stage, next_kind, task.minibatch_id)  # successors(task)
    if self.order is not None:
      self._ready_set[next_stage][_key(t)] = t
    else:
      self._ready[next_stage].append(t)
    return [t]

  def idle(self) -> bool:
    """True when no task is running or ready."""
    if self.order is not None:
      return not any(self._running) and not any(self._ready_set)
    return not any(self._running) and not any(self._ready)
