"""Launcher: maps a plan's ranks (PS shards, VWs, stage ranks) onto hosts and runs (or prints) the mpiexec command.

  python -m hetpipe_jax.launch --plan=plan.json --hostfile=hosts [--dry_run] [--config=...] [--workdir=...] \
      [--stage_ranks [--stage_rank_grouping=node]] [--oversubscribe] [-- --config.num_minibatches=100 ...]

Prints the mapping table (rank, role, plan nodes, host, devices), writes ``<workdir>/ranks.hosts`` (an MPICH
machinefile: one ``host:1`` line per rank, in rank order) and runs

  mpiexec -f <workdir>/ranks.hosts -n <S+N> python -m mpi4py -m hetpipe_jax.train --config=... --workdir=...
      --config.plan=plan.json --config.num_ps_shards=S [extra args]

(``--dry_run``: prints it and exits). Each rank sees only its plan GPUs: the command passes the per-rank table
``-genv HETPIPE_RANK_DEVICES '<ids>;<ids>;...'`` (a VW rank: its stages' node-local GPU indices; a shard: ``-``; also
written to ``<workdir>/ranks.devices``), and ``hetpipe_jax.train`` sets ``CUDA_VISIBLE_DEVICES`` from it before jax
starts (:mod:`hetpipe_jax.mpi.rank_devices`; on CPU nothing changes, config.json records the table). ``--stage_ranks`` adds ``--config.stage_ranks=True`` (and the grouping): a VW's
stages run on separate ranks, each on its own node's host, so ED and HD VWs, which span nodes, map onto a real
cluster (ranks ``S..S+N-1``: each VW's driver and first stage; then one rank per further stage, or per further node
of the VW with ``--stage_rank_grouping=node``). The plan's node i runs on the hostfile's host i (MPICH syntax,
``host`` or ``host:slots`` per line; ``host`` alone is 1 slot, a host on several lines has their sum); a hostfile with
one host, or none, maps every node to it (``localhost``): one machine runs a multi-node plan with CPU devices. A host
given more ranks than its slots is refused unless ``--oversubscribe`` (no hostfile: no limit). Slurm equivalent
(ranks placed by the same file, one host per line)::

  awk -F: '{print $1}' <workdir>/ranks.hosts > ranks.slurm
  SLURM_HOSTFILE=ranks.slurm HETPIPE_RANK_DEVICES='<the table>' srun -n <ranks> --distribution=arbitrary \
      --mpi=pmi2 python -m mpi4py -m hetpipe_jax.train ...   # the same arguments as the mpiexec command

Bad input (a missing plan or hostfile, too few hosts, a VW spread over several hosts without stage ranks, more ranks
on a host than its slots) is one ``error:`` line and exit status 2 before anything starts.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import subprocess
import sys
import time

from absl import app, flags

from hetpipe_jax import recovery
from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.jobs.job_config import plan_nodes
from hetpipe_jax.mpi import rank_devices
from hetpipe_jax.mpi import rank_layout
from hetpipe_jax.mpi.rank_layout import LaunchError
from hetpipe_jax.paths import REPO_ROOT, repo_path
from hetpipe_jax.planning import plan_format
from hetpipe_jax.rules import methods

_PLAN = flags.DEFINE_string("plan", None, "Plan JSON (python -m hetpipe_jax.plan).")
_HOSTFILE = flags.DEFINE_string("hostfile", "", "MPICH hostfile (host[:slots] per line); '' = every node on "
                                "localhost.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the mapping and the command; do not run it.")
_CONFIG = flags.DEFINE_string("config", "experiments/configs/default.py", "Job config file for hetpipe_jax.train.")
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory (default runs/launch-<time>).")
_NUM_PS_SHARDS = flags.DEFINE_integer("num_ps_shards", None, "PS shards (default: one per node of the plan).")
_STAGE_RANKS = flags.DEFINE_bool("stage_ranks", False, "A VW's stages on separate ranks (config.stage_ranks=True), "
                                  "each on its node's host.")
_GROUPING = flags.DEFINE_enum("stage_rank_grouping", "gpu", ["gpu", "node"], "With --stage_ranks: one rank per stage "
                              "(gpu) or per node of a VW (node).")
_OVERSUBSCRIBE = flags.DEFINE_bool("oversubscribe", False, "Allow more ranks on a host than its hostfile slots "
                                   "(default: refused, naming the host).")
_MPIEXEC = flags.DEFINE_string("mpiexec", "", "mpiexec to run ('' = the one next to this Python, else on PATH).")
_MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 0, "Restart a failed run up to this many times "
                                     "(hetpipe_jax.recovery: the failed rank named, a gone node planned away, resumed "
                                     "from the newest checkpoint); 0: no restart.")
_WATCHDOG_S = flags.DEFINE_float("watchdog_s", 300.0, "With --max_restarts and a PS method: the PS's progress "
                                 "watchdog (--config.ps_watchdog_s): a VW silent this long is hung.")
_NODE_PROBE = flags.DEFINE_string("node_probe", recovery.DEFAULT_NODE_PROBE, "With --max_restarts: a shell command "
                                  "that exits 0 when a node answers ({host} and {node} are replaced).")
_CLUSTER = flags.DEFINE_string("cluster", "", "With --max_restarts: the plan's cluster (name or JSON), for "
                               "re-planning without a gone node ('' = the plan's cluster name).")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", "auto", "With --max_restarts: JAX's persistent compilation cache for every attempt (a "
    "restart's ranks load their stage programs instead of compiling them again); 'auto' = $JAX_COMPILATION_CACHE_DIR "
    "when set, else <workdir>/jax_cache; '' = none.")
flags.mark_flags_as_required(["plan"])
# Flags that mean something only with another one: given without it, the launch is refused (never silently unused).
_ONLY_WITH = ((_GROUPING, _STAGE_RANKS, "--stage_ranks"), (_WATCHDOG_S, _MAX_RESTARTS, "--max_restarts=K"),
              (_NODE_PROBE, _MAX_RESTARTS, "--max_restarts=K"), (_CLUSTER, _MAX_RESTARTS, "--max_restarts=K"),
              (_COMPILATION_CACHE, _MAX_RESTARTS, "--max_restarts=K"))


def check_flag_pairs() -> None:
  """Refuses a flag of ``_ONLY_WITH`` given without the flag that makes it mean something.

  Raises:
    LaunchError: naming the flag and what it needs.
  """
  for flag, needed, name in _ONLY_WITH:
    if flags.FLAGS[flag.name].present and not needed.value:
      raise LaunchError(f"--{flag.name}={flag.value} is used only with {name}: add it, or leave --{flag.name} out")


def build_command(plan_path: str, hostfile: str, config: str, workdir: str, num_ps_shards: int | None,
                  extra: list[str], mpiexec: str = "", stage_rank_grouping: str | None = None,
                  oversubscribe: bool = False, guard: bool = False) -> tuple[str, str, list[str]]:
  """``(mapping table, machinefile text, mpiexec argv)`` for a plan and a hostfile (``stage_rank_grouping``: stage
  ranks, ``"gpu"`` or ``"node"``; None: one process per VW; ``oversubscribe``: a host may get more ranks than its
  hostfile slots; ``guard``: each rank runs under :mod:`hetpipe_jax.mpi.rank_guard`, which records how it ended).

  Raises:
    hetpipe_jax.mpi.rank_layout.LaunchError: unreadable plan or hostfile, or a mapping that cannot run (too few
      hosts, a VW across hosts without stage ranks, more ranks on a host than its slots).
  """
  slots, shards = rank_slots(plan_path, hostfile, num_ps_shards, stage_rank_grouping, oversubscribe)
  if not mpiexec:
    local = pathlib.Path(sys.executable).parent / "mpiexec"
    mpiexec = str(local) if local.exists() else "mpiexec"
  argv = [mpiexec, "-f", str(pathlib.Path(workdir) / "ranks.hosts"), "-genv", rank_devices.ENV,
          device_table(slots), "-n", str(len(slots))]
  if guard:
    argv += [sys.executable, "-m", "hetpipe_jax.mpi.rank_guard", f"--workdir={workdir}", "--"]
  argv += [sys.executable, "-m", "mpi4py", "-m", "hetpipe_jax.train", f"--config={config}", f"--workdir={workdir}",
          f"--config.plan={plan_path}"]
  if shards:  # the PS methods (an all-reduce plan has no parameter server; the job checks config.method against it)
    argv.append(f"--config.num_ps_shards={shards}")
  if stage_rank_grouping is not None:
    argv += ["--config.stage_ranks=True", f"--config.stage_rank_grouping={stage_rank_grouping}"]
  argv += extra
  return rank_layout.format_table(slots), rank_layout.machinefile(slots), argv


def rank_slots(plan_path: str, hostfile: str, num_ps_shards: int | None, stage_rank_grouping: str | None = None,
               oversubscribe: bool = False) -> tuple[list[rank_layout.RankSlot], int]:
  """The rank table of a plan on a hostfile (:func:`hetpipe_jax.mpi.rank_layout.map_ranks`) and the PS shard count
  (``num_ps_shards``, or None: one per plan node for the PS methods, 0 for the all-reduce methods).

  Raises:
    hetpipe_jax.mpi.rank_layout.LaunchError: as :func:`build_command`.
  """
  try:
    plan = plan_format.load_plan(str(repo_path(plan_path)))
  except (OSError, ValueError) as e:
    raise rank_layout.LaunchError(f"--plan={plan_path}: {e}") from None
  host_slots: dict[str, int] = {}
  if hostfile:
    try:
      host_slots = rank_layout.hostfile_slots(pathlib.Path(hostfile).read_text())
    except OSError as e:
      raise rank_layout.LaunchError(f"--hostfile={hostfile}: {e}") from None
  nodes = plan_nodes(plan)
  if num_ps_shards is None:
    num_ps_shards = len(nodes) if methods.get_method(plan.method).uses_ps else 0
  slots = rank_layout.map_ranks(plan, nodes, num_ps_shards, list(host_slots), stage_rank_grouping)
  rank_layout.check_slots(slots, host_slots, oversubscribe)
  return slots, num_ps_shards


def device_table(slots) -> str:
  """Per rank, the plan GPUs it may see (:mod:`hetpipe_jax.mpi.rank_devices`: a VW rank its stages' node-local GPU
  indices, a shard none), as ``HETPIPE_RANK_DEVICES``'s text (the plan's device indices, checked when it was
  read: :func:`hetpipe_jax.planning.plan_format.validate_plan`)."""
  return rank_devices.format_table([tuple(dict.fromkeys(slot.devices)) for slot in slots])


def main(argv) -> None:
  extra = [a for a in argv[1:] if a != "--"]
  workdir = _WORKDIR.value or f"runs/launch-{time.strftime('%Y%m%d-%H%M%S')}"
  try:
    check_flag_pairs()
    table, hostlines, command = build_command(_PLAN.value, _HOSTFILE.value, _CONFIG.value, workdir,
                                              _NUM_PS_SHARDS.value, extra, _MPIEXEC.value,
                                              _GROUPING.value if _STAGE_RANKS.value else None,
                                              _OVERSUBSCRIBE.value)
  except LaunchError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  print(table)
  print(f"machinefile {workdir}/ranks.hosts:\n" + "".join(f"  {line}\n" for line in hostlines.splitlines()), end="")
  devices = command[command.index("-genv") + 2]
  device_lines = "".join(f"{r} {ids}\n" for r, ids in enumerate(devices.split(";")))
  print(f"visible GPUs per rank ({rank_devices.ENV}, also {workdir}/ranks.devices: rank, GPU ids or -):\n" +
        "".join(f"  {line}\n" for line in device_lines.splitlines()), end="")
  print("command: " + " ".join(shlex.quote(a) for a in command), flush=True)
  if _DRY_RUN.value:
    return
  _write_rank_files(workdir, hostlines, device_lines)
  env = dict(os.environ)
  env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO_ROOT)
  if not _MAX_RESTARTS.value:
    sys.exit(subprocess.run(command, env=env, check=False).returncode)
  sys.exit(_supervise(workdir, extra, env))


def _write_rank_files(workdir: str, hostlines: str, device_lines: str) -> None:
  pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
  (pathlib.Path(workdir) / "ranks.hosts").write_text(hostlines)
  (pathlib.Path(workdir) / "ranks.devices").write_text(device_lines)


def _supervise(workdir: str, extra: list[str], env: dict[str, str]) -> int:
  """``--max_restarts``: runs the job under :class:`hetpipe_jax.recovery.Supervisor`."""
  plan = plan_format.load_plan(str(repo_path(_PLAN.value)))
  try:
    cluster = cluster_lib.load_cluster(_CLUSTER.value or plan.cluster)
  except ValueError as e:
    print(f"error: --max_restarts re-plans on the plan's cluster: {e}; pass --cluster=<name or JSON>",
          file=sys.stderr, flush=True)
    return 2
  watchdog = ([f"--config.ps_watchdog_s={_WATCHDOG_S.value}"] if plan.method in methods.PS_METHODS else [])
  user_resume = "--resume" in extra
  base = [a for a in extra if a != "--resume"]
  grouping = _GROUPING.value if _STAGE_RANKS.value else None

  def build(plan_path: str, hostfile: str, resume: bool):
    table, hostlines, command = build_command(plan_path, hostfile, _CONFIG.value, workdir, _NUM_PS_SHARDS.value,
                                              watchdog + base + (["--resume"] if resume else []), _MPIEXEC.value,
                                              grouping, _OVERSUBSCRIBE.value, guard=True)
    devices = command[command.index("-genv") + 2]
    _write_rank_files(workdir, hostlines, "".join(f"{r} {ids}\n" for r, ids in enumerate(devices.split(";"))))
    return rank_slots(plan_path, hostfile, _NUM_PS_SHARDS.value, grouping, _OVERSUBSCRIBE.value)[0], hostlines, command

  env = recovery.compilation_cache_env(_COMPILATION_CACHE.value, workdir, env)
  print(f"[recovery] compilation cache: {env.get(recovery.CACHE_ENV) or 'none'} (--compilation_cache)", flush=True)
  supervisor = recovery.Supervisor(build, _PLAN.value, _HOSTFILE.value, workdir, _MAX_RESTARTS.value, cluster,
                                   node_probe=_NODE_PROBE.value, resume=user_resume, env=env,
                                   log=lambda line: print(line, flush=True))
  try:
    return supervisor.run()
  except (ValueError, LaunchError) as e:
    print(f"error: [recovery] {e}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
  app.run(main)
