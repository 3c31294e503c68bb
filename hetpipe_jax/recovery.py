"""Automatic recovery of a launched job: name the rank that failed, decide whether its node is gone, re-plan onto
the GPUs that remain, and resume from the newest consistent checkpoint (``launch --max_restarts=K``).

Between the CLIs and the jobs. Anchors: torchelastic (``torchrun --max-restarts``: the whole job restarts; a
membership change on restart), Oobleck (SOSP'23: the pipelines re-instantiated on the surviving nodes). One attempt
is one ``mpiexec`` of ``hetpipe_jax.train``; when it fails:

1. **Which rank** (:func:`diagnose`): a hang blamed by the PS's watchdog (its failure record,
   :mod:`hetpipe_jax.mpi.rank_records`), unless a rank had already ended (a killed stage rank silences its VW's
   driver, and MPICH's clean-up may come after the watchdog's limit); else the rank whose process ended first with
   a non-zero status (each rank runs under :mod:`hetpipe_jax.mpi.rank_guard`, which records its end); else the
   process MPICH reports as terminated badly ("PID p RUNNING AT host": the lowest rank its clean-up killed, so a
   last resort), mapped to its rank by the ranks' process records; else the first failure record. The rank's role,
   host, plan nodes and GPUs come from the launch's rank table (:func:`hetpipe_jax.mpi.rank_layout.map_ranks`).
2. **Restart at all?** Not after an error that a restart repeats (a bad config, missing data, a NaN update the PS
   refused, diverged replicas: :data:`FATAL_ERRORS`), and not beyond ``max_restarts``.
3. **Node gone or fault transient** (:func:`gone_nodes`): each of the rank's nodes is probed (``node_probe``, a
   shell command with ``{host}`` and ``{node}``; the default asks a remote host with ``ssh`` and takes the local host
   as alive); a node that does not answer is gone. A rank that fails again on the same nodes in the next attempt
   takes its nodes with it.
4. **Re-plan** (:func:`replan`): the planner with the plan's model, batch, method, policy, placement and cost model
   on the cluster less the gone nodes, with as many VWs as still fit (fewer when needed); the new plan and its
   hostfile are written under ``<workdir>/recovery/``. Each node keeps its host.
5. **Resume**: the next attempt runs with ``--resume`` when the work directory holds a checkpoint (a resume onto a
   new plan re-shards the data over the VWs: :func:`hetpipe_jax.jobs.resume.load_resume_point`); without one the
   failed attempt's outputs move to ``<workdir>/recovery/attempt<k>/`` and the job starts over.

Every failure is one line of ``<workdir>/restarts.jsonl`` (:class:`Restart`: cause, rank, role, host, GPUs, when it
started and failed, the nodes found gone, the new plan, the checkpoint it resumes from).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

from hetpipe_jax import profiles
from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.costs import cost_model
from hetpipe_jax.jobs import job_config
from hetpipe_jax.mpi import rank_guard
from hetpipe_jax.mpi import rank_layout
from hetpipe_jax.mpi import rank_records
from hetpipe_jax.planning import allocator
from hetpipe_jax.planning import partitioner
from hetpipe_jax.planning import plan_format
from hetpipe_jax.planning import planner

# Errors a restart would only repeat (train.py's handled errors): the job stops.
FATAL_ERRORS = ("ConfigError", "DataError", "FileExistsError", "BadUpdateError", "ReplicasDivergedError")
DEFAULT_NODE_PROBE = "ssh -o BatchMode=yes -o ConnectTimeout=10 {host} true"
LOCAL_HOSTS = ("localhost", "127.0.0.1", socket.gethostname())
# MPICH (hydra) names a badly terminated process by PID and host, then its exit code (a signal's number when killed).
_BAD_TERMINATION = re.compile(r"PID (\d+) RUNNING AT (\S+)\s*\n=\s*EXIT CODE: (\d+)")


@dataclasses.dataclass(frozen=True)
class Failure:
  """Why an attempt failed, and where.

  Attributes:
    cause: ``"hang"`` (the PS's watchdog), ``"killed"`` (a rank ended by a signal), ``"error"`` (a rank's own
      error, recorded), ``"exit"`` (a rank exited non-zero) or ``"unknown"`` (no rank could be named).
    rank: the failed MPI rank, or None.
    role: its role in the rank table (``"VW 0"``, ``"ps shard 0 (lead)"``, ``"VW 1 stage 2"``), or None.
    host: its host, or None.
    nodes: the plan nodes it stands for.
    devices: its node-local GPU indices.
    exit_code: mpiexec's exit status.
    message: the error's message, or MPICH's words.
    error: the recorded error's type name ("" when none was recorded).
  """

  cause: str
  rank: int | None
  role: str | None
  host: str | None
  nodes: tuple[str, ...]
  devices: tuple[int, ...]
  exit_code: int
  message: str
  error: str = ""

  @property
  def restartable(self) -> bool:
    """False for an error a restart would repeat (:data:`FATAL_ERRORS`)."""
    return self.error not in FATAL_ERRORS


def diagnose(output: str, workdir: str | os.PathLike, since: float, slots: Sequence[rank_layout.RankSlot],
             exit_code: int) -> Failure:
  """Names the rank that made an attempt fail (module docstring, step 1).

  Args:
    output: what the attempt printed (stdout and stderr; MPICH's report of a badly terminated process is read).
    workdir: the run's directory (process and failure records).
    since: when the attempt started (Unix seconds): older records are not this attempt's.
    slots: the launch's rank table.
    exit_code: mpiexec's exit status.
  """
  failures = rank_records.read_failures(workdir, since)
  procs = rank_records.read_procs(workdir, since)
  rank, cause, message, error = None, "unknown", "", ""
  hangs = [f for f in failures if f.get("suspect_rank") is not None]
  exits = [e for e in rank_guard.read_exits(workdir, since) if e["exit_code"] != 0 and e["rank"] is not None]
  recorded = {int(f["rank"]): f for f in failures}
  if exits and hangs and exits[0]["time"] < hangs[0]["time"]:
    hangs = []  # a rank ended before the watchdog blamed one: the silence it saw was that rank's end
  if hangs:
    rank, cause, message, error = int(hangs[0]["suspect_rank"]), "hang", hangs[0]["message"], hangs[0]["error"]
  elif exits:  # the guards' records: the rank that ended first failed first
    first = exits[0]
    rank = int(first["rank"])
    cause = "killed" if first["signal"] else "exit"
    message = (f"PID {first['pid']} on {first['host']}: " + (f"killed by signal {first['signal']}" if first["signal"]
                                                             else f"exit code {first['exit_code']}"))
    if rank in recorded:
      cause, message, error = "error", recorded[rank]["message"], recorded[rank]["error"]
  else:
    by_pid = {int(p["pid"]): r for r, p in procs.items()}
    match = _BAD_TERMINATION.search(output)
    if match and int(match.group(1)) in by_pid:
      rank = by_pid[int(match.group(1))]
      code = int(match.group(3))
      killed = re.search(rf"signal {code}\b", output) is not None
      cause = "killed" if killed else "exit"
      message = f"PID {match.group(1)} on {match.group(2)}: " + (f"killed by signal {code}" if killed else
                                                                 f"exit code {code}")
    elif failures:
      rank = int(failures[0]["rank"])
    if rank is not None and rank in recorded:
      cause, message, error = "error", recorded[rank]["message"], recorded[rank]["error"]
  slot = next((s for s in slots if s.rank == rank), None)
  return Failure(cause=cause, rank=rank, role=slot.role if slot else None, host=slot.host if slot else None,
                 nodes=tuple(slot.nodes) if slot else (), devices=tuple(slot.devices) if slot else (),
                 exit_code=exit_code, message=message, error=error)


def probe_node(node: str, host: str, probe: str = DEFAULT_NODE_PROBE, timeout_s: float = 30.0) -> bool:
  """Whether ``node`` (on ``host``) answers: ``probe`` (a shell command; ``{host}`` and ``{node}`` are replaced) exits
  0 within ``timeout_s``. With the default probe a local host is alive without asking."""
  if probe == DEFAULT_NODE_PROBE and host in LOCAL_HOSTS:
    return True
  command = probe.format(host=shlex.quote(host), node=shlex.quote(node))
  try:
    return subprocess.run(command, shell=True, capture_output=True, timeout=timeout_s, check=False).returncode == 0
  except subprocess.TimeoutExpired:
    return False


def gone_nodes(failure: Failure, previous: Failure | None, alive: Callable[[str], bool]) -> tuple[str, ...]:
  """The nodes to plan without after ``failure`` (module docstring, step 3): those of the failed rank that do not
  answer (``alive(node)`` False); when all answer, all of them if the previous attempt failed on the same nodes
  (a rank that fails again); else none (a transient fault)."""
  if not failure.nodes:
    return ()
  dead = tuple(n for n in failure.nodes if not alive(n))
  if dead:
    return dead
  if previous is not None and previous.nodes == failure.nodes:
    return failure.nodes
  return ()


def replan(plan: plan_format.Plan, without: Sequence[str], cluster: cluster_lib.ClusterSpec) -> plan_format.Plan:
  """The plan's job on ``cluster`` less the nodes ``without`` (module docstring, step 4): the same model, batch size,
  method, policy, PS placement and cost model, Nm the planner's choice, and the plan's VW count or, when that no
  longer fits, the most that does.

  Raises:
    ValueError: a node not in the cluster, no node left, or no plan for any VW count.
  """
  remaining = cluster_lib.without_nodes(cluster, without)
  profile = profiles.get_profile(plan.model, plan.batch_size, remaining, None)
  fields = {f.name for f in dataclasses.fields(cost_model.CostModelConfig)}
  cost = cost_model.CostModelConfig(**{k: v for k, v in plan.cost_model.items() if k in fields})
  placement = plan.ps_placement.get("policy", "default") if plan.ps_placement else "default"
  errors = []
  for num_vws in range(len(plan.virtual_workers), 0, -1):
    config = planner.PlannerConfig(policy=plan.policy, num_vws=num_vws, method=plan.method,
                                   ps_placement=placement if placement in ("default", "local") else "default",
                                   cost=cost)
    try:
      return planner.make_plan(remaining, profile, config)
    except (allocator.AllocationError, partitioner.InfeasiblePartitionError, ValueError) as e:
      errors.append(f"{num_vws} VWs: {e}")
  raise ValueError(f"no plan for {plan.model} on {remaining.name}: " + "; ".join(errors))


@dataclasses.dataclass
class Restart:
  """One failed attempt, as ``restarts.jsonl`` records it (times in Unix seconds)."""

  attempt: int
  started_at: float
  failed_at: float
  failure: Failure
  gone_nodes: tuple[str, ...] = ()
  new_plan: str | None = None
  resume_from: int | None = None  # the checkpoint's global clock the next attempt resumes from; None: starts over
  restarted_at: float | None = None  # None: no restart (restarts spent or a fatal error)
  decision: str = ""

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d.update(d.pop("failure"))
    return d


CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def compilation_cache_env(setting: str, workdir: str, env: dict[str, str]) -> dict[str, str]:
  """The attempts' environment with JAX's persistent compilation cache (``launch --compilation_cache``): ``"auto"``
  keeps a ``JAX_COMPILATION_CACHE_DIR`` the user set, else ``<workdir>/jax_cache``; ``""`` removes it; any other
  value is the directory. Every compilation is cached (the minimum compile time and entry size set to 0 unless the user set
  them): a CPU stage program compiles in well under JAX's default 1 s threshold, and a restart compiles them all."""
  out = dict(env)
  if setting == "":
    out.pop(CACHE_ENV, None)
    return out
  if setting != "auto":
    out[CACHE_ENV] = str(pathlib.Path(setting).resolve())
  elif not out.get(CACHE_ENV):
    out[CACHE_ENV] = str((pathlib.Path(workdir) / "jax_cache").resolve())
  out.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  out.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  return out


def newest_checkpoint(workdir: str | os.PathLike) -> int | None:
  """The global clock of the newest checkpoint directory in ``<workdir>/checkpoints`` (None: none)."""
  ckpts = pathlib.Path(workdir) / "checkpoints"
  steps = [int(p.name) for p in ckpts.iterdir() if p.name.isdigit()] if ckpts.is_dir() else []
  return max(steps) if steps else None


_KEEP = ("procs", "failures", "exits", "recovery", "restarts.jsonl", "checkpoints", "ranks.hosts", "ranks.devices",
         "jax_cache")


def set_aside_outputs(workdir: str | os.PathLike, attempt: int) -> pathlib.Path:
  """Moves a failed attempt's outputs (all but the launcher's and recovery's own files) to
  ``<workdir>/recovery/attempt<k>/`` before the job starts over; returns that directory."""
  root = pathlib.Path(workdir)
  dest = root / "recovery" / f"attempt{attempt}"
  dest.mkdir(parents=True, exist_ok=True)
  for path in root.iterdir():
    if path.name not in _KEEP:
      shutil.move(str(path), str(dest / path.name))
  return dest


def run_attempt(argv: Sequence[str], env: dict[str, str], echo=sys.stdout) -> tuple[int, str]:
  """Runs one attempt, echoing its output as it comes; returns ``(exit status, the last 2,000 lines)``."""
  tail: collections.deque[str] = collections.deque(maxlen=2000)
  with subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        bufsize=1) as proc:
    for line in proc.stdout:
      echo.write(line)
      echo.flush()
      tail.append(line)
  return proc.returncode, "".join(tail)


def recovery_hostfile(nodes: Sequence[str], node_host: dict[str, str], host_slots: dict[str, int]) -> str:
  """The hostfile of a new plan whose nodes (in the plan's order) keep their hosts: one line per distinct host,
  ``host:slots`` with the slots the original hostfile gave it (:func:`hetpipe_jax.mpi.rank_layout.hostfile_slots`).

  Raises:
    KeyError: a node's host that the original hostfile did not name.
  """
  hosts = list(dict.fromkeys(node_host[n] for n in nodes))
  return "".join(f"{h}:{host_slots[h]}\n" for h in hosts)


@dataclasses.dataclass
class Supervisor:
  """Runs a launched job, restarting it after failures (module docstring).

  Args:
    build: ``(plan path, hostfile path or "", resume) -> (rank table, machinefile text, argv)``, the launcher's
      command for one attempt (:func:`hetpipe_jax.launch.build_command`).
    plan_path: the plan of the first attempt.
    hostfile: its hostfile ("" = every node on localhost).
    workdir: the run's directory.
    max_restarts: restarts allowed after the first attempt (K of ``launch --max_restarts``).
    cluster: the plan's cluster (re-planning removes gone nodes from it).
    node_probe: the probe command (:func:`probe_node`).
    resume: the first attempt resumes (the user passed ``--resume``).
    env: the attempts' environment.
    log: where the supervisor's own lines go.
  """

  build: Callable[[str, str, bool], tuple[Sequence[rank_layout.RankSlot], str, list[str]]]
  plan_path: str
  hostfile: str
  workdir: str
  max_restarts: int
  cluster: cluster_lib.ClusterSpec
  node_probe: str = DEFAULT_NODE_PROBE
  resume: bool = False
  env: dict[str, str] | None = None
  log: Callable[[str], None] = print
  restarts: list[Restart] = dataclasses.field(default_factory=list)

  def _record(self, restart: Restart) -> None:
    self.restarts.append(restart)
    with open(pathlib.Path(self.workdir) / "restarts.jsonl", "a", encoding="utf-8") as f:
      f.write(json.dumps(restart.to_json(), sort_keys=True) + "\n")

  def run(self) -> int:
    """Runs attempts until one succeeds, a failure is fatal or the restarts are spent; returns the last exit status.

    Raises:
      OSError: the hostfile cannot be read.
      hetpipe_jax.mpi.rank_layout.LaunchError: a plan's ranks do not fit the hosts (from ``build``).
    """
    root = pathlib.Path(self.workdir)
    root.mkdir(parents=True, exist_ok=True)
    host_slots = rank_layout.hostfile_slots(pathlib.Path(self.hostfile).read_text()) if self.hostfile else {}
    plan_path, hostfile, resume = self.plan_path, self.hostfile, self.resume
    node_host: dict[str, str] = {}
    for attempt in range(self.max_restarts + 1):
      slots, _, argv = self.build(plan_path, hostfile, resume)
      for s in slots:
        for n in s.nodes:
          node_host.setdefault(n, s.host)
      started = time.time()
      code, output = run_attempt(argv, self.env or dict(os.environ))
      if code == 0:
        if attempt:
          self.log(f"[recovery] attempt {attempt} finished after {attempt} restart(s)")
        return 0
      failure = diagnose(output, root, started, slots, code)
      restart = Restart(attempt, started, time.time(), failure)
      where = (f"rank {failure.rank} ({failure.role}) on host {failure.host}, nodes {', '.join(failure.nodes)}, "
               f"GPUs {', '.join(map(str, failure.devices)) or '-'}" if failure.rank is not None else "no rank named")
      self.log(f"[recovery] attempt {attempt} failed (exit {code}): {failure.cause}, {where}: {failure.message}")
      if not failure.restartable:
        restart.decision = f"stop: {failure.error} would repeat on a restart"
      elif attempt == self.max_restarts:
        restart.decision = f"stop: the {self.max_restarts} restart(s) of --max_restarts are spent"
      if restart.decision:
        self._record(restart)
        self.log(f"[recovery] {restart.decision}")
        return code
      previous = self.restarts[-1].failure if self.restarts else None
      restart.gone_nodes = gone_nodes(failure, previous,
                                      lambda n: probe_node(n, node_host.get(n, "localhost"), self.node_probe))
      new = None
      if restart.gone_nodes:
        try:
          new = replan(plan_format.load_plan(plan_path), restart.gone_nodes, self.cluster)
        except ValueError as e:  # nothing left to plan on: the same plan again (the nodes may come back)
          restart.decision = f"no plan without {', '.join(restart.gone_nodes)} ({e}): the same plan again; "
          self.log(f"[recovery] {restart.decision}")
      if new is not None:
        self.cluster = cluster_lib.without_nodes(self.cluster, restart.gone_nodes)
        plan_path = str(root / "recovery" / f"plan_attempt{attempt + 1}.json")
        pathlib.Path(plan_path).parent.mkdir(parents=True, exist_ok=True)
        plan_format.write_plan(new, plan_path)
        nodes = job_config.plan_nodes(new)
        if self.hostfile:  # else every node stays on localhost, with no hostfile
          hostfile = str(root / "recovery" / f"hosts_attempt{attempt + 1}")
          pathlib.Path(hostfile).write_text(recovery_hostfile(nodes, node_host, host_slots))
        restart.new_plan = plan_path
        self.log(f"[recovery] node(s) {', '.join(restart.gone_nodes)} gone: re-planned onto {', '.join(nodes)} "
                 f"({len(new.virtual_workers)} VWs, Nm {new.num_inflight}) -> {plan_path}")
      restart.resume_from = newest_checkpoint(root)
      resume = restart.resume_from is not None
      if not resume:
        moved = set_aside_outputs(root, attempt)
        self.log(f"[recovery] no checkpoint yet: the job starts over (outputs of attempt {attempt} -> {moved})")
      restart.decision += "restart" + (f" from checkpoint {restart.resume_from}" if resume else " from the start")
      restart.restarted_at = time.time()
      self._record(restart)
      self.log(f"[recovery] {restart.decision} (attempt {attempt + 1} of at most {self.max_restarts + 1})")
    raise AssertionError("unreachable")
