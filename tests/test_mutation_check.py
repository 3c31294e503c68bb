"""The mutation check runs in CI: every small semantic bug in scripts/mutation_check.py must fail a named test."""

import json
import subprocess
import sys

import pytest
from absl import app

from hetpipe_jax.paths import REPO_ROOT
from scripts import mutation_check as mc


def test_a_mutation_that_no_longer_applies_is_an_error(tmp_path):
  (tmp_path / "f.py").write_text("a = 1\na = 1\n")
  twice = mc.Mutation("m", "f.py", "a = 1", "a = 2", ("t",), "x")
  with pytest.raises(ValueError, match="occurs 2 times"):
    mc.apply(twice, tmp_path)
  missing = mc.Mutation("m", "f.py", "b = 1", "b = 2", ("t",), "x")
  with pytest.raises(ValueError, match="occurs 0 times"):
    mc.apply(missing, tmp_path)
  once = mc.Mutation("m", "f.py", "a = 1\na", "a = 3\na", ("t",), "x")
  mc.apply(once, tmp_path)
  assert (tmp_path / "f.py").read_text() == "a = 3\na = 1\n"
  with pytest.raises(app.UsageError, match="unknown mutations"):
    mc.select(["no_such_mutation"])


def test_every_mutation_applies_and_names_tests_that_exist():
  names = [m.name for m in mc.MUTATIONS]
  assert len(names) == len(set(names)) >= 15
  for m in mc.MUTATIONS:
    assert (REPO_ROOT / m.path).read_text().count(m.old) == 1, m.name
    assert m.old != m.new
    for t in m.tests:
      assert (REPO_ROOT / t.split("::")[0]).exists(), (m.name, t)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(1500)  # ~55 mutations, each running its tests (some under mpiexec): minutes, not seconds
def test_every_mutation_is_caught():
  proc = subprocess.run([sys.executable, "scripts/mutation_check.py", "--nobaseline", "--jobs=2"], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=1450)
  report = json.loads(proc.stdout)
  assert report["num_mutations"] == len(mc.MUTATIONS) >= 15
  assert report["survived"] == [] and report["errors"] == [], proc.stderr[-3000:]
  assert report["num_caught"] == report["num_mutations"]
  assert proc.returncode == 0
