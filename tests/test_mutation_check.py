"""The mutation check: every small semantic bug of the table (scripts/mutation_table.py) applies, anchored on code.

Whether every mutation is caught is CI's own step (``.ci/run``); here, marked ``mutation``, it is left out of the
default run (``pytest -m mutation`` runs it).
"""

import json
import shutil
import subprocess
import sys

import pytest
from absl import app

from hetpipe_jax.paths import REPO_ROOT
from scripts import convert_mutations as cm
from scripts import mutation_check as mc

_MODULE = '''"""A module."""

LIMIT = 3


def clock(c, d):
  """The clock.

  return max(0, c - d + 1)
  """
  # return max(0, c - d) is the rule
  return max(0, c - d)


class Worker:
  """A worker."""

  def pull(self, x):
    keep = x  # the pulled value
    if x:
      keep = x + 1
    return keep

  def push(self, x):
    keep = x
    return keep
'''


def _package(root, name="pkg/mod.py", text=_MODULE):
  (root / "hetpipe_jax" / name).parent.mkdir(parents=True, exist_ok=True)
  (root / "hetpipe_jax" / name).write_text(text)
  return root / "hetpipe_jax" / name


def test_a_mutation_applies_to_its_scope_and_keeps_the_indentation(tmp_path):
  path = _package(tmp_path)
  scope = mc.apply(mc.Mutation("m", "Worker.pull", "keep = x\nif x:", "keep = 0\nif not x:\n  x = 2", ("t",), "x"),
                   tmp_path)
  assert scope.path == "hetpipe_jax/pkg/mod.py" and scope.qualname == "Worker.pull"
  assert "    keep = 0\n    if not x:\n      x = 2\n      keep = x + 1\n" in path.read_text()
  assert "  def push(self, x):\n    keep = x\n" in path.read_text()
  mc.apply(mc.Mutation("m", "LIMIT", "LIMIT = 3", "LIMIT = 4", ("t",), "x"), tmp_path)
  mc.apply(mc.Mutation("m", "clock", "return max(0, c - d)", "return c", ("t",), "x"), tmp_path)  # not the comment
  assert "LIMIT = 4\n" in path.read_text() and "  return c\n" in path.read_text()
  assert "\n  return max(0, c - d + 1)\n" in path.read_text()  # the docstring is not the anchor


def test_a_mutation_that_no_longer_applies_is_an_error(tmp_path):
  _package(tmp_path)
  with pytest.raises(ValueError, match="no function, class or assignment named 'Worker.fetch'"):
    mc.apply(mc.Mutation("m", "Worker.fetch", "keep = x", "keep = 0", ("t",), "x"), tmp_path)
  with pytest.raises(ValueError, match="occur in none of the 1 scopes named 'Worker.push'"):
    mc.apply(mc.Mutation("m", "Worker.push", "keep = x + 1", "keep = 0", ("t",), "x"), tmp_path)
  with pytest.raises(ValueError, match="occur 2 times in scopes named 'Worker'"):
    mc.apply(mc.Mutation("m", "Worker", "keep = x", "keep = 0", ("t",), "x"), tmp_path)
  _package(tmp_path, "other/mod2.py", "class Worker:\n  def push(self, x):\n    keep = x\n    return keep\n")
  with pytest.raises(ValueError, match=r"occur 2 times in scopes named 'Worker.push' \(hetpipe_jax/other/mod2.py"):
    mc.apply(mc.Mutation("m", "Worker.push", "keep = x\nreturn keep", "return 0", ("t",), "x"), tmp_path)
  with pytest.raises(app.UsageError, match="unknown mutations"):
    mc.select(["no_such_mutation"])


def test_an_anchor_in_a_docstring_or_comment_is_refused(tmp_path):
  _package(tmp_path)
  with pytest.raises(ValueError, match="only in a docstring, a comment or a string-only statement"):
    mc.apply(mc.Mutation("m", "clock", "return max(0, c - d + 1)", "return 0", ("t",), "x"), tmp_path)
  with pytest.raises(ValueError, match="only in a docstring, a comment or a string-only statement"):
    mc.apply(mc.Mutation("m", "Worker.pull", "keep = x  # the pulled value", "keep = 0", ("t",), "x"), tmp_path)
  with pytest.raises(ValueError, match="must all be code"):
    mc.apply(mc.Mutation("m", "clock", "# return max(0, c - d) is the rule", "", ("t",), "x"), tmp_path)
  # blank and comment lines between two anchored code lines are skipped, and replaced with them
  path = _package(tmp_path, "pkg/mod.py", "def f(a):\n  a = 1\n  # note\n\n  return a\n")
  mc.apply(mc.Mutation("m", "f", "a = 1\nreturn a", "return 2", ("t",), "x"), tmp_path)
  assert path.read_text() == "def f(a):\n  return 2\n"


def test_a_moved_module_does_not_break_a_mutation(tmp_path):
  """A real mutation applies the same to a copy of the package in which its module moved to another package."""
  m = next(m for m in mc.MUTATIONS if m.name == "wsp_caps_D_at_1")
  expected = tmp_path / "before"
  shutil.copytree(REPO_ROOT / "hetpipe_jax", expected / "hetpipe_jax", ignore=shutil.ignore_patterns("__pycache__"))
  moved = tmp_path / "after"
  shutil.copytree(expected, moved)
  where = mc.apply(m, expected).path
  (moved / "hetpipe_jax" / "elsewhere").mkdir()
  (moved / where).rename(moved / "hetpipe_jax" / "elsewhere" / "renamed.py")
  assert mc.apply(m, moved).path == "hetpipe_jax/elsewhere/renamed.py"
  assert (moved / "hetpipe_jax/elsewhere/renamed.py").read_text() == (expected / where).read_text()


def test_the_converter_keeps_only_code_lines(tmp_path):
  """An old-format entry (path + exact text, docstrings and comments included) becomes its scope and code lines."""
  path = "hetpipe_jax/pkg/mod.py"
  _package(tmp_path, "pkg/mod.py", _MODULE + "\n\ndef g():\n  a = 1\n  a = 1\n  return a\n")
  index = mc.Index(tmp_path)
  cases = [  # (old, new, expected (where, old, new))
      ('def clock(c, d):\n  """The clock.\n', 'def clock(c, d):\n  """The clock.\n', None),
      ("    keep = x  # the pulled value\n    if x:\n      keep = x + 1\n",
       "    keep = x  # the pulled value\n    if x:\n      keep = x + 2  # wrong\n", ("Worker.pull", "keep = x + 1",
                                                                                 "keep = x + 2")),
      ('  # return max(0, c - d) is the rule\n  return max(0, c - d)', '  return 0', ("clock", "return max(0, c - d)",
                                                                                   "return 0")),
      ("    if x:\n      keep = x + 1\n", "    if x:\n      pass\n    keep = x + 1\n",
       ("Worker.pull", "  keep = x + 1", "  pass\nkeep = x + 1")),
      ("  a = 1\n  return a", "  a = 2\n  return a", ("g", "a = 1\na = 1", "a = 1\na = 2")),  # needs a neighbour
      ("    keep = x  # the pulled value", "    keep = x  # the value", None),  # changes no code
  ]
  for old, new, expected in cases:
    if expected is None:
      with pytest.raises(cm.ConversionError):
        cm.convert("m", path, old, new, index)
      continue
    converted = cm.convert("m", path, old, new, index)
    assert converted == expected, (old, converted)
    cm.check("m", path, old, new, converted, index)  # the same code as the old entry's text replacement


def test_every_mutation_applies_and_names_tests_that_exist():
  names = [m.name for m in mc.MUTATIONS]
  assert len(names) == len(set(names)) >= 15
  index = mc.Index(REPO_ROOT)
  for m in mc.MUTATIONS:
    assert not m.where.endswith(".py"), m.name  # anchored on a scope, not on a file
    scope, first, last = mc.locate(m, index)  # raises unless exactly one place, in code
    source = index.sources[scope.path]
    assert all(source.code[i - 1] is not None for i in (first, last)), m.name
    assert m.old != m.new
    for t in m.tests:
      assert (REPO_ROOT / t.split("::")[0]).exists(), (m.name, t)


@pytest.mark.mutation
@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(1500)  # ~170 mutations, each running its tests (some under mpiexec): minutes, not seconds
def test_every_mutation_is_caught():
  proc = subprocess.run([sys.executable, "scripts/mutation_check.py", "--nobaseline", "--jobs=2"], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=1450)
  report = json.loads(proc.stdout)
  assert report["num_mutations"] == len(mc.MUTATIONS) >= 15
  assert report["survived"] == [] and report["errors"] == [], proc.stderr[-3000:]
  assert report["num_caught"] == report["num_mutations"]
  assert proc.returncode == 0
