"""The lead's metrics rule (hetpipe_jax/runtime/clock_log.py) against hand-computed lines, and every driver's final
line through it."""

import json
import math

import numpy as np
import pytest

from hetpipe_jax.runtime.clock_log import ClockLog


def _log(**kw):
  lines, seen = [], []

  def evaluate(flat):
    seen.append(float(flat[0]))
    return {"test_accuracy": float(flat[0]) / 10, "test_loss": 1.0}

  return ClockLog(lines.append, evaluate, **kw), lines, seen


def test_lines_and_evaluations_follow_the_clock_rule():
  """eval_every 3, log_every 2, ticks 1..7, one loss per tick: lines at 2, 3 (evaluated), 4, 6 (evaluated); each
  line's loss is the mean of the losses since the previous line (hand-computed); the weights are read only when an
  evaluation is due."""
  log, lines, seen = _log(eval_every=3, log_every=2)
  for clock in range(1, 8):
    log.losses.append(float(clock))
    log.tick(clock, done=10 * clock, time_s=0.5 * clock, weights=lambda c=clock: np.array([c], np.float32))
  assert [l["global_clock"] for l in lines] == [2, 3, 4, 6]
  assert [l["wave"] for l in lines] == [1, 2, 3, 5]
  assert [l["loss"] for l in lines] == [1.5, 3.0, 4.0, 5.5]  # (1+2)/2, 3, 4, (5+6)/2
  assert seen == [3.0, 6.0]
  assert [("test_accuracy" in l) for l in lines] == [False, True, False, True]
  assert lines[1]["minibatches"] == 30 and lines[1]["wall_time_s"] == 1.5 and lines[1]["minibatches_per_s"] == 20.0
  assert log.evals == [{"global_clock": 3, "wall_time_s": 1.5, "test_accuracy": 0.3, "test_loss": 1.0},
                       {"global_clock": 6, "wall_time_s": 3.0, "test_accuracy": 0.6, "test_loss": 1.0}]
  assert log.losses == [7.0]  # tick 7 wrote no line: its loss waits for the next one
  final = log.line(7, 70, 3.5, {"test_accuracy": 0.9, "test_loss": 0.5}, final=True)
  assert "wave" not in final and final["loss"] == 7.0 and final["test_accuracy"] == 0.9
  assert len(log.evals) == 2  # the final evaluation is the run's own, not one of the run's evaluations


def test_a_line_without_new_losses_keeps_the_last_loss_and_eval_before_stops_evaluations():
  log, lines, seen = _log(eval_every=1, log_every=1, eval_before=3, simulated=True)
  assert math.isnan(log.loss)
  log.tick(1, 4, 0.0, lambda: np.array([1.0], np.float32))
  assert math.isnan(lines[0]["loss"]) and math.isnan(lines[0]["minibatches_per_simulated_s"])  # no time: no rate
  log.losses.append(2.0)
  for clock in (2, 3):
    log.tick(clock, 4 * clock, 1.0 * clock, lambda c=clock: np.array([c], np.float32))
  assert [l["loss"] for l in lines[1:]] == [2.0, 2.0]
  assert seen == [1.0, 2.0]  # clock 3 is eval_before: no evaluation there
  assert {"simulated_time_s", "minibatches_per_simulated_s", "host_wall_time_s"} <= set(lines[2])
  assert "wall_time_s" not in lines[2]


def test_state_restores_a_resumed_log():
  log, _, _ = _log(eval_every=2, log_every=2)
  log.losses += [1.0, 3.0]
  log.tick(2, 2, 1.0, lambda: np.array([5.0], np.float32))
  log.losses.append(4.0)
  saved = json.loads(json.dumps(log.state()))
  resumed, lines, _ = _log(eval_every=2, log_every=2)
  resumed.restore(saved)
  resumed.tick(4, 4, 2.0, lambda: np.array([6.0], np.float32))
  assert lines[0]["loss"] == 4.0 and [e["global_clock"] for e in resumed.evals] == [2, 4]


@pytest.mark.parametrize("simulated", [False, True])
def test_an_unevaluated_run_never_reads_the_weights(simulated):
  lines = []
  log = ClockLog(lines.append, None, eval_every=1, log_every=1, simulated=simulated)
  log.tick(1, 1, 1.0, weights=lambda: pytest.fail("weights read without an evaluation"))
  assert len(lines) == 1 and log.evals == []
  assert log.eval_due(1)  # the rule itself (a PS shard sends its slice by it) does not depend on an evaluator
