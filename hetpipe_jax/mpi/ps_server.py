"""The parameter server's MPI service loop (rank 0, or every PS shard): pushes, pulls, evaluation and metrics lines
(HetPipe §5).

Runtime layer. Polls for headers with ``Iprobe`` and sleeps when idle (:class:`hetpipe_jax.mpi.wire.Backoff`, from
20 µs to 0.5 ms, with a 1 µs timer slack: MPICH's blocking receives spin, and the machine's cores belong to the VWs;
a fixed 0.5 ms sleep with the kernel's default slack cost 2-2.5 ms per push + pull on this machine,
``scripts/bench_ps.py``), applies wave updates (on receipt, or clock-aligned) through :class:`ParameterServer`,
answers pulls once the global clock allows (pending ones are kept by
:class:`hetpipe_jax.rules.wsp.ParameterServerState`), evaluates the global weights every ``eval_every_waves`` clock
ticks (with several shards: assembled from every shard's slice at that clock) and writes ``metrics.jsonl`` lines
through the run's :class:`~hetpipe_jax.jobs.outputs.RunOutputs`.
"""

from __future__ import annotations

import json
import time
from typing import Callable

from absl import logging
import numpy as np

from hetpipe_jax.host_timers import fine_timer_slack
from hetpipe_jax.mpi import ps_client
from hetpipe_jax.mpi import wire
from hetpipe_jax.mpi.wire import Kind
from hetpipe_jax.ps.param_server import ParameterServer
from hetpipe_jax.ps.shards import WaveAssembler
from hetpipe_jax.rules import watchdog
from hetpipe_jax.runtime.clock_log import ClockLog, progress_bar

WATCH_EVERY_S = 1.0  # the watchdog looks at most this often (the idle loop polls every 20 µs to 0.5 ms)
IDLE_MAX_S = 5e-4  # the service's longest poll pause while no message arrives (the cores belong to the VWs)


class ParameterServerService:
  """Serves N VWs until each has sent DONE.

  Args:
    comm: MPI communicator (rank 0 = this PS, rank r = VW r-1).
    server: the PS holding the global weights.
    num_minibatches_per_vw: how many minibatches each VW trains (for progress and rates).
    num_inflight: Nm (minibatches per wave).
    evaluate: ``flat weights -> {"test_accuracy", "test_loss"}`` or None.
    eval_every_waves: evaluate when the global clock reaches a multiple of this (0 = only at the end).
    log_every_waves: write a metrics line when the global clock reaches a multiple of this.
    log_metrics: writes one ``metrics.jsonl`` line (:meth:`hetpipe_jax.jobs.outputs.RunOutputs.log_metrics`).
    progress: show a tqdm bar.
    first_vw_rank: rank of VW 0 (= the number of PS shards; VW v is rank ``first_vw_rank + v``).
    lead: this is the lead shard (rank 0): it also takes metrics, reports, segments and optimizer states, evaluates
      and logs. A non-lead shard (sharded PS, HetPipe §8.1) only applies its slice of the pushes and answers pulls,
      until every VW sent DONE.
    parts: stage ranks (:class:`hetpipe_jax.ps.shards.VWParts` per VW): a VW's wave reaches this shard as one part
      from each of its senders and is pushed (applied, counted by the WSP state) once the last part arrived
      (:class:`hetpipe_jax.ps.shards.WaveAssembler`); a pull's reply goes to each receiver as its part plus the
      vector clock. PULL, METRICS, SEGMENT and DONE come from the VW's driver, OPTSTATE from each of its ranks that
      holds parameters. None: rank ``first_vw_rank + v`` is all of VW v.
    shard: this shard's index (with ``parts``).
    watchdog_s: the lead's progress watchdog (:mod:`hetpipe_jax.rules.watchdog`): a VW silent this many seconds
      while the PS owes it nothing is hung and :meth:`run` raises; 0: off.
    eval_shards: the lead of several shards: their :class:`hetpipe_jax.ps.shards.ShardLayout`. Each shard keeps its
      slice at the moment its own global clock reaches an evaluation clock c (:meth:`eval_due`; a non-lead shard
      with ``eval_every_waves > 0`` sends it to rank 0 on :data:`~hetpipe_jax.mpi.wire.TAG_SHARD_EVAL`); the lead
      evaluates the weights assembled from all S slices of c once the last arrived, in clock order, and holds back
      later metrics lines until then. A shard's clock is the minimum over VWs, so each slice holds every VW's waves
      below c and possibly some later ones: what a VW's pull at clock c could see. None: one shard (the lead
      evaluates its own weights at once); ignored without evaluations during the run (``eval_every_waves`` 0).
  """

  def __init__(self, comm, server: ParameterServer, *, num_minibatches_per_vw: int, num_inflight: int,
               evaluate: Callable[[np.ndarray], dict] | None, eval_every_waves: int, log_every_waves: int,
               log_metrics: Callable[[dict], None], progress: bool = True, first_vw_rank: int = 1,
               lead: bool = True, parts=None, shard: int = 0, watchdog_s: float = 0.0, eval_shards=None):
    self.comm = comm
    self.eval_shards = eval_shards if lead and eval_every_waves > 0 else None
    self._eval_slices: dict[int, dict[int, np.ndarray]] = {}  # the sharded lead's: clock -> shard -> slice at clock
    self._eval_lines: list[tuple[int, bool]] = []  # its metrics lines held back: (clock, evaluated), clock order
    self.watchdog_s = watchdog_s if lead else 0.0
    self.parts = parts
    self.shard = shard
    self.assembler = None
    self.vw_of_rank = None
    if parts is not None:
      self.assembler = WaveAssembler(parts, shard, server.weights.size)
      self.vw_of_rank = {r: p.vw_id for p in parts for r in {r for r, _ in p.flat_index}}
    self.first_vw_rank = first_vw_rank
    self.lead = lead
    self.server = server
    self.n = server.state.num_virtual_workers
    # Per wave update applied here: seconds from its header's receipt to applied with the pulls it unblocked sent
    # (receiving the payload, checking and adding it, answering pulls; not evaluation or metrics).
    self.push_service_s: list[float] = []
    self._next_watch = 0.0  # the idle loop's next watchdog check (monotonic seconds)
    self.unheard = set(range(self.n))  # VWs not heard from since this process started (the watchdog's start-up limit)
    self.num_minibatches_per_vw = num_minibatches_per_vw
    self.num_inflight = num_inflight
    self.sends: list = []
    self.reports: dict[int, dict] = {}
    self.minibatches_done = [0] * self.n
    self.t0 = time.perf_counter()
    self._logged_clock = 0
    self.clock_offset = 0  # the segment's first global clock (checkpoint segments, jobs/resume.py)
    self.time_offset_s = 0.0  # wall seconds of the run before this process (a resumed run)
    self.expect_opt_state = False  # this segment ends in a checkpoint: VWs send their optimizer states
    self.segment_reports: dict[int, dict] = {}
    self.segment_opt: dict[int, np.ndarray] = {}
    self._bar = None
    if progress and lead:
      self._bar = progress_bar(self.n * num_minibatches_per_vw, "[PS] minibatches", "mb",
                               initial=sum(self.minibatches_done))
    # the lead's metrics lines and evaluations (the rule every driver shares)
    self.log = ClockLog(log_metrics, evaluate, eval_every_waves, log_every_waves, bar=self._bar)

  def run(self) -> None:
    """Serves one segment: until every VW has sent DONE or SEGMENT (a checkpoint barrier; see
    :mod:`hetpipe_jax.jobs.resume`). Their reports are in ``reports`` (DONE) and ``segment_reports`` (SEGMENT), the
    optimizer states sent at a checkpoint in ``segment_opt`` (by sending rank: each VW rank sends its stages').

    Raises:
      wire.ProtocolError: a malformed or unexpected message.
      BadUpdateError: a wave update with NaN/Inf or the wrong size (nothing of it is applied).
      hetpipe_jax.rules.watchdog.HungRankError: the lead's watchdog found a VW silent for ``watchdog_s`` seconds.
    """
    from mpi4py import MPI
    status = MPI.Status()
    header = np.empty(wire.HEADER_SIZE, np.int64)
    self.segment_reports, self.segment_opt = {}, {}
    self.server.wave_offset = self.clock_offset
    kinds = ((Kind.PUSH, Kind.METRICS, Kind.PULL, Kind.DONE, Kind.SEGMENT, Kind.OPTSTATE) if self.lead else
             (Kind.PUSH, Kind.PULL, Kind.DONE, Kind.SEGMENT))
    self.done_waves: dict[int, int] = {}  # VW -> waves it did (its DONE or SEGMENT)
    fine_timer_slack()  # sleeps end within ~1 µs of their deadline, not the kernel's default 50 µs slack
    backoff = wire.Backoff(max_s=IDLE_MAX_S)
    self.last_heard = dict.fromkeys(range(self.n), time.monotonic())  # VW -> when one of its ranks last sent
    while (len(self.reports) + len(self.segment_reports) < self.n or len(self.segment_opt) < self._opt_expected()
           or self._parts_outstanding()):
      if self.eval_shards is not None:
        self._take_eval_slices(status, MPI.ANY_SOURCE)
      if not self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=wire.TAG_PS_HEADER, status=status):
        self.sends = [(r, b) for r, b in self.sends if not r.Test()]
        # Large replies (rendezvous protocol) progress only while this rank calls into MPI: poll fast until sent.
        # Otherwise back off from 20 µs to 0.5 ms while idle: quick when messages come often (a small model's
        # waves), few wake-ups when they do not (the cores are the VWs').
        backoff.wait(busy=bool(self.sends))
        self._check_progress()
        continue
      backoff.reset()
      src = status.Get_source()
      self.comm.Recv(header, source=src, tag=wire.TAG_PS_HEADER)
      t_header = time.perf_counter()
      vw = wire.check_header(header, source=src, dest=self.shard, kinds=kinds).vw  # its part's size depends on it
      self.last_heard[vw] = time.monotonic()
      self.unheard.discard(vw)
      num_params = self.server.weights.size
      if self.parts is not None and 0 <= vw < len(self.parts):
        num_params = self.parts[vw].part_size(src, self.shard)
      h = ps_client.check_header(header, src, num_params=num_params, expect_kinds=kinds,
                                 first_vw_rank=self.first_vw_rank, vw_of_rank=self.vw_of_rank, dest=self.shard)
      kind, wave, size = h.kind, h.wave, h.size
      if (self.parts is not None and kind not in (Kind.PUSH, Kind.OPTSTATE) and src != self.parts[vw].driver):
        raise wire.ProtocolError(f"rank {src} sent {kind.name} for VW {vw}; only its driver (rank "
                                 f"{self.parts[vw].driver}) does")
      payload = ps_client.recv_payload(self.comm, src, kind, size) if kind is not Kind.PULL else None
      if kind is Kind.PUSH:
        if self.assembler is not None:  # stage ranks: the whole wave once its last part arrived, else None
          payload = self.assembler.add(vw, wave, src, payload)
        if payload is not None:
          before = self.server.global_clock
          self.server.push(vw, wave, payload)
          self._serve_pulls(self.server.state.serve_pending_pulls())
          self.push_service_s.append(time.perf_counter() - t_header)
          if self.lead:
            for clock in range(before + 1, self.server.global_clock + 1):
              self._on_clock(self.clock_offset + clock)
          elif self.log.eval_every > 0:
            for clock in range(before + 1, self.server.global_clock + 1):
              self._send_eval_slice(self.clock_offset + clock)
      elif kind is Kind.METRICS:
        loss_sum, count, _ = payload
        self.minibatches_done[vw] += int(count)
        self.log.losses.append(loss_sum / max(count, 1))
        if self._bar is not None:
          self._bar.update(int(count))
      elif kind is Kind.PULL:
        if self.server.state.request_pull(vw, wave):  # else pending until a push advances the global clock
          self._serve_pulls([vw])
      elif kind is Kind.SEGMENT:  # the lead gets the VW's report, every other shard an empty SEGMENT
        self.done_waves[vw] = wave
        self.segment_reports[vw] = json.loads(payload.tobytes().decode()) if payload.size else {}
      elif kind is Kind.OPTSTATE:  # one per VW rank: the optimizer state of its stages
        self.segment_opt[src] = payload
      else:
        self.done_waves[vw] = wave
        self.reports[vw] = json.loads(payload.tobytes().decode()) if payload.size else {}
        logging.info("[PS] VW %d done (global clock %d)", vw, self.clock_offset + wave)
    if self._eval_lines:
      self._await_evals(status, MPI.ANY_SOURCE, backoff)
    self.flush_sends()

  def _check_progress(self) -> None:
    """The watchdog (:func:`hetpipe_jax.rules.watchdog.silent_vws`): raises when a VW the PS owes nothing (no held
    pull, no reported segment or end) has been silent for ``watchdog_s`` seconds."""
    if not self.watchdog_s:
      return
    now = time.monotonic()
    if now < self._next_watch:
      return
    self._next_watch = now + WATCH_EVERY_S
    waiting = set(self.reports) | set(self.segment_reports) | set(self.server.state.pending_pulls)
    silent = watchdog.silent_vws(now, self.last_heard, waiting, self.watchdog_s, self.unheard,
                                 watchdog.STARTUP_LIMIT_S)
    if silent:
      vw, silence = silent[0]
      rank = self.parts[vw].driver if self.parts is not None else self.first_vw_rank + vw
      raise watchdog.HungRankError(
          f"VW {vw} (driver rank {rank}) sent nothing for {silence:.1f} s (config.ps_watchdog_s={self.watchdog_s}): "
          f"a rank of it is hung (stopped, or a wedged GPU); the job is stopped so that it can be restarted",
          rank=rank)

  def _parts_outstanding(self) -> bool:
    """Stage ranks: some VW's DONE or SEGMENT arrived before the last parts of its waves (they come from other
    ranks)."""
    if self.assembler is None:
      return False
    pushed = self.server.state.pushed_waves
    return any(pushed[vw] < waves for vw, waves in self.done_waves.items())

  def _opt_expected(self) -> int:
    """Optimizer states expected this segment: one per VW rank (drivers and stage ranks) when it ends in a
    checkpoint."""
    if not self.expect_opt_state:
      return 0
    return self.n if self.vw_of_rank is None else len(self.vw_of_rank)

  def flush_sends(self) -> None:
    wire.wait_all([r for r, _ in self.sends])
    self.sends = []

  def release_barrier(self) -> None:
    """Ends a checkpoint barrier: sends every VW the global weights (they hold every VW's waves so far). The sends
    complete in the next segment's loop, where the watchdog runs: a rank hung at the barrier cannot block the PS."""
    self._serve_pulls(list(range(self.n)))

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()

  def _serve_pulls(self, vw_ids: list[int]) -> None:
    """Sends the current global weights and their vector clock to each of ``vw_ids`` (pulls the PS state answers),
    in order."""
    for vw in vw_ids:
      vector_clock, weights = self.server.pull_reply(vw)
      vc = np.array(vector_clock, np.int64)
      if self.parts is None:
        replies = [(vw + self.first_vw_rank, weights)]
      else:  # stage ranks: each receiver its part (the driver also gets the vector clock when it holds none)
        vw_parts = self.parts[vw]
        replies = [(r, np.ascontiguousarray(weights[vw_parts.shard_pos[(r, self.shard)]]))
                   for r in vw_parts.receivers(self.shard)]
      for dest, part in replies:
        header = wire.make_header(Kind.WEIGHTS, vw, wave=self.server.global_clock, size=part.size)
        ps_client.PS_BYTES.add(dest, part.nbytes)
        self.sends.append((self.comm.Isend(header, dest=dest, tag=wire.TAG_PS_HEADER), header))
        self.sends.append((self.comm.Isend(part, dest=dest, tag=wire.TAG_PS_DATA), part))
        self.sends.append((self.comm.Isend(vc, dest=dest, tag=wire.TAG_PS_DATA), vc))

  def eval_due(self, clock: int) -> bool:
    """Whether the global weights are evaluated at (absolute) global clock ``clock``: a multiple of
    ``eval_every_waves`` (never when it is 0). The one rule of the lead and of every shard
    (:meth:`hetpipe_jax.runtime.clock_log.ClockLog.eval_due`)."""
    return self.log.eval_due(clock)

  def _send_eval_slice(self, clock: int) -> None:
    """A non-lead shard whose global clock just reached ``clock``: when an evaluation is due there, sends rank 0 a
    copy of its slice now (a WEIGHTS header with ``wave`` = ``clock``, then the float32 slice; non-blocking)."""
    if not self.eval_due(clock):
      return
    part = self.server.weights.copy()
    header = wire.make_header(Kind.WEIGHTS, 0, wave=clock, size=part.size)
    self.sends.append((self.comm.Isend(header, dest=0, tag=wire.TAG_SHARD_EVAL), header))
    self.sends.append((self.comm.Isend(part, dest=0, tag=wire.TAG_SHARD_EVAL), part))

  def _take_eval_slices(self, status, any_source: int) -> None:
    """The sharded lead: receives every shard slice that has arrived for an evaluation (``status``: an MPI status
    the probe fills; ``any_source``: ``MPI.ANY_SOURCE``), then evaluates what is complete (:meth:`_finish_evals`).

    Raises:
      wire.ProtocolError: a slice from a rank that is not a non-lead shard, of the wrong size, for a clock where no
        evaluation is due, or sent twice for one clock.
    """
    layout = self.eval_shards
    header = np.empty(wire.HEADER_SIZE, np.int64)
    while self.comm.Iprobe(source=any_source, tag=wire.TAG_SHARD_EVAL, status=status):
      src = status.Get_source()
      self.comm.Recv(header, source=src, tag=wire.TAG_SHARD_EVAL)
      if not 0 < src < layout.num_shards:
        raise wire.ProtocolError(f"rank 0 received an evaluation slice from rank {src}, not a PS shard "
                                 f"(ranks 1..{layout.num_shards - 1})")
      h = wire.check_header(header, source=src, dest=0, kinds=(Kind.WEIGHTS,), size=layout.size(src))
      part = np.empty(h.size, np.float32)
      self.comm.Recv(part, source=src, tag=wire.TAG_SHARD_EVAL)
      slices = self._eval_slices.setdefault(h.wave, {})
      if not self.eval_due(h.wave) or src in slices:
        raise wire.ProtocolError(f"rank 0 received shard {src}'s slice for an evaluation at global clock {h.wave} "
                                 f"{'twice' if src in slices else f'(evaluations every {self.log.eval_every})'}")
      slices[src] = part
    self._finish_evals()

  def _finish_evals(self) -> None:
    """The sharded lead: writes its held-back metrics lines in clock order, each evaluated one once all S slices
    of its clock are in (the flat weights assembled by :meth:`hetpipe_jax.ps.shards.ShardLayout.scatter`)."""
    layout = self.eval_shards
    while self._eval_lines:
      clock, evaluated = self._eval_lines[0]
      if evaluated:
        slices = self._eval_slices.get(clock, {})
        if len(slices) < layout.num_shards:
          return
        flat = np.zeros(layout.num_params, np.float32)
        for shard, part in slices.items():
          layout.scatter(flat, shard, part)
        del self._eval_slices[clock]
      self._eval_lines.pop(0)
      self.log.line(clock, sum(self.minibatches_done), self.wall_s(), self.log.evaluate(flat) if evaluated else None)

  def _await_evals(self, status, any_source: int, backoff) -> None:
    """The sharded lead at the end of a segment (every VW sent DONE or SEGMENT, so every shard reaches every clock
    the lead reached): waits for the slices of its outstanding evaluations."""
    while self._eval_lines:
      self.sends = [(r, b) for r, b in self.sends if not r.Test()]
      self._take_eval_slices(status, any_source)
      if self._eval_lines:
        backoff.wait(busy=bool(self.sends))

  def _on_clock(self, clock: int) -> None:
    if self.eval_shards is not None:  # several shards: the evaluation waits for every shard's slice of this clock
      due = self.log.evaluate is not None and self.eval_due(clock)
      if due:
        self._eval_slices.setdefault(clock, {})[self.shard] = self.server.weights.copy()
      if self.log.line_due(clock, due):
        self._eval_lines.append((clock, due))
      self._finish_evals()
      return
    self.log.tick(clock, sum(self.minibatches_done), self.wall_s(), lambda: self.server.weights)

  def wall_s(self) -> float:
    """Wall seconds of the run so far (a resumed run's earlier part included)."""
    return time.perf_counter() - self.t0 + self.time_offset_s
