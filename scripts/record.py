r"""Runs a measuring script and keeps its JSON output as a dated record under docs/measurements/.

  .venv/bin/python scripts/record.py --name=engine_speed -- scripts/bench_engine.py
  .venv/bin/python scripts/record.py --name=stage_ranks -- scripts/bench_runtime.py --stage_ranks

The arguments after ``--`` are run as ``python <arguments>`` from the repository root (any script that prints one
JSON document at the end of its output: ``scripts/bench_*.py``, ``scripts/engine_fingerprint.py``,
``experiments/validate_engine.py``, ``experiments/wsp_study.py``, ...). Its output passes through; the last JSON
document of its stdout becomes ``<out_dir>/<YYYY-MM-DD>_<name>.json`` (``_2``, ``_3``, ... when that day already has
one):

  {"name", "date" (UTC, ISO 8601), "command" (as run), "git" (``git describe --always --dirty``), "machine" (CPUs,
   load average before and after), "result" (the script's JSON)}

and a row naming the file, the command and the date is added to ``<out_dir>/README.md``'s table.
``--from_output=FILE`` records a run that already finished instead (its saved stdout; the arguments after ``--``
name its command, and ``machine`` then says the load was not seen). So a number in the
docs comes from a file the measuring run wrote, not from a copy by hand. A script that fails or prints no JSON
writes nothing (exit 1).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

from absl import app
from absl import flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_NAME = flags.DEFINE_string("name", None, "The record's name: [a-z0-9_]+, e.g. engine_speed.")
_OUT_DIR = flags.DEFINE_string("out_dir", os.path.join(REPO_ROOT, "docs", "measurements"), "Where records go.")
_TIMEOUT_S = flags.DEFINE_integer("timeout_s", 3600, "Wall-clock limit of the measuring run.")
_FROM_OUTPUT = flags.DEFINE_string("from_output", "", "Record a finished run from its saved stdout (the arguments "
                                   "after -- name its command) instead of running it.")
flags.mark_flags_as_required(["name"])


def last_json(text: str):
  """The last JSON document of ``text`` that starts a line and runs to the end (trailing whitespace allowed).

  Raises:
    ValueError: there is none.
  """
  decoder = json.JSONDecoder()
  starts = [i for i in range(len(text)) if text[i] in "{[" and (i == 0 or text[i - 1] == "\n")]
  for i in reversed(starts):
    try:
      value, end = decoder.raw_decode(text, i)
    except json.JSONDecodeError:
      continue
    if not text[end:].strip():
      return value
  raise ValueError("the script printed no JSON document at the end of its output")


def record_path(out_dir: str, name: str, date: str) -> str:
  """``<out_dir>/<date>_<name>.json``, or with ``_2``, ``_3``, ... when taken."""
  path, k = os.path.join(out_dir, f"{date}_{name}.json"), 1
  while os.path.exists(path):
    k += 1
    path = os.path.join(out_dir, f"{date}_{name}_{k}.json")
  return path


def add_to_index(out_dir: str, filename: str, name: str, command: str, date: str) -> None:
  """Appends the record's row to ``<out_dir>/README.md``'s table (the file's last lines)."""
  index = os.path.join(out_dir, "README.md")
  text = open(index).read() if os.path.exists(index) else (
      "# Measurements\n\n| file | what | command | dates |\n|---|---|---|---|\n")
  row = f"| [{filename}]({filename}) | {name} (JSON written by `scripts/record.py`) | `{command}` | {date} |\n"
  with open(index, "w") as f:
    f.write(text.rstrip("\n") + "\n" + row)


def main(argv):
  args = argv[1:]
  if not args:
    raise app.UsageError("give the script to run after --, e.g. -- scripts/bench_engine.py --quick")
  if not _NAME.value or not all(c.isalnum() or c == "_" for c in _NAME.value) or _NAME.value != _NAME.value.lower():
    raise app.UsageError(f"--name must be [a-z0-9_]+, got {_NAME.value!r}")
  command = " ".join([".venv/bin/python", *args])
  load_before = os.getloadavg()
  if _FROM_OUTPUT.value:
    with open(_FROM_OUTPUT.value, encoding="utf-8") as f:
      stdout = f.read()
  else:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    proc = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=_TIMEOUT_S.value, check=False)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode:
      print(f"error: {command} exited {proc.returncode}; nothing recorded", file=sys.stderr)
      sys.exit(1)
    stdout = proc.stdout
  try:
    result = last_json(stdout)
  except ValueError as e:
    print(f"error: {command}: {e}; nothing recorded", file=sys.stderr)
    sys.exit(1)
  now = datetime.datetime.now(datetime.timezone.utc)
  git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True, text=True,
                       check=False)
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  path = record_path(_OUT_DIR.value, _NAME.value, now.date().isoformat())
  with open(path, "w") as f:
    json.dump({"name": _NAME.value, "date": now.isoformat(timespec="seconds"), "command": command,
               "git": git.stdout.strip() if git.returncode == 0 else None,
               "machine": ({"cpus": os.cpu_count(), "load_average_before": [round(x, 2) for x in load_before],
                            "load_average_after": [round(x, 2) for x in os.getloadavg()]} if not _FROM_OUTPUT.value
                           else {"cpus": os.cpu_count(), "recorded_from": _FROM_OUTPUT.value,
                                 "load_average": "not seen (recorded after the run)"}),
               "result": result}, f, indent=1)
    f.write("\n")
  add_to_index(_OUT_DIR.value, os.path.basename(path), _NAME.value, command, now.date().isoformat())
  print(f"recorded {os.path.relpath(path, REPO_ROOT)}", file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
