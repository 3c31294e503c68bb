"""Converts path-anchored mutations (``Mutation(name, path, old_text, new_text, tests, what)``) to code anchors.

The old format named a file and an exact text that had to occur once in it, often with docstring or comment lines.
This reads the ``MUTATIONS`` tuple of a given mutation_check.py without importing it, applies each old-format entry
to the current code in memory, and writes the same bug as ``Mutation(name, where, old, new, tests, what)`` (see
``scripts/mutation_check.py``): the scope's qualified name and only the code lines that differ (comments, docstrings
and shared lines dropped), plus neighbouring code lines where the differing ones are not unique among the scopes of
that name. Each conversion is checked: applying it must give the same code lines as the old entry's text
replacement. Entries already anchored on code (their second argument is not a ``.py`` path) are kept verbatim;
``MANUAL`` holds hand conversions for entries the rules above cannot make. Prints what it converted, by hand or
not, and what it could not; replaces the ``MUTATIONS = (...)`` statement of ``--into`` (exit 1 if any failed).

Given several files (``--old=a.py,b.py``, e.g. each branch's mutation_check.py after a merge in which branches moved
different code), each entry takes the first of its versions that applies to the current code; entries only later
files have come after the first file's.

  .venv/bin/python scripts/convert_mutations.py --old=OLD_mutation_check.py[,...] [--into=scripts/mutation_table.py]
"""

from __future__ import annotations

import ast
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=wrong-import-position

from hetpipe_jax.paths import REPO_ROOT  # pylint: disable=wrong-import-position
from scripts import mutation_check as mc  # pylint: disable=wrong-import-position

_OLD = flags.DEFINE_list("old", ["scripts/mutation_table.py"], "mutation_check.py files with old-format (or new) "
                         "MUTATIONS: each entry takes the first of its versions that applies to the code (merges: "
                         "one file per branch).")
_OUT = flags.DEFINE_string("into", "scripts/mutation_table.py", "The new-format mutation_check.py whose MUTATIONS "
                           "statement is replaced ('-': print the statement).")
_ROOT = flags.DEFINE_string("root", str(REPO_ROOT), "The repository whose code the old entries apply to.")

WIDTH = 120
ARG_COLUMN = 13  # where Mutation(...)'s continued arguments start: "    Mutation(" is 13 characters

# Hand conversions: name -> (where, old, new), for entries the automatic rules cannot convert.
MANUAL: dict[str, tuple[str, str, str]] = {}


class ConversionError(ValueError):
  """An old-format entry that cannot be converted automatically."""


def read_entries(path: pathlib.Path) -> tuple[list, str, ast.Assign]:
  """The ``MUTATIONS`` entries of ``path``: (call node, evaluated arguments, old format?, comment lines before it).

  Returns:
    (entries, the file's text, the MUTATIONS statement).

  Raises:
    ValueError: the file has no ``MUTATIONS = (...)`` statement.
  """
  text = path.read_text()
  tree = ast.parse(text)
  names: dict = {}
  statement = None
  for node in tree.body:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
      if node.targets[0].id == "MUTATIONS":
        statement = node
        continue
      try:
        names[node.targets[0].id] = eval(compile(ast.Expression(node.value), str(path), "eval"), {}, dict(names))
      except Exception:  # pylint: disable=broad-except
        pass  # not a constant (flags, dataclasses): no mutation refers to it
  if statement is None:
    raise ValueError(f"{path} has no MUTATIONS = (...) statement")
  lines = text.split("\n")
  entries = []
  previous_end = statement.lineno  # the "MUTATIONS = (" line
  for call in statement.value.elts:
    comments = [line for line in lines[previous_end:call.lineno - 1] if line.strip().startswith("#")]
    previous_end = call.end_lineno
    args = [eval(compile(ast.Expression(a), str(path), "eval"), {}, dict(names)) for a in call.args]
    old_format = isinstance(args[1], str) and args[1].endswith(".py")
    entries.append((call, args, old_format, comments))
  return entries, text, statement


def _code_seq(source: mc.Source) -> list[tuple[int, int, str]]:
  """(line number, indentation, code) of every code line."""
  indent = mc._indent  # pylint: disable=protected-access
  return [(i + 1, indent(source.lines[i]), c) for i, c in enumerate(source.code) if c is not None]


def non_code_in_old(text: str, path: str, old: str) -> bool:
  """Whether ``old``'s span in ``text`` covers a docstring, comment or string-only statement."""
  source = mc.Source(path, text)
  off = text.index(old)
  first = text.count("\n", 0, off)
  last = text.count("\n", 0, off + len(old.rstrip("\n")))
  for i in range(first, last + 1):
    raw = source.lines[i].strip()
    line_start = sum(len(l) + 1 for l in source.lines[:i])
    covered = source.lines[i][max(0, off - line_start):off + len(old) - line_start].strip()
    if not covered:
      continue
    if source.code[i] is None and raw:
      return True  # a comment or docstring line
    if source.code[i] is not None and len(source.code[i]) < len(raw):  # a trailing comment: is it covered?
      comment_col = source.lines[i].index(source.code[i]) + len(source.code[i])
      if off + len(old) - line_start > comment_col + (len(source.lines[i][comment_col:]) -
                                                      len(source.lines[i][comment_col:].lstrip())):
        return True
  return False


def convert(name: str, path: str, old: str, new: str, index: mc.Index) -> tuple[str, str, str]:
  """(where, old, new) of one old-format entry, its code lines only.

  Raises:
    ConversionError: its text does not occur once, the mutated file does not parse, it changes no code line, or no
      scope holds its lines uniquely.
  """
  text = (index.root / path).read_text()
  if text.count(old) != 1:
    raise ConversionError(f"its old text occurs {text.count(old)} times in {path}")
  mutated = text.replace(old, new)
  orig = index.sources[path]
  try:
    after = mc.Source(path, mutated)
  except SyntaxError as e:
    raise ConversionError(f"the mutated {path} does not parse: {e}") from e
  a, b = _code_seq(orig), _code_seq(after)
  p = 0
  while p < min(len(a), len(b)) and a[p][1:] == b[p][1:]:
    p += 1
  s = 0
  while s < min(len(a), len(b)) - p and a[len(a) - 1 - s][1:] == b[len(b) - 1 - s][1:]:
    s += 1
  if p == len(a) and p == len(b):
    raise ConversionError("it changes no code line (only comments or docstrings)")
  lo, hi = p, len(a) - s  # a[lo:hi] becomes b[p:len(b) - s]
  if lo == hi:  # a pure insertion: anchor on the code line before it (after it at the top of the file)
    lo, hi = (lo - 1, hi) if lo > 0 else (lo, hi + 1)
  extra_before, extra_after = p - lo, hi - (len(a) - s)
  while True:
    lines = a[lo:hi]
    scopes = [sc for sc in orig.scopes if sc.first <= lines[0][0] and lines[-1][0] <= sc.last]
    scope = min(scopes, key=lambda sc: sc.last - sc.first)
    old_lines = [c for _, _, c in lines]
    found = [(sc, f) for sc in index.by_name[scope.qualname] for f in index.sources[sc.path].find(sc, old_lines)]
    if len(found) == 1:
      break
    # not unique: widen by one neighbouring code line inside the scope, before first, then after
    if lo > 0 and a[lo - 1][0] >= scope.first and extra_before <= extra_after:
      lo -= 1
      extra_before += 1
    elif hi < len(a) and a[hi][0] <= scope.last:
      hi += 1
      extra_after += 1
    elif lo > 0 and a[lo - 1][0] >= scope.first:
      lo -= 1
      extra_before += 1
    else:
      raise ConversionError(f"its lines occur {len(found)} times in scopes named {scope.qualname!r}")
  new_lines = b[p - extra_before:len(b) - s + extra_after]
  base = min(ind for _, ind, _ in lines + new_lines)
  old_text = "\n".join(" " * (ind - base) + c for _, ind, c in lines)
  new_text = "\n".join(" " * (ind - base) + c for _, ind, c in new_lines)
  return scope.qualname, old_text, new_text


def check(name: str, path: str, old: str, new: str, converted: tuple[str, str, str], index: mc.Index) -> None:
  """Raises ConversionError unless ``converted`` gives the code lines that the old entry gives."""
  text = (index.root / path).read_text()
  expected = _code_seq(mc.Source(path, text.replace(old, new)))
  m = mc.Mutation(name, *converted, (), "")
  scope, first, last = mc.locate(m, index)
  lines = list(index.sources[scope.path].lines)
  lines[first - 1:last] = mc.replacement(m, mc._indent(lines[first - 1]))  # pylint: disable=protected-access
  got = _code_seq(mc.Source(scope.path, "\n".join(lines)))
  if scope.path != path or [x[1:] for x in got] != [x[1:] for x in expected]:
    raise ConversionError(f"the converted mutation gives other code than the old one (in {scope.path})")


def _string(value: str, column: int) -> list[str]:
  """``value`` as Python string literals, one per line of ``value`` (split further to fit ``WIDTH``)."""
  if not value:
    return ['""']
  pieces = []
  lines = value.split("\n")
  for i, line in enumerate(lines):
    line += "\n" if i < len(lines) - 1 else ""
    while True:  # split a long line at a space, each piece within WIDTH (quotes and a comma included)
      lit = _literal(line)
      if column + len(lit) + 1 <= WIDTH:
        pieces.append(lit)
        break
      cut = max((j for j in range(1, len(line)) if line[j] == " " and column + len(_literal(line[:j])) + 1 <= WIDTH),
                default=None)
      if cut is None:
        pieces.append(lit)
        break
      pieces.append(_literal(line[:cut]))
      line = line[cut:]
  return pieces


def _literal(s: str) -> str:
  return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'


def render(name: str, where: str, old: str, new: str, call: ast.Call, text: str) -> str:
  """One ``Mutation(...)`` entry; its tests and what keep the source text they had."""
  pad = " " * ARG_COLUMN
  out = [f"    Mutation({_literal(name)}, {_literal(where)},"]
  for value in (old, new):
    pieces = _string(value, ARG_COLUMN)
    out += [pad + piece for piece in pieces[:-1]] + [pad + pieces[-1] + ","]
  tests = ast.get_source_segment(text, call.args[4], padded=True).lstrip()
  what = ast.get_source_segment(text, call.args[5], padded=True).lstrip()
  out.append(pad + tests + ",")
  out.append(pad + what + "),")
  return "\n".join(out)


def _one(args: list, old_format: bool, index: mc.Index) -> tuple[str, tuple[str, str, str] | None]:
  """How one version of an entry converts: ("kept" with None, or "auto"/"manual" with (where, old, new)).

  Raises:
    ValueError, OSError, KeyError: this version does not apply to the code.
  """
  name = args[0]
  if not old_format:
    mc.locate(mc.Mutation(*args), index)
    return "kept", None
  converted = MANUAL[name] if name in MANUAL else convert(name, args[1], args[2], args[3], index)
  check(name, args[1], args[2], args[3], converted, index)
  return ("manual" if name in MANUAL else "auto"), converted


def main(argv) -> None:
  del argv
  index = mc.Index(pathlib.Path(_ROOT.value))
  files = [read_entries(pathlib.Path(p)) for p in _OLD.value]
  versions: dict[str, list] = {}  # name -> every file's version of it, in --old's order
  order = []  # names: the first file's, then those only later files have
  for entries, text, _ in files:
    for call, args, old_format, comments in entries:
      if args[0] not in versions:
        versions[args[0]] = []
        order.append((args[0], comments))
      versions[args[0]].append((call, args, old_format, text))
  blocks, failed, with_prose = [], [], []
  counts = {"auto": [], "manual": [], "kept": []}
  for name, comments in order:
    errors = []
    for call, args, old_format, text in versions[name]:
      try:
        how, converted = _one(args, old_format, index)
      except (ValueError, OSError, KeyError) as e:
        errors.append(str(e))
        continue
      counts[how].append(name)
      if how == "kept":
        blocks.append("\n".join(comments + [" " * call.col_offset + ast.get_source_segment(text, call) + ","]))
      else:
        source_text = (index.root / args[1]).read_text()
        if non_code_in_old(source_text, args[1], args[2]):
          with_prose.append(name)
        blocks.append("\n".join(comments + [render(name, *converted, call, text)]))
      break
    else:
      failed.append(f"{name}: {' | '.join(errors)}")
      call, _, _, text = versions[name][0]
      blocks.append("\n".join(comments + [" " * call.col_offset + ast.get_source_segment(text, call) + ","]))
  _, text, statement = files[0]
  tail = [line for line in text.split("\n")[statement.value.elts[-1].end_lineno:statement.end_lineno - 1]
          if line.strip().startswith("#")]
  statement_text = "\n".join(["MUTATIONS = ("] + blocks + tail + [")"])
  print(f"converted automatically: {len(counts['auto'])}; by hand (MANUAL): {len(counts['manual'])}; already "
        f"anchored on code: {len(counts['kept'])}; failed: {len(failed)}; converted entries whose old text had "
        f"docstring or comment lines: {len(with_prose)}", file=sys.stderr)
  for line in failed:
    print(f"  cannot convert {line}", file=sys.stderr)
  if _OUT.value == "-":
    print(statement_text)
  else:
    out = pathlib.Path(_OUT.value)
    out_text = out.read_text()
    target = next(n for n in ast.parse(out_text).body if isinstance(n, ast.Assign) and len(n.targets) == 1
                  and isinstance(n.targets[0], ast.Name) and n.targets[0].id == "MUTATIONS")
    lines = out_text.split("\n")
    lines[target.lineno - 1:target.end_lineno] = statement_text.split("\n")
    out.write_text("\n".join(lines))
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
