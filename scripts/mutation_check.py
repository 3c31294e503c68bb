"""Mutation check: small semantic bugs, applied one at a time to a copy of the repository, must each fail a test.

Every mutation is anchored on code, never on a file path or on prose: it names a scope by its qualified name, a few
consecutive code lines inside that scope, their replacement, and the tests that should catch it. The scope is found
by parsing every ``.py`` file under ``SEARCHED``, so moving a module to another package never breaks a mutation;
editing a docstring or a comment never does either. Anchor syntax (``Mutation.where``):

- ``"required_global_clock"``: a module-level function or class; ``"VirtualWorker.install_pull"``: a method;
  ``"run.submit_ready"``: a function nested in ``run`` (Python's ``__qualname__`` without ``<locals>``).
- ``"METHODS"``, ``"Class.FIELD"``: a module- or class-level assignment (its whole statement), for tables and
  constants.
- ``"<module hetpipe_jax/rules/methods.py>"``: a whole module, only where nothing above fits.

``old`` is one or a few lines of code (comment- and docstring-free), compared line by line with the scope's code
lines after stripping each line's indentation and trailing comment; blank lines, comment lines and docstrings
between code lines are skipped. Exactly one scope with that name must contain the lines, exactly once: otherwise
the mutation is an error that names what was found (update the mutation to the code). Lines found only in a
docstring, a comment or a string-only statement are refused. ``new`` replaces the matched lines (and any comment
lines between them), indented like them: its lines keep their indentation relative to ``old``'s first line.

Each mutation runs in its own temporary copy of the repository (the package, tests, configs; the venv is shared),
with ``pytest -x`` on the named tests. A mutation is *caught* when a test fails; *survived* when all pass; *error*
when the mutation no longer applies or pytest could not run (exit codes 2-5); *timeout* counts as caught (a hang is
noticed) but is reported. Prints one JSON document; exits 1 unless every mutation is caught. CI runs it as its own
step (``.ci/run``); the default test suite only checks that every mutation applies.

  .venv/bin/python scripts/mutation_check.py [--only=name,name] [--jobs=2] [--list] [--test_timeout_s=240]
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=wrong-import-position

from hetpipe_jax.paths import REPO_ROOT  # pylint: disable=wrong-import-position
from scripts.mutation_table import MUTATIONS, Mutation  # noqa: F401  pylint: disable=wrong-import-position

_ONLY = flags.DEFINE_list("only", [], "Run only these mutations (default: all).")
_JOBS = flags.DEFINE_integer("jobs", 2, "Mutations run in parallel.")
_LIST = flags.DEFINE_bool("list", False, "Print the mutations (and whether each still applies) and exit.")
_TIMEOUT_S = flags.DEFINE_integer("test_timeout_s", 240, "Wall-clock limit of one mutation's test run.")
_BASELINE = flags.DEFINE_bool("baseline", True, "First run every named test on an unmutated copy: a test that fails "
                              "without a mutation would make every mutation look caught (CI skips it: the suite itself "
                              "is the baseline there).")

COPIED = ("hetpipe_jax", "tests", "experiments", "scripts", "docs", "pytest.ini", "README.md")
SEARCHED = ("hetpipe_jax", "scripts", "experiments")  # where anchors' scopes are looked up


@dataclasses.dataclass(frozen=True)
class Scope:
  """A function, class, assignment or module that an anchor can name.

  Attributes:
    path: the file, relative to the root searched.
    qualname: its anchor name.
    first: its first line (1-based, decorators included).
    last: its last line (inclusive).
  """

  path: str
  qualname: str
  first: int
  last: int


class Source:
  """One parsed file: its lines, each line's code text and its scopes.

  Attributes:
    path: the file, relative to the root searched.
    lines: the physical lines (without their newline).
    code: per line (0-based) the code with indentation and trailing comment stripped, or None for a blank line, a
      comment line, or a line of a docstring or other string-only statement.
    scopes: every function, class, module- or class-level assignment, and the module itself.
  """

  def __init__(self, path: str, text: str):
    tree = ast.parse(text, filename=path)
    self.path = path
    self.lines = text.split("\n")
    code: list[str | None] = [line.strip() for line in self.lines]
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
      if tok.type == tokenize.COMMENT:
        row, col = tok.start
        code[row - 1] = self.lines[row - 1][:col].strip()
    for node in ast.walk(tree):
      if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
          and isinstance(node.value.value, str)):
        for i in range(node.lineno - 1, node.end_lineno):
          code[i] = None
    self.code = [c or None for c in code]
    self.scopes = [Scope(path, f"<module {path}>", 1, len(self.lines))]
    self._walk(tree, "", in_function=False)

  def _walk(self, node: ast.AST, prefix: str, in_function: bool) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        first = min([child.lineno] + [d.lineno for d in child.decorator_list])
        self.scopes.append(Scope(self.path, prefix + child.name, first, child.end_lineno))
        self._walk(child, prefix + child.name + ".", in_function or not isinstance(child, ast.ClassDef))
        continue
      if isinstance(child, (ast.Assign, ast.AnnAssign)) and not in_function:
        targets = child.targets if isinstance(child, ast.Assign) else [child.target]
        for t in targets:
          for name in ([t] if isinstance(t, ast.Name) else getattr(t, "elts", [])):
            if isinstance(name, ast.Name):
              self.scopes.append(Scope(self.path, prefix + name.id, child.lineno, child.end_lineno))
      self._walk(child, prefix, in_function)

  def find(self, scope: Scope, lines: list[str], code_only: bool = True) -> list[tuple[int, int]]:
    """Where ``lines`` (stripped) occur as consecutive code lines of ``scope``: (first, last) line numbers, 1-based.

    With ``code_only=False`` every non-blank line counts, docstrings and comments included (to explain a refusal).
    """
    if code_only:
      seq = [(i + 1, self.code[i]) for i in range(scope.first - 1, scope.last) if self.code[i] is not None]
    else:
      seq = [(i + 1, self.lines[i].strip()) for i in range(scope.first - 1, scope.last) if self.lines[i].strip()]
    k = len(lines)
    return [(seq[i][0], seq[i + k - 1][0]) for i in range(len(seq) - k + 1)
            if all(seq[i + j][1] == lines[j] for j in range(k))]


class Index:
  """Every scope under ``root``'s searched folders, by qualified name (files parsed once)."""

  def __init__(self, root: pathlib.Path):
    self.root = pathlib.Path(root)
    self.sources: dict[str, Source] = {}
    self.by_name: dict[str, list[Scope]] = {}
    for folder in SEARCHED:
      for file in sorted((self.root / folder).rglob("*.py")):
        if "__pycache__" in file.parts:
          continue
        rel = file.relative_to(self.root).as_posix()
        source = Source(rel, file.read_text())
        self.sources[rel] = source
        for scope in source.scopes:
          self.by_name.setdefault(scope.qualname, []).append(scope)


def anchor_lines(mutation: Mutation) -> list[str]:
  """``mutation.old``'s lines, stripped.

  Raises:
    ValueError: ``old`` is empty or has a blank or comment line (an anchor is code).
  """
  lines = [line.strip() for line in mutation.old.strip("\n").split("\n")]
  bad = [line for line in lines if not line or line.startswith("#")]
  if bad:
    raise ValueError(f"mutation {mutation.name}: its old lines must all be code, not blank or comments: {bad}")
  return lines


def locate(mutation: Mutation, index: Index) -> tuple[Scope, int, int]:
  """The scope and the lines (first, last; 1-based) that ``mutation`` replaces.

  Raises:
    ValueError: no scope has that name; the lines occur in none of them, or only in docstrings, comments or
      string-only statements; or they occur more than once (in one scope or in several scopes of that name).
  """
  lines = anchor_lines(mutation)
  scopes = index.by_name.get(mutation.where, [])
  if not scopes:
    raise ValueError(f"mutation {mutation.name}: no function, class or assignment named {mutation.where!r} under "
                     f"{', '.join(SEARCHED)}: update the mutation to the code")
  found = [(s, a, b) for s in scopes for a, b in index.sources[s.path].find(s, lines)]
  named = ", ".join(f"{s.path}:{s.first}" for s in scopes)
  if len(found) == 1:
    return found[0]
  if found:
    places = ", ".join(f"{s.path}:{a}" for s, a, _ in found)
    raise ValueError(f"mutation {mutation.name}: its lines occur {len(found)} times in scopes named "
                     f"{mutation.where!r} ({places}): add a neighbouring code line to the anchor")
  prose = [(s, a) for s in scopes for a, _ in index.sources[s.path].find(s, lines, code_only=False)]
  if prose:
    places = ", ".join(f"{s.path}:{a}" for s, a in prose)
    raise ValueError(f"mutation {mutation.name}: its lines occur in {mutation.where!r} only in a docstring, a "
                     f"comment or a string-only statement ({places}): anchor on code lines, without comments")
  raise ValueError(f"mutation {mutation.name}: its lines occur in none of the {len(scopes)} scopes named "
                   f"{mutation.where!r} ({named}): update the mutation to the code")


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip(" "))


def replacement(mutation: Mutation, indent: int) -> list[str]:
  """``mutation.new``'s lines, re-indented for a match whose first line is indented by ``indent`` spaces.

  Raises:
    ValueError: a line of ``new`` would be indented left of column 0.
  """
  base = _indent(mutation.old.strip("\n").split("\n")[0])
  if not mutation.new.strip("\n"):
    return []
  out = []
  for line in mutation.new.strip("\n").split("\n"):
    column = indent + _indent(line) - base
    if column < 0:
      raise ValueError(f"mutation {mutation.name}: its new line {line.strip()!r} lies left of column 0")
    out.append(" " * column + line.strip() if line.strip() else "")
  return out


def apply(mutation: Mutation, root: pathlib.Path, index: Index | None = None) -> Scope:
  """Applies ``mutation`` under ``root``; returns the scope it changed.

  Raises:
    ValueError: the anchor does not name exactly one place in the code (see ``locate``).
  """
  index = index or Index(root)
  scope, first, last = locate(mutation, index)
  lines = list(index.sources[scope.path].lines)
  lines[first - 1:last] = replacement(mutation, _indent(lines[first - 1]))
  (pathlib.Path(root) / scope.path).write_text("\n".join(lines))
  return scope




def _copy_repo(dest: pathlib.Path) -> None:
  for name in COPIED:
    src = REPO_ROOT / name
    if src.is_dir():
      shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
      shutil.copy2(src, dest / name)
  (dest / ".venv").symlink_to(REPO_ROOT / ".venv")


def run_one(mutation: Mutation, timeout_s: int) -> dict:
  """Runs ``mutation``'s tests on a mutated copy (``mutation.old == mutation.new``: unmutated); returns its row."""
  t0 = time.perf_counter()
  row = {"name": mutation.name, "what": mutation.what, "where": mutation.where, "tests": list(mutation.tests)}
  with tempfile.TemporaryDirectory(prefix=f"mutation_{mutation.name}_") as tmp:
    root = pathlib.Path(tmp)
    _copy_repo(root)
    if mutation.old != mutation.new:
      try:
        row["file"] = apply(mutation, root).path
      except ValueError as e:
        return {**row, "status": "error", "detail": str(e), "seconds": time.perf_counter() - t0}
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(root)
    # One persistent compilation cache for every copy (tests/conftest.py's; keyed by the HLO, so a mutated function
    # compiles anew): most named tests compile the same small stage functions.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO_ROOT / ".jax_cache"))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutation.tests]
    try:
      proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
      return {**row, "status": "caught", "killed_by": f"timeout after {timeout_s} s",
              "seconds": time.perf_counter() - t0}
  seconds = time.perf_counter() - t0
  if proc.returncode == 0:
    return {**row, "status": "survived", "seconds": seconds}
  if proc.returncode == 1:
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, flags=re.MULTILINE)
    return {**row, "status": "caught", "killed_by": failed[0] if failed else "?", "seconds": seconds}
  return {**row, "status": "error", "detail": f"pytest exit {proc.returncode}: {proc.stdout[-1500:]}{proc.stderr[-500:]}",
          "seconds": seconds}


def select(only: list[str]) -> list[Mutation]:
  """The mutations named in ``only`` (all when empty).

  Raises:
    app.UsageError: an unknown name.
  """
  if not only:
    return list(MUTATIONS)
  known = {m.name: m for m in MUTATIONS}
  unknown = sorted(set(only) - set(known))
  if unknown:
    raise app.UsageError(f"unknown mutations {unknown}; known: {sorted(known)}")
  return [known[n] for n in only]


def main(argv) -> None:
  del argv
  mutations = select(_ONLY.value)
  if _LIST.value:
    index = Index(REPO_ROOT)
    rows = []
    for m in mutations:
      row = {"name": m.name, "where": m.where, "applies": True, "tests": list(m.tests), "what": m.what}
      try:
        scope, first, _ = locate(m, index)
        row["file"] = f"{scope.path}:{first}"
      except ValueError as e:
        row.update(applies=False, detail=str(e))
      rows.append(row)
    print(json.dumps(rows, indent=2))
    return
  t0 = time.perf_counter()
  if _BASELINE.value:
    tests = tuple(sorted({t for m in mutations for t in m.tests}))
    base = run_one(Mutation("baseline", "", "", "", tests, "no mutation"), 10 * _TIMEOUT_S.value)
    if base["status"] != "survived":
      print(json.dumps({"baseline": base}, indent=2))
      sys.exit(f"error: the named tests fail without any mutation ({base.get('killed_by', base.get('detail'))}); "
               "fix them first")
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, _JOBS.value)) as pool:
    rows = list(pool.map(lambda m: run_one(m, _TIMEOUT_S.value), mutations))
  caught = sum(r["status"] == "caught" for r in rows)
  report = {"num_mutations": len(rows), "num_caught": caught,
            "survived": [r["name"] for r in rows if r["status"] == "survived"],
            "errors": [r["name"] for r in rows if r["status"] == "error"],
            "total_wall_s": time.perf_counter() - t0, "rows": rows}
  for r in rows:
    print(f"{r['status']:>8}  {r['name']:<34} {r.get('killed_by', r.get('detail', ''))[:90]}  ({r['seconds']:.0f} s)",
          file=sys.stderr)
  print(json.dumps(report, indent=2))
  if caught != len(rows):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
