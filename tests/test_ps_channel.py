"""A VW's PS channel thread (hetpipe_jax.runtime.ps_channel): overlap against a closed form, numerics against the
sequential replay, a pull never ahead of the VW's own push, errors on the channel thread raised by the run."""

import functools
import threading
import time

import numpy as np
import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.costs import task_times
from hetpipe_jax.ps import param_server
from tests import test_pipeline as pipeline_tests
from tests.pipeline_util import assert_params_close, build_vw, sequential_replay

TWO_STAGES = [(0, 2), (2, 4)]


class SlowClient(param_server.LocalPSClient):
  """An in-process client whose push takes ``push_s`` and whose pull reply takes ``pull_s`` (a transfer's time) on
  the calling thread. ``log``: ``("push", wave, thread)`` / ``("pull", clock, pushes arrived so far, thread)``;
  ``push_spans``: ``(wave, start, end)`` of each push on the machine clock."""

  push_s = 0.0
  pull_s = 0.0

  def __init__(self, server, vw_id):
    super().__init__(server, vw_id)
    self.log = []
    self.push_spans = []  # (wave, start, end) of each push, machine clock (time.time())

  def push(self, wave_id, flat_delta, loss_sum, num_minibatches):
    start = time.time()
    time.sleep(self.push_s)
    super().push(wave_id, flat_delta, loss_sum, num_minibatches)
    self.log.append(("push", wave_id, threading.current_thread().name))
    self.push_spans.append((wave_id, start, time.time()))

  def request_pull(self, required_clock):
    pushed = sum(1 for e in self.log if e[0] == "push")
    self.log.append(("pull", required_clock, pushed, threading.current_thread().name))
    super().request_pull(required_clock)

  def poll_pull(self):
    reply = super().poll_pull()
    if reply is not None:
      time.sleep(self.pull_s)
    return reply


def _slow_factory(push_s, pull_s):
  def factory(server, vw_id):
    c = SlowClient(server, vw_id)
    c.push_s, c.pull_s = push_s, pull_s
    return c
  return factory


def _vw(data_dir, mode, *, push_s, pull_s, num_inflight=1, staleness_bound=1, stages=None, task_time_s=None):
  vw, source, params0, tx, server = build_vw(data_dir, partition=TWO_STAGES, num_inflight=num_inflight,
                                             staleness_bound=staleness_bound, optimizer=optax.sgd(0.05, momentum=0.9),
                                             client_factory=_slow_factory(push_s, pull_s), stages=stages,
                                             ps_channel=mode)
  vw.task_time_s = task_time_s
  return vw, source, params0, tx, server


def test_a_slow_ps_overlaps_compute_with_the_same_numerics(synthetic_data_dir):
  """Nm = 1, D = 1, emulated tasks of T = 60 ms per minibatch (two stages of 30 ms), a PS whose push takes P = 40 ms
  and whose pull reply L = 15 ms. Minibatch p + 1 starts only once p completed (Nm = 1), and inline the scheduler
  pushes wave p before it injects p + 1, so inline takes at least n (T + P). Through the channel the push and the pull
  (P + L <= T) overlap the next minibatch, which needs only the global clock p (D = 1): n T plus the last push and
  the per-minibatch host work (bounded by 15 ms here, a loaded machine). Both runs equal plain sequential training
  (Nm = 1: minibatch p sees updates 0..p-1). Through the channel its thread also places each reply's weights on the
  stages' devices."""
  n, push_s, pull_s = 10, 0.040, 0.015
  times = task_times.uniform_task_times([30.0, 30.0], fwd_fraction=0.5)
  t_mb = 0.060
  warm, *_ = _vw(synthetic_data_dir, "thread", push_s=0.0, pull_s=0.0)
  warm.run(4)  # compiles the stage functions
  walls, overlaps = {}, {}
  for mode in ("inline", "thread"):
    vw, source, params0, tx, _ = _vw(synthetic_data_dir, mode, push_s=push_s, pull_s=pull_s, stages=warm.stages,
                                     task_time_s=times.task_duration_s)
    placing = []  # the threads that placed pulled weights on the stages' devices
    place = vw.stage_params_of

    def logged_place(s, flat):
      placing.append(threading.current_thread().name)
      return place(s, flat)

    vw.stage_params_of = logged_place
    stats = vw.run(n)
    assert stats.ps_channel == mode and vw.ps_channel_mode == mode
    # (through the channel the last reply may be placed but left for a next run)
    # WSP at D = 1 with Nm = 1 and one VW: a minibatch injected at local clock c (waves 0..c-1 done) runs on pulled
    # weights of global clock c - 1 (the bound) or c (every wave it pushed), whatever the timing; a reply can supersede
    # an older one before the scheduler installs it, so the number of installs itself is not fixed.
    assert all(max(0, r.local_clock_at_injection - 1) <= r.version_global_clock <= r.local_clock_at_injection
               for r in vw.records), [(r.local_clock_at_injection, r.version_global_clock) for r in vw.records]
    assert stats.num_pulls >= 1 and 2 * stats.num_pulls <= len(placing) <= 2 * (stats.num_pulls + 1)
    # through the channel its thread places a reply's weights: the scheduler's install only adds on the devices
    assert all(t.startswith("ps-channel") == (mode == "thread") for t in placing), placing
    walls[mode] = stats.wall_time_s
    # the seconds of each push (wave p) during which the next minibatch (p + 1, Nm = 1) was in flight, from the
    # records' times and the client's push spans on one clock (the records count from stats.start_unix_s)
    spans = {w: (a - stats.start_unix_s, b - stats.start_unix_s) for w, a, b in vw.ps.push_spans}
    overlap = [max(0.0, min(spans[p][1], vw.records[p + 1].complete_time_s)
                   - max(spans[p][0], vw.records[p + 1].inject_time_s)) for p in range(n - 1)]
    overlaps[mode] = overlap
    assert stats.num_pushes == n and len(vw.ps.losses) == n
    if mode == "thread":
      assert stats.ps_channel_s >= n * push_s  # the channel thread made every push
      assert all(e[-1].startswith("ps-channel") for e in vw.ps.log)
    else:
      assert stats.ps_channel_s == 0.0 and not any(e[-1].startswith("ps-channel") for e in vw.ps.log)
    assert all(np.isfinite(r.loss) for r in vw.records)
    versions = [r.version_local_updates for r in vw.records]
    assert versions == list(range(n))
    expected = sequential_replay(models.get_model("mlp_tiny"), params0, tx, [source.get(p) for p in range(n)],
                                 versions)
    assert_params_close(vw.layer_params(), expected)
  assert walls["inline"] >= n * (t_mb + push_s), walls
  # Inline the scheduler injects p + 1 only after push p returned: no push overlaps compute.
  assert overlaps["inline"] == [0.0] * (n - 1), overlaps
  # Through the channel the next minibatch runs during the push: at least half of the push time after the first two
  # waves is hidden (a closed form, P = 40 ms per push, read on the records' clock, so a loaded machine's host work
  # per minibatch, which lengthens both runs alike, does not enter; measured about 0.035 s of each 0.040 s push).
  assert sum(overlaps["thread"][1:]) >= 0.5 * (n - 2) * push_s, overlaps


def test_a_pull_request_never_overtakes_its_own_push(synthetic_data_dir):
  """Every pull request reaches the client after the VW's pushes of every wave it had ended when it sent the
  request, with slow pushes (the channel thread is behind the scheduler)."""
  nm, n = 2, 16
  vw, *_ = _vw(synthetic_data_dir, "thread", push_s=0.03, pull_s=0.0, num_inflight=nm, staleness_bound=2)
  sent = []  # per pull request, the waves the scheduler had ended when it sent it
  send = vw.ps_channel.request_pull

  def request_pull(clock):
    sent.append(vw.stats.num_pushes)
    send(clock)

  vw.ps_channel.request_pull = request_pull
  vw.run(n)
  arrived = [e[2] for e in vw.ps.log if e[0] == "pull"]
  assert len(arrived) == len(sent) >= 3
  assert arrived == sent, (arrived, sent)
  assert [e[1] for e in vw.ps.log if e[0] == "push"] == list(range(n // nm))


@pytest.mark.parametrize("bad", [11, 5])  # the last wave first: with the error lost, a middle one hangs
@pytest.mark.parametrize("fault", ["nan_loss", "bad_update"])
def test_an_error_on_the_channel_thread_stops_the_run(synthetic_data_dir, fault, bad):
  """A NaN loss (read back on the channel thread) and the PS refusing a NaN update raise the inline path's errors
  from the run, in a middle wave (at the scheduler's next call into the channel) and in the last one (at the run
  end's flush); the waves before are pushed, with their records' losses."""
  nm, n = 2, 12
  vw, source, *_ = _vw(synthetic_data_dir, "thread", push_s=0.0, pull_s=0.0, num_inflight=nm, staleness_bound=1)
  assert vw.ps_channel_mode == "thread"
  if fault == "nan_loss":
    def get(p):
      x, y = source.get(p)
      return (np.full_like(x, np.nan) if p == bad else x), y
    vw.get_minibatch = get
    error, match = FloatingPointError, f"loss is nan at minibatch {bad}"
  else:
    def corrupt(wave, flat):
      if wave == bad // nm:
        flat[0] = np.nan
    vw.corrupt_update = corrupt
    error, match = param_server.BadUpdateError, f"update of wave {bad // nm} has 1 NaN/Inf values"
  with pytest.raises(error, match=match):
    vw.run(n)
  assert vw.ps_channel.running is False
  pushed = [e[1] for e in vw.ps.log if e[0] == "push"]
  assert pushed == list(range(bad // nm))
  assert all(np.isfinite(r.loss) for r in vw.records[:bad // nm * nm])


@pytest.fixture
def through_the_channel(monkeypatch):
  """tests/test_pipeline.py's VWs built with a PS channel thread (its helper builds them inline)."""
  monkeypatch.setattr(pipeline_tests, "build_vw", functools.partial(build_vw, ps_channel="thread"))


@pytest.mark.parametrize("ps_apply", ["clock_aligned", "on_receipt"])
@pytest.mark.parametrize("staleness_bound,pull_every_wave", [(1, True), (1, False), (2, True)])
def test_own_waves_kept_across_pulls_through_the_channel(synthetic_data_dir, through_the_channel, staleness_bound,
                                                         pull_every_wave, ps_apply):
  """The replay oracle of pulls that lack the VW's own pushed waves (test_pipeline's), through the channel."""
  pipeline_tests.test_pull_while_own_waves_are_unapplied_keeps_them(synthetic_data_dir, staleness_bound,
                                                                    pull_every_wave, ps_apply)


@pytest.mark.parametrize("ps_apply", ["clock_aligned", "on_receipt"])
def test_pull_installed_mid_wave_through_the_channel(synthetic_data_dir, through_the_channel, ps_apply):
  pipeline_tests.test_pull_installed_mid_wave_keeps_own_and_partial_waves(synthetic_data_dir, ps_apply)


def test_replay_of_recorded_versions_through_the_channel(synthetic_data_dir, through_the_channel):
  pipeline_tests.test_oracle2_replay_of_recorded_versions(synthetic_data_dir, 3, pipeline_tests.THREE_STAGES)
  pipeline_tests.test_each_stage_function_compiles_once(synthetic_data_dir)


def test_where_the_channel_runs(synthetic_data_dir):
  """HetPipe with one in-process PS: the channel thread (the default); inline where asked or where the VW's method
  is not HetPipe's per-minibatch update (PipeDream, the flush methods keep their own wave ends); a bad value is
  refused."""
  assert build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=2,
                  ps_channel="thread")[0].ps_channel_mode == "thread"
  assert build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=2)[0].ps_channel_mode == "inline"
  pipedream, *_ = build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=2, method="pipedream",
                           ps_channel="thread")
  assert pipedream.ps_channel_mode == "inline"
  assert pipedream.run(4).ps_channel == "inline"
  with pytest.raises(ValueError, match="ps_channel must be 'thread' or 'inline', got 'threads'"):
    build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=2, ps_channel="threads")


@pytest.mark.mpi
def test_an_mpi_vw_pushes_through_its_channel_and_records_it(three_rank_run, sharded_run):
  """Under mpiexec (one PS, two VWs) each VW's PS operations ran on its channel thread, as summary.json records;
  two PS shards keep them inline, recorded too (the runs of tests/conftest.py's ``three_rank_run`` and
  ``sharded_run``)."""
  import json  # pylint: disable=g-import-not-at-top
  for workdir, shards, mode in ((three_rank_run, 1, "thread"), (sharded_run, 2, "inline")):
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["num_ps_shards"] == shards and summary["num_virtual_workers"] == 2
    per_vw = summary["per_vw"]
    assert {v: (s["ps_channel"], s["ps_channel_s"] > 0) for v, s in per_vw.items()} == {
        "0": (mode, mode == "thread"), "1": (mode, mode == "thread")}, per_vw


def test_a_new_segment_installs_no_pull_of_the_last(synthetic_data_dir):
  """A checkpoint barrier starts a new WSP segment (``begin_segment``; the PS's clocks restart, here a new server
  from the barrier's weights): a pull reply the channel received in the segment before (one VW: the PS answers the
  last wave end's pull at once) is not installed in the next, whose every install holds only its own waves."""
  nm = 2
  vw, *_ = build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=nm, staleness_bound=1,
                    ps_channel="thread")
  vw.run(2 * nm)
  flat = vw.ps.server.weights.copy()
  vw.begin_segment(flat)
  vw.ps = param_server.LocalPSClient(param_server.ParameterServer(flat, 1), 0)
  installs = []  # (pulled vector clock, waves pushed to the segment's PS then)
  install = vw.install_pull

  def logged_install(vector_clock, flat):
    installs.append((tuple(vector_clock), vw.ps.server.state.pushed_waves[0]))
    install(vector_clock, flat)

  vw.install_pull = logged_install
  vw.run(3 * nm)  # wave 2 needs global clock 1 (D = 1): at least one install, whatever the timing
  assert installs and all(vc[0] <= pushed for vc, pushed in installs), installs
