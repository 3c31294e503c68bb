"""The runnable blocks of README.md and docs/usage.md, as written, at smoke sizes: the docs cannot drift from the code.

Every command of every ```bash block is read from the documents of :data:`DOCS` themselves, in that order (lines
joined at a trailing ``\\``, a heredoc with its body, a ``...`` line extending the block's previous command) and
must match exactly one entry of :data:`HOW`, which says how it is checked:

* ``run``: run as written in a scratch directory (``.venv``, ``experiments`` and ``scripts`` linked from the
  repository), with smoke-size flags appended (absl: a later flag wins) and outputs kept in the scratch directory;
* ``dry_run``: a launch onto hosts this machine cannot reach: run as written plus ``--dry_run`` (mapping, slots, the
  command);
* ``validate``: a run too long for the suite: the job's own checks before any work (the flags parsed by
  ``hetpipe_jax.train``'s flag definitions, the settings, PS shards and stage ranks, the world size against the
  command's ``mpiexec -n``, the model, the partitions and the PS layer placement), in a subprocess
  (:mod:`tests.readme_check`);
* ``skip``: run elsewhere, named.

A command no entry matches, or an entry no command matches, fails the test: a new or edited command must be
classified here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys

import pytest

from hetpipe_jax.paths import REPO_ROOT

DOCS = ("README.md", "docs/usage.md")  # one sequence, in this order (later commands read what earlier ones wrote)
TRAIN_SMOKE = ("--config.num_minibatches=4", "--config.progress=False", "--config.eval_every_epochs=0",
               "--config.check_counts=False")


@dataclasses.dataclass
class Command:
  """One README command: its words as bash reads them (continuations joined, comments dropped; a ``...`` fragment
  after its base command's), or a heredoc's text."""

  block: int
  argv: list[str]
  heredoc: str = ""

  @property
  def text(self) -> str:
    return self.heredoc or " ".join(self.argv)


def readme_commands(readme: str) -> list[Command]:
  """Every command of every ```bash block of ``readme`` (one document's text), in order."""
  blocks = re.findall(r"^```bash\n(.*?)^```", readme, flags=re.S | re.M)
  out: list[Command] = []
  for b, block in enumerate(blocks):
    lines = block.splitlines()
    i = 0
    base: Command | None = None
    while i < len(lines):
      line = lines[i]
      i += 1
      if not line.strip() or line.lstrip().startswith("#"):
        continue
      heredoc = re.search(r"<<'?(\w+)'?", line)
      if heredoc:  # the body up to its terminator, run by bash as one command
        end = lines.index(heredoc.group(1), i)
        out.append(Command(b, [], "\n".join([line.split("#", 1)[0].rstrip()] + lines[i:end + 1])))
        i = end + 1
        continue
      while line.rstrip().endswith("\\"):
        line = line.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
      argv = shlex.split(line, comments=True)
      if argv[0] == "...":
        assert base is not None, f"README block {b}: {line!r} extends no command"
        out.append(Command(b, base.argv + argv[1:]))
        continue
      base = Command(b, argv)
      out.append(base)
  return out


def doc_commands() -> list[Command]:
  """Every command of every document of :data:`DOCS`, in order."""
  return [c for doc in DOCS for c in readme_commands((REPO_ROOT / doc).read_text())]


@dataclasses.dataclass(frozen=True)
class How:
  """How the commands matching ``pattern`` (a regex searched in the command's text) are checked."""

  pattern: str
  action: str  # "run", "dry_run", "validate", "skip"
  extra: tuple[str, ...] = ()  # flags appended ({tmp} and {data} are filled in)
  why: str = ""


HOW = (
    How(r"^bash scripts/run_main\.sh$", "skip", why="tests/test_entry_points.py::test_run_main_script_smoke"),
    How(r"^bash scripts/run_tests\.sh$", "skip", why="the suite itself"),
    How(r"^WORKDIR=runs/mine bash scripts/run_main\.sh$", "skip",
        why="the script: tests/test_entry_points.py::test_run_main_script_smoke (WORKDIR too)"),
    How(r"^WORKDIR=runs/mine bash scripts/run_main\.sh --resume$", "skip",
        why="kill -9 then --resume under MPI: tests/test_resume_mpi.py (through hetpipe_jax.train)"),
    How(r"-n 3 .*configs/default\.py --workdir=runs/mine --config\.staleness_bound=2 --config\.num_epochs=1$",
        "validate", why="the default config's run: tests/test_entry_points.py::test_run_main_script_smoke"),
    How(r"configs/default\.py --workdir=runs/mine .* --config\.num_inflight=4$", "validate"),
    How(r"-n 3 .*configs/tiny\.py --workdir=runs/tiny$", "run", ("--config.data_dir={data}", *TRAIN_SMOKE)),
    How(r"-n 4 .*--workdir=runs/no_plan --config\.plan= ", "validate"),
    How(r"hetpipe_jax\.plan .*--output=plan\.json$", "run"),
    # The variants write elsewhere, so plan.json stays the plan the launcher and the simulator read below.
    How(r"hetpipe_jax\.plan .*--output=plan\.json --inflight_memory=schedule$", "run",
        ("--output={tmp}/variant.json",)),
    How(r"hetpipe_jax\.plan .*--output=plan\.json --policy=auto --max_vw_gpus=6$", "run",
        ("--output={tmp}/variant.json",)),
    How(r"^cat > hosts <<", "run"),
    How(r"launch --plan=plan\.json --hostfile=hosts --stage_ranks --dry_run$", "run"),
    How(r"launch --plan=plan\.json --hostfile=hosts --stage_ranks --workdir=runs/four_nodes", "dry_run"),
    How(r"launch --plan=experiments/plans/local_cpu_2node_mlp_tiny_ed_local\.json --config=.*runs/ed_local", "dry_run",
        why="its run: tests/test_launch.py::test_launch_runs_an_ed_plan_with_local_placement_and_no_cross_node_"
            "ps_bytes"),
    How(r"launch --plan=.*local_cpu_2node_mlp_tiny_ed_local\.json --hostfile=hosts --stage_ranks", "dry_run"),
    How(r"launch --plan=.*local_cpu_4node_mlp_tiny_ed\.json .*--workdir=runs/recovering .*--max_restarts=3", "dry_run",
        why="its restarts: tests/test_recovery.py::test_recovery_drills_smoke"),
    How(r"experiments/recovery_drill\.py --output_dir=runs/recovery_drill$", "skip",
        why="its --smoke mode: tests/test_recovery.py::test_recovery_drills_smoke"),
    How(r"-n 7 .*--workdir=runs/stage_ranks --config\.num_stages=3 --config\.stage_ranks=True", "validate",
        why="2 VWs x 3 stage ranks run in tests/test_stage_ranks_mpi.py"),
    How(r"hetpipe_jax\.simulate --plan=plan\.json --num_waves=100", "run"),
    How(r"--mode=virtual --config=experiments/configs/paper_virtual\.py", "validate",
        why="its run: tests/test_entry_points.py::test_train_virtual_mode_cli_smoke"),
    How(r"-n 3 .*configs/tiny\.py --workdir=runs/emulated --config\.emulate_stage_ms=20,80$", "validate",
        why="emulated devices under MPI run in tests/test_mpi_job.py"),
    How(r"hetpipe_jax\.compare .*--model=vgg19_imagenet .*--output=/tmp/compare$", "run", ("--output={tmp}/compare",)),
    How(r"hetpipe_jax\.compare .*--model=gpt2_medium", "run"),
    How(r"experiments/paper/reproduction\.py --run_all$", "run",
        ("--norun_all", "--quick", "--results_dir={tmp}/results", "--output={tmp}/REPRODUCTION.md")),
    How(r"experiments/paper/table4\.py$", "run", ("--quick", "--results_dir={tmp}/results")),
    How(r"experiments/paper/calibration_hetpipe\.py$", "skip",
        why="its --quick mode: tests/test_calibration_hetpipe.py::test_calibration_hetpipe_quick_writes_its_results_and_names_every_cell"),
    How(r"experiments/fsdp_validate\.py --num_devices=4", "skip",
        why="its --quick mode: tests/test_fsdp.py::test_fsdp_validate_quick_end_to_end"),
    How(r"experiments/paper/fsdp_compare\.py", "skip",
        why="its --quick mode: tests/test_fsdp.py::test_fsdp_compare_quick_rows_beside_hetpipe"),
    How(r"--config\.model=my_pkg\.my_module:make_spec", "skip",
        why="a module of the reader's own: tests/test_user_model_data.py runs tests/user_model_data.py's"),
    How(r"experiments/paper/convergence\.py$", "skip", why="tests/test_paper_convergence.py (--quick)"),
    How(r"^bash scripts/gpu_wheels\.sh$", "skip",
        why="downloads from PyPI: tests/test_gpu_check.py::test_gpu_wheels_makes_the_carry_over (a stand-in pip)"),
    How(r"^bash scripts/gpu_check\.sh$", "skip", why="needs a GPU; the same steps on CPU: tests/test_gpu_check.py"),
    How(r"^bash scripts/gpu_check\.sh --cpu --out=/tmp/gpu_check$", "skip",
        why="tests/test_gpu_check.py::test_cpu_rehearsal_runs_every_step"),
)


def _how(cmd: Command) -> How:
  hits = [h for h in HOW if re.search(h.pattern, cmd.text)]
  assert len(hits) == 1, f"command {cmd.text!r} of {DOCS} matches {len(hits)} entries of HOW: classify it once"
  return hits[0]


def _env():
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PYTHONPATH"] = str(REPO_ROOT)
  return env


def _world_and_train_args(argv: list[str]) -> tuple[int, list[str]]:
  """``(ranks, the train module's arguments)`` of an ``mpiexec -n N ... -m hetpipe_jax.train ...`` or a
  ``python -m hetpipe_jax.train`` command (1 rank)."""
  ranks = int(argv[argv.index("-n") + 1]) if "-n" in argv else 1
  return ranks, argv[argv.index("hetpipe_jax.train") + 1:]


def test_every_readme_command_is_classified_once():
  commands = doc_commands()
  assert len(commands) >= 20
  used = {_how(c).pattern for c in commands}
  unused = sorted({h.pattern for h in HOW} - used)
  assert not unused, f"entries of HOW no command of {DOCS} matches: {unused}"
  assert all(h.why for h in HOW if h.action == "skip")


def test_readme_commands_run_as_written(tmp_path, synthetic_data_dir):
  """Every command of :data:`DOCS`, in their order, in one scratch directory (later commands read what earlier ones
  wrote: plan.json, hosts), as :data:`HOW` says; each must exit 0 (validate: pass the job's checks)."""
  for name in (".venv", "experiments", "scripts"):
    (tmp_path / name).symlink_to(REPO_ROOT / name)
  fill = {"tmp": str(tmp_path), "data": str(synthetic_data_dir)}
  ran = []
  for cmd in doc_commands():
    how = _how(cmd)
    if how.action == "skip":
      continue
    extra = [a.format(**fill) for a in how.extra]
    if how.action == "validate":
      ranks, args = _world_and_train_args(cmd.argv)
      argv = [sys.executable, "-m", "tests.readme_check", f"--world_size={ranks}", *args]
    elif cmd.heredoc:
      argv = ["bash", "-c", cmd.heredoc]
    else:
      argv = cmd.argv + extra  # a train command's flags end it
      if how.action == "dry_run":  # the launcher's own flag, before the train arguments after "--"
        at = argv.index("--") if "--" in argv else len(argv)
        argv = argv[:at] + ["--dry_run"] + argv[at:]
    proc = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"command of {DOCS} failed ({how.action}): {cmd.text}\n{proc.stderr[-3000:]}"
    ran.append((how.action, cmd.text))
  assert {a for a, _ in ran} == {"run", "dry_run", "validate"}
  # The chain a newcomer follows: the plan made above, its hostfile, the launch's table (issue 23 defect 1).
  assert (tmp_path / "plan.json").exists() and (tmp_path / "hosts").read_text().count(":5\n") == 4
  assert (tmp_path / "runs/tiny/summary.json").exists() and (tmp_path / "trace.json").exists()
