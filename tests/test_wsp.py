"""WSP rules (HetPipe §5) and the PS bookkeeping against brute-force definitions."""

import itertools
import random

import numpy as np
import pytest

from hetpipe_jax.ps.param_server import LocalPSClient, ParameterServer
from hetpipe_jax.rules import schedule
from hetpipe_jax.rules import wsp


def test_waves_and_bound():
  assert [wsp.wave_of(p, 4) for p in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
  assert [p for p in range(12) if wsp.is_wave_end(p, 4)] == [3, 7, 11]
  # Paper example (Nm = 4, D = 0): after wave 0 completes (local clock 1) the VW needs every VW's wave 0.
  assert wsp.required_global_clock(1, 0) == 1
  assert wsp.may_inject(local_clock=1, weights_global_clock=0, staleness_bound=0) is False
  assert wsp.may_inject(local_clock=1, weights_global_clock=0, staleness_bound=1) is True
  for c, d, g in itertools.product(range(6), range(4), range(6)):
    # Brute force of the definition: the weights must include every wave 0..c-D-1.
    assert wsp.may_inject(c, g, d) == all(w < g for w in range(0, c - d))


def _random_pushes(rng, n, num_waves):
  """A random interleaving of n VWs' pushes of waves 0..num_waves-1 (each VW in wave order)."""
  pending = [0] * n
  while any(p < num_waves for p in pending):
    v = rng.choice([v for v in range(n) if pending[v] < num_waves])
    yield v, pending[v]
    pending[v] += 1


def test_ps_state_clock_aligned_applies_each_wave_once_every_vw_pushed_it():
  rng = random.Random(0)
  for n in (1, 2, 3):
    state = wsp.ParameterServerState(n, "clock_aligned")
    pushed = [0] * n
    applied = []
    for v, w in _random_pushes(rng, n, 5):
      applied += state.push(v, w)
      pushed[v] += 1
      assert state.global_clock == min(pushed)
      # Definition: the global weights hold exactly every VW's waves below the global clock.
      assert state.vector_clock() == (min(pushed),) * n
    assert applied == [(w, v) for w in range(5) for v in range(n)] == state.applied


def test_ps_state_on_receipt_applies_each_push_when_it_arrives():
  """HetPipe §5: w_global += ũ on receipt; c_global = c + 1 only once every VW pushed wave c."""
  rng = random.Random(1)
  for n in (1, 2, 3, 4):
    state = wsp.ParameterServerState(n)  # on_receipt is the default
    assert state.ps_apply == "on_receipt"
    pushed = [0] * n
    arrivals = []
    for v, w in _random_pushes(rng, n, 6):
      assert state.push(v, w) == [(w, v)]  # applied at once
      arrivals.append((w, v))
      pushed[v] += 1
      assert state.vector_clock() == tuple(pushed)  # the global weights hold every wave pushed so far
      assert state.global_clock == min(pushed)
    assert state.applied == arrivals  # the log is the arrival order


def test_ps_modes_hold_the_same_waves_at_every_global_clock_and_on_receipt_more_in_between():
  """Both modes agree on the global clock after every push; on_receipt's weights hold a superset of
  clock_aligned's, strictly larger whenever some VW is ahead of the slowest (lower bound, not only upper)."""
  rng = random.Random(2)
  n = 3
  on_receipt, aligned = wsp.ParameterServerState(n, "on_receipt"), wsp.ParameterServerState(n, "clock_aligned")
  strictly_more = 0
  for v, w in _random_pushes(rng, n, 8):
    on_receipt.push(v, w)
    aligned.push(v, w)
    assert on_receipt.global_clock == aligned.global_clock
    a, b = on_receipt.vector_clock(), aligned.vector_clock()
    assert all(x >= y for x, y in zip(a, b))
    ahead = max(a) > min(a)
    assert (sum(a) > sum(b)) == ahead
    strictly_more += ahead
  assert strictly_more > 0


def test_ps_apply_is_checked():
  with pytest.raises(ValueError, match="ps_apply='sometimes' is not a PS application mode"):
    wsp.ParameterServerState(2, "sometimes")
  assert wsp.check_ps_apply("clock_aligned") == "clock_aligned"


def test_extra_updates_counts_other_vws_waves_beyond_the_global_clock():
  assert wsp.extra_updates((3, 5, 4), 0) == 2 + 1
  assert wsp.extra_updates((3, 5, 4), 1) == 0 + 1  # its own waves are not extra updates of other workers
  assert wsp.extra_updates((2, 2), 0) == 0
  assert wsp.global_clock_of((3, 5, 4)) == 3


def test_ps_state_rejects_duplicates_and_gaps():
  state = wsp.ParameterServerState(2)
  state.push(0, 0)
  with pytest.raises(ValueError, match="expected wave 1"):
    state.push(0, 0)
  with pytest.raises(ValueError, match="expected wave 0"):
    state.push(1, 1)
  with pytest.raises(ValueError, match="unknown VW"):
    state.push(2, 0)


def test_parameter_server_clock_aligned_sums_waves_in_fixed_order():
  ps = ParameterServer(np.zeros(3, np.float32), 2, "clock_aligned")
  assert ps.push(1, 0, np.array([1, 2, 3], np.float32)) == 0  # held until VW 0 pushes wave 0
  assert ps.snapshot()[0] == (0, 0) and not ps.snapshot()[1].any()
  assert ps.push(0, 0, np.array([10, 20, 30], np.float32)) == 2
  clock, w = ps.snapshot()
  assert clock == (1, 1) and w.tolist() == [11, 22, 33]
  with pytest.raises(ValueError, match="floats"):
    ps.push(0, 1, np.zeros(2, np.float32))


def test_parameter_server_on_receipt_adds_each_update_when_it_arrives():
  ps = ParameterServer(np.zeros(3, np.float32), 2)
  assert ps.push(1, 0, np.array([1, 2, 3], np.float32)) == 1
  vc, w = ps.snapshot()
  assert vc == (0, 1) and ps.global_clock == 0 and w.tolist() == [1, 2, 3]
  assert ps.push(1, 1, np.array([100, 0, 0], np.float32)) == 1  # VW 1 runs ahead: its wave 1 is applied too
  assert ps.push(0, 0, np.array([10, 20, 30], np.float32)) == 1
  vc, w = ps.snapshot()
  assert vc == (1, 2) and ps.global_clock == 1 and w.tolist() == [111, 22, 33]
  assert ps.state.applied == [(0, 1), (1, 1), (0, 0)]


@pytest.mark.parametrize("ps_apply", ["on_receipt", "clock_aligned"])
def test_a_snapshot_is_a_copy_that_later_pushes_leave_unchanged(ps_apply):
  """A pull is answered with a copy of the global weights: pushes applied after the answer (while the reply is on
  its way, or before the VW installs it) change neither the answered weights nor their vector clock."""
  ps = ParameterServer(np.zeros(3, np.float32), 2, ps_apply)
  ps.push(0, 0, np.array([1, 2, 3], np.float32))
  ps.push(1, 0, np.array([10, 20, 30], np.float32))
  vc, w = ps.snapshot()
  assert vc == (1, 1) and w.tolist() == [11, 22, 33]
  ps.push(0, 1, np.array([100, 200, 300], np.float32))
  ps.push(1, 1, np.array([1000, 0, 0], np.float32))
  assert ps.snapshot()[0] == (2, 2) and ps.weights.tolist() == [1111, 222, 333]
  assert vc == (1, 1) and w.tolist() == [11, 22, 33]  # the earlier answer as it was
  w2 = ps.snapshot()[1]
  w2 += 1  # a VW's rebase of its copy does not reach the global weights
  assert ps.weights.tolist() == [1111, 222, 333]


def test_vw_sync_state_paper_example():
  # Nm = 4, D = 0 (HetPipe §5, Figure 1): minibatches 4..6 of wave 1 start without global weights; minibatch 7 needs
  # every VW's wave 0, so after wave 0 completes the VW requests a pull that must reach global clock 1.
  s = wsp.VWSyncState(num_inflight=4, staleness_bound=0, pull_every_wave=False)
  for p in range(4):
    assert s.injection_gate() == (True, None)
  assert s.on_minibatch_complete(0) == (None, None)
  assert s.injection_gate() == (True, None)  # minibatch 4 (local clock still 0)
  for p in (1, 2):
    s.on_minibatch_complete(p)
  assert s.on_minibatch_complete(3) == (0, None)  # wave 0 ends: push it
  assert s.local_clock == 1
  assert s.injection_gate() == (False, 1)  # blocked: pull at global clock >= 1
  assert s.injection_gate() == (False, None)  # already requested
  s.on_pull_reply(1)
  assert s.injection_gate() == (True, None)
  with pytest.raises(AssertionError, match="back in time"):
    s.on_pull_reply(0)


def test_vw_sync_state_pulls_every_wave_without_waiting():
  s = wsp.VWSyncState(num_inflight=2, staleness_bound=1, pull_every_wave=True)
  # Local clock 1: the next wave needs global clock >= 0, which the weights have, so it asks one wave ahead (1).
  assert s.on_minibatch_complete(1) == (0, 1)
  assert s.on_minibatch_complete(3) == (1, None)  # one pull outstanding at a time
  s.on_pull_reply(1)
  # Local clock 3: the next wave needs 2 and the weights hold 1: ask exactly for 2, not more.
  assert s.on_minibatch_complete(5) == (2, 2)
  assert s.injection_gate() == (False, None)  # blocked until that pull arrives; nothing new to request
  s.on_pull_reply(2)
  assert s.injection_gate() == (True, None)
  # D = 0 never looks ahead (it would wait for its own unfinished wave).
  s0 = wsp.VWSyncState(num_inflight=1, staleness_bound=0, pull_every_wave=True)
  assert s0.on_minibatch_complete(0) == (0, 1)
  s0.on_pull_reply(1)
  assert s0.on_minibatch_complete(1) == (1, 2)
  with pytest.raises(ValueError, match="staleness_bound"):
    wsp.VWSyncState(1, -1)


def test_pending_pulls_are_served_in_arrival_order_once_the_clock_allows():
  state = wsp.ParameterServerState(3)
  assert state.request_pull(1, 0) is True  # answerable now: nothing kept
  assert state.pending_pulls == {}
  assert state.request_pull(2, 1) is False  # arrives first
  assert state.request_pull(0, 1) is False
  assert state.request_pull(1, 2) is False
  with pytest.raises(ValueError, match="one pull outstanding"):
    state.request_pull(0, 1)
  with pytest.raises(ValueError, match="unknown VW"):
    state.request_pull(3, 0)
  state.push(0, 0)
  state.push(1, 0)
  assert state.serve_pending_pulls() == []  # global clock still 0
  state.push(2, 0)  # global clock 1: the two clock-1 requests, in the order they arrived (VW 2 before VW 0)
  assert state.serve_pending_pulls() == [2, 0]
  assert state.pending_pulls == {1: 2}
  assert state.serve_pending_pulls() == []
  for v in range(3):
    state.push(v, 1)
  assert state.serve_pending_pulls() == [1]
  assert state.pending_pulls == {}
  assert state.request_pull(0, 2) is True


def test_own_waves_after_pull_keeps_the_waves_the_ps_does_not_hold():
  # Pulled weights holding the VW's own waves 0..k-1 (its vector-clock entry; g under clock_aligned): re-add its
  # own waves >= k, in wave order.
  assert wsp.own_waves_after_pull({3: "a", 1: "b", 2: "c"}, 2) == [2, 3]
  assert wsp.own_waves_after_pull([0, 1], 2) == []
  assert wsp.own_waves_after_pull([4, 2, 3], 0) == [2, 3, 4]
  assert wsp.own_waves_after_pull([], 5) == []


def _complete(rules, count):
  """Completes the ``count`` oldest in-flight minibatches of a one-stage pipeline (its tasks are FB on stage 0)."""
  for _ in range(count):
    rules.complete(rules.pop_ready(0))


def test_injection_step_fills_up_to_nm_and_the_runs_length():
  sync = wsp.VWSyncState(num_inflight=3, staleness_bound=0, pull_every_wave=False)
  rules = schedule.PipelineRules(num_stages=1, num_inflight=3)
  assert wsp.injection_step(rules, sync, 12) == (range(0, 3), None, False)  # Nm = 3 at once
  assert rules.num_injected == 3
  assert wsp.injection_step(rules, sync, 12) == (range(0), None, False)  # Nm in flight: the gate is not asked
  _complete(rules, 2)  # two completed (same wave: local clock still 0)
  assert wsp.injection_step(rules, sync, 12) == (range(3, 5), None, False)
  sync = wsp.VWSyncState(num_inflight=3, staleness_bound=100, pull_every_wave=False)  # no WSP limit below
  rules = schedule.PipelineRules(num_stages=1, num_inflight=3)
  for _ in range(10):
    rules.inject()
    _complete(rules, 1)
  assert wsp.injection_step(rules, sync, 12) == (range(10, 12), None, False)  # Nm leaves 3, the run's length 2
  _complete(rules, 2)
  assert wsp.injection_step(rules, sync, 12) == (range(0), None, False)  # the run's length is reached
  assert rules.num_injected == rules.num_completed == 12


def test_injection_step_at_the_staleness_bound_waits_and_requests_one_pull():
  # Nm = 2, D = 1: at local clock 2 the VW needs weights of global clock >= 1.
  sync = wsp.VWSyncState(num_inflight=2, staleness_bound=1, pull_every_wave=False)
  rules = schedule.PipelineRules(num_stages=1, num_inflight=2)
  assert wsp.injection_step(rules, sync, 8) == (range(0, 2), None, False)
  _complete(rules, 2)
  sync.on_minibatch_complete(1)  # wave 0 done: local clock 1 on weights of clock 0 is exactly at the bound
  assert wsp.injection_step(rules, sync, 8) == (range(2, 4), None, False)
  _complete(rules, 2)
  sync.on_minibatch_complete(3)  # wave 1 done: local clock 2 needs global clock 2 - D = 1 > 0, past the bound
  assert wsp.injection_step(rules, sync, 8) == (range(0), 1, True)  # wait; request a pull at clock >= 1
  assert sync.pull_required == 1 and rules.num_injected == 4
  assert wsp.injection_step(rules, sync, 8) == (range(0), None, True)  # still waiting, the pull already requested
  sync.on_pull_reply(1)
  assert wsp.injection_step(rules, sync, 8) == (range(4, 6), None, False)
  # With no room in the pipeline the gate is not consulted: no wait and no pull, even past the bound.
  sync.local_clock = 3
  assert wsp.injection_step(rules, sync, 8) == (range(0), None, False) and sync.pull_required is None


@pytest.mark.parametrize("ps_apply", ["on_receipt", "clock_aligned"])
def test_local_ps_client_answers_a_pending_pull_after_the_push_that_allows_it(ps_apply):
  server = ParameterServer(np.zeros(2, np.float32), 2, ps_apply)
  clients = [LocalPSClient(server, v) for v in range(2)]
  assert clients[0].poll_pull() is None  # nothing requested
  clients[0].request_pull(1)
  assert clients[0].poll_pull() is None and server.state.pending_pulls == {0: 1}
  clients[0].push(0, np.ones(2, np.float32), 1.0, 1)
  assert clients[0].poll_pull() is None  # global clock still 0
  clients[1].push(0, np.full(2, 2.0, np.float32), 1.0, 1)  # another VW's push serves VW 0's pull
  clock, weights = clients[0].poll_pull()
  assert clock == (1, 1) and weights.tolist() == [3.0, 3.0]
  assert clients[0].poll_pull() is None  # answered once
  clients[0].push(1, np.full(2, 10.0, np.float32), 1.0, 1)  # VW 0 runs a wave ahead
  clients[1].request_pull(1)  # answerable at once; on receipt it also carries VW 0's wave 1
  extra = ps_apply == "on_receipt"
  assert clients[1].poll_pull()[0] == ((2, 1) if extra else (1, 1))
  assert server.weights.tolist() == ([13.0, 13.0] if extra else [3.0, 3.0])
