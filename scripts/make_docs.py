r"""Makes the README's generated parts with the project's own entry points: the Gantt of two VWs and the compare table.

  .venv/bin/python scripts/make_docs.py                               # docs/figures/*.png and README's table
  .venv/bin/python scripts/make_docs.py --check --out_dir=/tmp/docs   # CI: figures to --out_dir, README untouched;
                                                                      # exit 1 when README's table is not the output

* Gantt (``gantt_two_vws.png``): ``python -m hetpipe_jax.plan`` on ``hetpipe_paper_2vw`` (two nodes of the paper's
  cluster; NP makes a TITAN V VW and a Quadro P4000 VW), then ``python -m hetpipe_jax.simulate --gantt``: the event
  engine's tasks, WSP waits and wave ends of both VWs (HetPipe Figure 1's style, ``sim/gantt``).
* Table: ``python -m hetpipe_jax.compare`` with :data:`COMPARE_ARGS`; its Markdown table, with the command that made
  it, replaces what stands between README's :data:`BEGIN` and :data:`END` markers.

Every step is a subprocess of this interpreter running the entry point a user runs, so the pictures and the table
are what the commands print today. Seconds on one core.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from absl import app
from absl import flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO_ROOT, "README.md")
FIGURES = os.path.join(REPO_ROOT, "docs", "figures")
BEGIN = "<!-- scripts/make_docs.py: compare table (do not edit by hand) -->"
END = "<!-- scripts/make_docs.py: end of compare table -->"

PLAN_ARGS = ("--cluster=hetpipe_paper_2vw", "--model=cnn", "--batch_size=64", "--policy=NP", "--num_vws=2")
SIMULATE_ARGS = ("--num_waves=20", "--staleness_bound=1", "--gantt_waves=6")
COMPARE_ARGS = ("--cluster=hetpipe_paper", "--model=vgg19_imagenet", "--batch_size=32", "--num_vws=4")

_CHECK = flags.DEFINE_bool("check", False, "Leave README.md as it is; exit 1 when its compare table differs from "
                           "what compare prints now.")
_OUT_DIR = flags.DEFINE_string("out_dir", FIGURES, "Where the figures go.")


def _run(module: str, args: tuple[str, ...] | list[str]) -> str:
  """Runs ``python -m module args`` from the repository root; returns stdout.

  Raises:
    RuntimeError: a non-zero exit (its stderr's tail in the message).
  """
  env = dict(os.environ, PYTHONPATH=REPO_ROOT)
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                        text=True, check=False)
  if proc.returncode:
    raise RuntimeError(f"python -m {module} {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
  return proc.stdout


def command(module: str, args: tuple[str, ...]) -> str:
  """The command line as README names it."""
  return " ".join([".venv/bin/python -m", module, *args])


def gantt_commands() -> tuple[str, str]:
  """The planner's and the simulator's command lines that :func:`gantt` runs, as README names them."""
  return (command("hetpipe_jax.plan", (*PLAN_ARGS, "--output=...")),
          command("hetpipe_jax.simulate", ("--plan=...", *SIMULATE_ARGS, "--gantt=...")))


def gantt(out_dir: str) -> str:
  """Plans ``hetpipe_paper_2vw`` and draws the engine's first waves of its two VWs; returns the PNG's path."""
  os.makedirs(out_dir, exist_ok=True)
  png = os.path.join(out_dir, "gantt_two_vws.png")
  with tempfile.TemporaryDirectory() as tmp:
    plan = os.path.join(tmp, "plan.json")
    _run("hetpipe_jax.plan", [*PLAN_ARGS, f"--output={plan}"])
    _run("hetpipe_jax.simulate", [f"--plan={plan}", *SIMULATE_ARGS, f"--gantt={png}"])
  return png


def compare_block() -> str:
  """README's compare block: the command, then compare's title and Markdown table as it prints them."""
  with tempfile.TemporaryDirectory() as tmp:
    out = _run("hetpipe_jax.compare", [*COMPARE_ARGS, f"--output={os.path.join(tmp, 'compare')}"])
  lines = out.splitlines()
  table = [l for l in lines if l.startswith("|")]
  title = lines[lines.index(table[0]) - 1]
  return "\n".join([BEGIN, f"`{command('hetpipe_jax.compare', COMPARE_ARGS)}` prints ({title}):", "", *table, END])


def readme_block(readme: str) -> str:
  """The compare block that README.md holds now.

  Raises:
    ValueError: the markers are missing or out of order.
  """
  start, end = readme.find(BEGIN), readme.find(END)
  if start < 0 or end < start:
    raise ValueError(f"README.md lacks the markers {BEGIN!r} ... {END!r}")
  return readme[start:end + len(END)]


def main(argv):
  del argv
  png = gantt(_OUT_DIR.value)
  print(f"wrote {png}")
  with open(README) as f:
    readme = f.read()
  flat = " ".join(readme.split())  # README wraps its lines
  for named in gantt_commands():
    if named not in flat:
      print(f"README.md does not name a command that draws its Gantt: {named!r}")
      sys.exit(1)
  old, new = readme_block(readme), compare_block()
  if _CHECK.value:
    if old != new:
      print(f"README.md's compare table is not what compare prints now; run scripts/make_docs.py.\nnow:\n{new}")
      sys.exit(1)
    print("README.md's compare table is current")
    return
  with open(README, "w") as f:
    f.write(readme.replace(old, new))
  print("README.md: compare table " + ("unchanged" if old == new else "rewritten"))


if __name__ == "__main__":
  app.run(main)
