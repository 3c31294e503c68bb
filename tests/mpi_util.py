"""Launching the real entry point under mpiexec from tests, with a timeout; reading and checking its outputs."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

from hetpipe_jax.paths import REPO_ROOT

BIN = pathlib.Path(sys.executable).parent


def mpiexec() -> str:
  exe = BIN / "mpiexec"
  return str(exe) if exe.exists() else "mpiexec"


# The run of tests/conftest.py's ``stage_ranks_run`` (8 ranks: 2 PS shards, 2 VWs x 3 stage ranks), read by
# tests/test_stage_ranks_mpi.py::test_two_vws_of_three_stage_ranks_equal_the_per_shard_replay (the per-shard replay,
# WSP, the task trace) and tests/test_global_clip.py::test_mpi_stage_ranks_clip_by_the_global_norm (the replay with
# and without the clip). The unclipped stage-rank replay: tests/test_launch.py's 4-node ED and HD launches.
STAGE_RANKS_RUN = {"num_virtual_workers": 2, "num_stages": 3, "partition": "0:2,2:3,3:4", "num_ps_shards": 2,
                   "checkpoint_every_waves": 0, "optimizer": "momentum", "momentum": 0.9, "learning_rate": 0.05,
                   "batch_size": 16, "num_minibatches": 16, "num_inflight": 2, "staleness_bound": 1,
                   "stage_ranks": True, "emulate_stage_ms": "3,3,3;9,9,9", "save_task_trace": True,
                   "grad_clip_norm": 1.5}


# tests/conftest.py's ``three_rank_run``: 1 PS + 2 VWs, read by tests/test_mpi_job.py::test_three_rank_run_writes_
# every_output and tests/test_ps_channel.py::test_an_mpi_vw_pushes_through_its_channel_and_records_it (one shard: the
# channel thread).
THREE_RANK_RUN = {"num_minibatches": 24, "num_inflight": 2, "staleness_bound": 1, "eval_every_epochs": 1.0}
# tests/conftest.py's ``sharded_run``: the 2-node ED plan with default placement (2 PS shards + 2 VWs), read by
# tests/test_ps_shards.py::test_sharded_run_equals_per_shard_replay_and_moves_the_predicted_bytes and
# tests/test_ps_channel.py::test_an_mpi_vw_pushes_through_its_channel_and_records_it (two shards: inline).
SHARDED_RUN = {"plan": "experiments/plans/local_cpu_2node_mlp_tiny_ed_default.json", "num_minibatches": 16,
               "staleness_bound": 1, "optimizer": "momentum", "learning_rate": 0.05, "checkpoint_every_waves": 0,
               "emulate_stage_ms": "5,5;15,15"}


def run_job(workdir, num_ranks: int, overrides: dict, config: str = "experiments/configs/tiny.py",
            timeout: float = 240, extra_args: tuple = ()) -> subprocess.CompletedProcess:
  """Runs ``hetpipe_jax.train`` on ``num_ranks`` ranks; returns the completed process (never hangs past timeout)."""
  args = [mpiexec(), "-n", str(num_ranks), sys.executable, "-m", "mpi4py", "-m", "hetpipe_jax.train",
          f"--config={config}", f"--workdir={workdir}"]
  overrides = {"check_counts": False, "progress": False, **overrides}
  args += [f"--config.{k}={v}" for k, v in overrides.items()] + list(extra_args)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
  env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    # A hang: every rank prints its threads' stacks (hetpipe_jax.train registers faulthandler on SIGUSR1), then the
    # whole launch is killed and the stacks are in the error.
    for pid in descendants(proc.pid):
      try:
        os.kill(pid, signal.SIGUSR1)
      except OSError:
        pass
    time.sleep(3.0)
    os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    deadline = time.monotonic() + 10.0
    while _group_alive(proc.pid) and time.monotonic() < deadline:  # the killed ranks gone before the error
      time.sleep(0.1)
    raise AssertionError(f"{' '.join(args[:3])} ... timed out after {timeout} s; its stderr, with the ranks' stacks "
                         f"(faulthandler):\n{err[-12000:]}") from None
  return subprocess.CompletedProcess(args, proc.returncode, out, err)


def processes() -> dict[int, tuple[int, int, str]]:
  """Every process as ``pid -> (parent pid, process group, state)``, from ``/proc/<pid>/stat``; Linux only."""
  table = {}
  for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
    try:
      state, ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
    except (OSError, ValueError):
      continue
    table[int(stat.parent.name)] = (int(ppid), int(pgrp), state)
  return table


def _group_alive(pgid: int) -> bool:
  """Whether a process of process group ``pgid`` is alive (not a zombie)."""
  return any(pgrp == pgid and state != "Z" for _, pgrp, state in processes().values())


def descendants(pid: int) -> list[int]:
  """Every process below ``pid`` (children, grandchildren, ...)."""
  children: dict[int, list[int]] = {}
  for child, (ppid, _, _) in processes().items():
    children.setdefault(ppid, []).append(child)
  found, todo = [], [pid]
  while todo:
    for child in children.get(todo.pop(), []):
      found.append(child)
      todo.append(child)
  return found


def read_jsonl(path) -> list[dict]:
  return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


def max_clock_distance(records: list[dict], num_inflight: int, start_s: dict | None = None) -> int:
  """The largest ``max - min`` over VWs of completed waves at any moment, derived from the minibatch records.

  A VW's local clock is the number of its waves whose last minibatch completed, so it changes at the
  ``complete_time_s`` of the records with ``(minibatch_id + 1) % Nm == 0``; completions at the same instant count
  together.

  Args:
    records: rows of ``minibatches.jsonl``.
    num_inflight: Nm.
    start_s: VW id -> its run's start on a clock common to all VWs (MPI: ``summary.json`` ``per_vw`` ``start_unix_s``;
      record times are relative to it); None: one clock already (virtual time).
  """
  clocks = dict.fromkeys({r["vw_id"] for r in records}, 0)
  ends = sorted(((start_s or {}).get(r["vw_id"], 0.0) + r["complete_time_s"], r["vw_id"]) for r in records
                if (r["minibatch_id"] + 1) % num_inflight == 0)
  best = i = 0
  while i < len(ends):
    t = ends[i][0]
    while i < len(ends) and ends[i][0] == t:
      clocks[ends[i][1]] += 1
      i += 1
    best = max(best, max(clocks.values()) - min(clocks.values()))
  return best


def vw_start_times(summary: dict) -> dict[int, float]:
  """VW id -> its run's start (machine clock, seconds) from an MPI run's ``summary.json``."""
  return {int(v): s["start_unix_s"] for v, s in summary["per_vw"].items()}


TASK = re.compile(r"^(\d+)(FB|F|B)(\d+)$")
KIND_SHARE = {"F": 1 / 3, "B": 2 / 3, "FB": 1.0}  # an emulated stage time: a third forward, two thirds backward


def check_task_trace(workdir, num_vws: int, num_stages: int, num_minibatches: int) -> list[dict]:
  """Checks ``tasks.jsonl``: every task of every VW once, in the schedule's order, with consistent times.

  Returns:
    Per VW, ``(stage_id, kind, minibatch_id) -> (start_s, end_s)`` with kind ``"F"``, ``"B"`` or ``"FB"``.
  """
  tasks = read_jsonl(pathlib.Path(workdir) / "tasks.jsonl")
  last = num_stages - 1
  expected = sorted([(s, "F", p) for s in range(last) for p in range(num_minibatches)]
                    + [(last, "FB", p) for p in range(num_minibatches)]
                    + [(s, "B", p) for s in range(last) for p in range(num_minibatches)])
  out = []
  for v in range(num_vws):
    times = {}
    for t in tasks:
      if t["vw_id"] == v:
        stage, kind, p = TASK.match(t["task"]).groups()
        key = (int(stage), kind, int(p))
        assert key not in times, f"VW {v} ran {t['task']} twice"
        assert 0 <= t["start_s"] <= t["end_s"], t
        times[key] = (t["start_s"], t["end_s"])
    assert sorted(times) == expected, f"VW {v}: tasks.jsonl lacks or adds tasks"
    for s in range(num_stages):  # one in-order device per stage: tasks never overlap
      spans = sorted(span for key, span in times.items() if key[0] == s)
      assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"VW {v} stage {s}: overlapping tasks"
      for kind in ("F", "B", "FB"):  # forwards in minibatch order, backwards in minibatch order
        starts = [times[(s, kind, p)][0] for p in range(num_minibatches) if (s, kind, p) in times]
        assert starts == sorted(starts), f"VW {v} stage {s}: {kind} tasks out of minibatch order"
    for p in range(num_minibatches):  # a task starts after the task whose output it consumes ended
      chain = [(s, "F", p) for s in range(last)] + [(last, "FB", p)] + [(s, "B", p) for s in reversed(range(last))]
      late = [(a, times[a][1], b, times[b][0]) for a, b in zip(chain, chain[1:]) if times[a][1] > times[b][0]]
      assert not late, f"VW {v} minibatch {p}: (task, its end, consumer, its start) {late}"
    out.append(times)
  return out


def excess_over_stage_ms(times: dict, stage_ms) -> list[float]:
  """Each task's ``end - start`` minus its emulated duration (seconds) for ``emulate_stage_ms`` per-stage times."""
  return [end - start - stage_ms[s] * KIND_SHARE[kind] / 1000 for (s, kind, _), (start, end) in times.items()]
