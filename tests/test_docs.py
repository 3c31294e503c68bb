"""The docs stay short, true and made by the project: sizes, links, generated parts, measurement records.

Measurements are records under docs/measurements/: Markdown moved from the old notes (each with its ``Command:`` line
and date) and JSON that ``scripts/record.py`` writes from a measuring script's own output.

README.md's Gantt and compare table are made by ``scripts/make_docs.py`` (the project's own entry points); the
check mode redraws the figure into a scratch directory and fails when README's table is not what ``compare``
prints now. The commands of README.md and docs/usage.md are run by tests/test_readme.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from hetpipe_jax.paths import REPO_ROOT

DOC_FILES = ("README.md", "WORKSPACE.md", "REPRODUCTION.md", *sorted(
    str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "docs").rglob("*.md")))
LIMITS = {"README.md": 120, "docs/design.md": 300}


def test_readme_and_design_stay_within_their_sizes():
  for name, limit in LIMITS.items():
    lines = (REPO_ROOT / name).read_text().count("\n")
    assert lines <= limit, f"{name} has {lines} lines, more than {limit}: move detail to docs/"


def test_every_relative_link_of_the_docs_resolves():
  bad = []
  for name in DOC_FILES:
    text = (REPO_ROOT / name).read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      if not (REPO_ROOT / name).parent.joinpath(target.split("#")[0]).exists():
        bad.append(f"{name}: {target}")
  assert not bad, f"links to nothing: {bad}"


def test_every_measurement_names_its_command_and_date():
  records = sorted((REPO_ROOT / "docs" / "measurements").glob("*.md"))  # JSON records: the test below
  assert len(records) >= 5
  index = (REPO_ROOT / "docs" / "measurements" / "README.md").read_text()
  for path in records:
    if path.name == "README.md":
      continue
    text = path.read_text()
    assert re.search(r"^Command: ", text, flags=re.M), f"{path.name} names no command (a line 'Command: ...')"
    assert re.search(r"\b20\d\d-\d\d-\d\d\b", text), f"{path.name} has no date"
    assert f"({path.name})" in index, f"docs/measurements/README.md does not list {path.name}"


def test_every_json_record_holds_its_command_date_and_result():
  for path in sorted((REPO_ROOT / "docs" / "measurements").glob("*.json")):
    record = json.loads(path.read_text())
    assert {"name", "date", "command", "git", "result"} <= set(record), path.name
    assert path.name.startswith(record["date"][:10]), path.name


def test_record_keeps_a_scripts_json_output_as_a_dated_indexed_record(tmp_path):
  script = tmp_path / "measure.py"
  script.write_text("import json\nprint('warming up')\nprint(json.dumps({'rate': 2.5}, indent=1))\n")
  out = tmp_path / "records"
  argv = [sys.executable, "scripts/record.py", "--name=toy", f"--out_dir={out}", "--", str(script)]
  for _ in range(2):
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warming up" in proc.stdout  # the script's output passes through
  first, second = sorted(out.glob("*_toy*.json"))
  record = json.loads(first.read_text())
  assert record["result"] == {"rate": 2.5} and record["command"].endswith(f"python {script}")
  assert first.name == f"{record['date'][:10]}_toy.json" and second.name == f"{record['date'][:10]}_toy_2.json"
  index = (out / "README.md").read_text()
  assert f"[{first.name}]({first.name})" in index and f"[{second.name}]({second.name})" in index
  script.write_text("print('no json here')\n")
  proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 1 and len(list(out.glob("*.json"))) == 2
  # A run that already finished, from its saved stdout: the script is not run again.
  saved = tmp_path / "stdout.txt"
  saved.write_text("log line\n" + json.dumps({"rate": 3.5}) + "\n")
  proc = subprocess.run([sys.executable, "scripts/record.py", "--name=toy", f"--out_dir={out}",
                         f"--from_output={saved}", "--", str(script), "--flag"], cwd=REPO_ROOT, capture_output=True,
                        text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  third = json.loads((out / f"{record['date'][:10]}_toy_3.json").read_text())
  assert third["result"] == {"rate": 3.5} and third["command"].endswith(f"python {script} --flag")
  assert third["machine"]["recorded_from"] == str(saved)


def test_make_docs_draws_the_gantt_and_readme_holds_the_compare_table(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "scripts/make_docs.py", "--check", f"--out_dir={tmp_path}"], cwd=REPO_ROOT,
                        env=env, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  png = tmp_path / "gantt_two_vws.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
  assert (REPO_ROOT / "docs" / "figures" / "gantt_two_vws.png").exists()
