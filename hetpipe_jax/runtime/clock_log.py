"""The lead's ``metrics.jsonl``: when a line is written and the global weights are evaluated, and what a line holds.

Runtime layer (numpy only). One rule for every driver that keeps the run's metrics: the MPI parameter server's lead
(:class:`hetpipe_jax.mpi.ps_server.ParameterServerService`), rank 0 of the MPI all-reduce job
(:mod:`hetpipe_jax.jobs.allreduce_job`) and virtual time (:mod:`hetpipe_jax.jobs.virtual_job`, both syncs). The
drivers differ only in where the ticks, losses and weights come from (MPI messages, or the simulated event loop).

A tick is a global clock c >= 1 reached (HetPipe §5: the slowest VW's completed waves; the flush methods: steps). At
tick c the weights are evaluated when ``eval_every > 0`` divides c (and c is below ``eval_before``, where the run's own
final evaluation follows), and a line is written when ``log_every`` divides c or the tick was evaluated. A line's
``loss`` is the mean of the per-wave (per-step) mean losses reported since the previous line, or the previous line's
when none was.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from absl import logging
import numpy as np

TIME_KEYS = {False: ("wall_time_s", "minibatches_per_s"), True: ("simulated_time_s", "minibatches_per_simulated_s")}


def progress_bar(total: int, desc: str, unit: str, initial: int = 0) -> Any:
  """The run's tqdm bar, as every driver shows it: ``total`` units of ``unit``, ``initial`` of them done (a resumed
  run's), redrawn at most once a second. tqdm is imported only when a bar is shown."""
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm(total=total, initial=initial, desc=desc, unit=unit, mininterval=1.0, dynamic_ncols=True)


@dataclasses.dataclass
class ClockLog:
  """The metrics lines and evaluations of one run, at its global-clock ticks.

  Attributes:
    write: writes one ``metrics.jsonl`` line (:meth:`hetpipe_jax.jobs.outputs.RunOutputs.log_metrics`).
    evaluate: float32 ``[num_params]`` flat weights -> ``{"test_accuracy", "test_loss", ...}``, or None (never).
    eval_every: ticks between evaluations (0: only the run's final one).
    log_every: ticks between lines (``config.log_every_waves``; below 1 counts as 1).
    simulated: times are simulated seconds (virtual time: keys ``simulated_time_s``, ``minibatches_per_simulated_s``
      and the host's ``host_wall_time_s``), else wall seconds (``wall_time_s``, ``minibatches_per_s``).
    eval_before: no evaluation during the run at this clock or later (the flush methods: the final step's is the
      run's own); None: none such.
    name: the log lines' prefix (``"[PS]"``).
    bar: a tqdm bar whose postfix shows the last line's loss, clock and accuracy, or None.
    losses: per-wave mean losses not yet in a line.
    loss: the last line's loss (NaN before the first).
    last_eval: the last evaluation (``{}`` before the first).
    evals: every evaluation during the run: ``{"global_clock", <time key>, **evaluation}`` in clock order.
    host_t0: ``time.perf_counter()`` at the start (``host_wall_time_s`` of simulated lines).
  """

  write: Callable[[dict], None]
  evaluate: Callable[[np.ndarray], dict] | None
  eval_every: int
  log_every: int
  simulated: bool = False
  eval_before: int | None = None
  name: str = "[PS]"
  bar: Any = None
  losses: list = dataclasses.field(default_factory=list)
  loss: float = float("nan")
  last_eval: dict = dataclasses.field(default_factory=dict)
  evals: list = dataclasses.field(default_factory=list)
  host_t0: float = dataclasses.field(default_factory=time.perf_counter)

  def eval_due(self, clock: int) -> bool:
    """Whether the global weights are evaluated at global clock ``clock`` (absolute, a resumed run's included; where
    :attr:`evaluate` is None, whether they would be: a PS shard sends the lead its slice then)."""
    return self.eval_every > 0 and clock % self.eval_every == 0 and (self.eval_before is None or clock < self.eval_before)

  def line_due(self, clock: int, evaluated: bool) -> bool:
    """Whether tick ``clock`` writes a line (``evaluated``: the tick was evaluated)."""
    return clock % max(1, self.log_every) == 0 or evaluated

  def tick(self, clock: int, done: int, time_s: float, weights: Callable[[], np.ndarray]) -> dict | None:
    """Global clock ``clock`` reached with ``done`` minibatches trained in all (every VW) after ``time_s`` seconds:
    evaluates ``weights()`` when due, writes the line when due; returns it, or None."""
    evaluation = self.evaluate(weights()) if self.evaluate is not None and self.eval_due(clock) else None
    if not self.line_due(clock, evaluation is not None):
      return None
    return self.line(clock, done, time_s, evaluation)

  def line(self, clock: int, done: int, time_s: float, evaluation: dict | None = None, final: bool = False) -> dict:
    """Writes the line of tick ``clock`` (``final``: the run's last line, after its final evaluation: no ``wave``
    key, and not added to :attr:`evals`); returns it."""
    if self.losses:
      self.loss = float(np.mean(self.losses))
      self.losses = []
    time_key, rate_key = TIME_KEYS[self.simulated]
    line: dict[str, Any] = {"minibatches": done}
    if not final:
      line["wave"] = clock - 1
    line.update({"global_clock": clock, "loss": self.loss, time_key: time_s,
                 rate_key: done / time_s if time_s > 0 else float("nan")})
    if self.simulated:
      line["host_wall_time_s"] = time.perf_counter() - self.host_t0
    if evaluation is not None:
      line.update(evaluation)
      self.last_eval = dict(evaluation)
      if not final:
        self.evals.append({"global_clock": clock, time_key: time_s, **evaluation})
    self.write(line)
    if self.bar is not None:
      post = {"loss": f"{self.loss:.3f}", "clock": clock}
      if "test_accuracy" in self.last_eval:
        post["acc"] = f"{self.last_eval['test_accuracy']:.3f}"
      self.bar.set_postfix(post, refresh=False)
    if evaluation is not None:
      logging.info("%s global clock %d: loss %.4f, test accuracy %.4f", self.name, clock, self.loss,
                   evaluation.get("test_accuracy", float("nan")))
    return line

  def state(self) -> dict:
    """What a checkpoint keeps to continue the log (:meth:`restore`)."""
    return {"last_loss": self.loss, "pending_losses": list(self.losses), "evals": list(self.evals)}

  def restore(self, meta: dict) -> None:
    """Continues a resumed run's log from its checkpoint's ``meta`` (:meth:`state`'s keys; absent: a fresh log)."""
    self.loss = float(meta.get("last_loss", float("nan")))
    self.losses = list(meta.get("pending_losses", []))
    self.evals = list(meta.get("evals", []))
