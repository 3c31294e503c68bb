"""The pure pipeline rules (HetPipe §4) checked by an exhaustive small event simulation."""

import heapq
import random

import pytest

from hetpipe_jax.rules.schedule import PipelineRules, Task, TaskKind


def test_task_text_round_trips():
  for text in ["0F0", "2B17", "3FB5"]:
    assert str(Task.parse(text)) == text
  assert Task.parse("3FB5") == Task(3, TaskKind.FORWARD_BACKWARD, 5)
  with pytest.raises(ValueError, match="cannot parse task"):
    Task.parse("F3")


def simulate(num_stages, num_inflight, durations, num_minibatches):
  """One in-order device per stage; returns [(start, end, task)] and the rules object."""
  rules = PipelineRules(num_stages, num_inflight)
  busy_until = [0.0] * num_stages
  events, trace, now = [], [], 0.0
  while rules.num_completed < num_minibatches:
    while rules.can_inject() and rules.num_injected < num_minibatches:
      rules.inject()
    for s in range(num_stages):
      if busy_until[s] <= now and rules.has_ready(s):
        task = rules.pop_ready(s)
        end = now + durations(task)
        busy_until[s] = end
        trace.append((now, end, task))
        heapq.heappush(events, (end, len(trace), task))
    now, _, task = heapq.heappop(events)
    assert rules.num_in_flight <= num_inflight
    rules.complete(task)
  return trace, rules


@pytest.mark.parametrize("num_stages,num_inflight", [(1, 1), (2, 1), (2, 3), (3, 2), (4, 4), (4, 6)])
def test_rules_hold_under_random_durations(num_stages, num_inflight):
  rng = random.Random(num_stages * 10 + num_inflight)
  for _ in range(5):
    speed = [rng.uniform(0.5, 3.0) for _ in range(num_stages)]
    trace, rules = simulate(num_stages, num_inflight, lambda t: speed[t.stage_id] * rng.uniform(0.8, 1.2), 20)
    for s in range(num_stages):
      mine = [t for _, _, t in trace if t.stage_id == s]
      fwd = [t.minibatch_id for t in mine if t.kind is not TaskKind.BACKWARD]
      bwd = [t.minibatch_id for t in mine if t.kind is TaskKind.BACKWARD]
      assert fwd == sorted(fwd) == list(range(20))  # rule 1
      if s < num_stages - 1:
        assert bwd == sorted(bwd) == list(range(20))  # rule 2
      kinds = {t.kind for t in mine}
      assert kinds == ({TaskKind.FORWARD_BACKWARD} if s == num_stages - 1 else {TaskKind.FORWARD, TaskKind.BACKWARD})
    # Injection: minibatch p starts on stage 0 only after minibatch p - Nm completed (its backward on stage 0).
    done0 = {t.minibatch_id: end for _, end, t in trace if t.stage_id == 0 and t.kind is not TaskKind.FORWARD}
    start0 = {t.minibatch_id: st for st, _, t in trace if t.stage_id == 0 and t.kind is not TaskKind.BACKWARD}
    for p in range(num_inflight, 20):
      assert start0[p] >= done0[p - num_inflight]
    assert rules.peak_held[0] == min(num_inflight, 20)
    assert rules.peak_held[-1] == 1


def test_fifo_among_ready_tasks():
  rules = PipelineRules(3, 3)
  for _ in range(3):
    rules.inject()
  t0 = rules.pop_ready(0)
  rules.complete(t0)  # 1F0 ready
  t1 = rules.pop_ready(0)
  rules.complete(t1)  # 0F2 is already queued before 1F1 became ready
  assert [str(rules.pop_ready(1))] == ["1F0"]
  assert str(rules.pop_ready(0)) == "0F2"
  assert str(rules.pop_ready(1)) == "1F1"


def test_injection_limit_and_errors():
  rules = PipelineRules(2, 2)
  rules.inject()
  rules.inject()
  assert not rules.can_inject()
  with pytest.raises(RuntimeError, match="in flight"):
    rules.inject()
  with pytest.raises(ValueError, match="num_inflight"):
    PipelineRules(2, 0)
  with pytest.raises(ValueError, match="num_stages"):
    PipelineRules(0, 1)
