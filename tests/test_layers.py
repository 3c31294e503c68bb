"""The package's import rules (STYLE.md): one downward stack of layers, pure layers free of the heavy packages, no
import circle, and imports inside functions only where they keep a heavy optional package off an import.

The stack and the pure layers are import-linter contracts (``.importlinter``, checked by the venv's ``lint-imports``);
the circles are counted here on the same graph (grimp's, imports inside functions included), module by module, so a
package ``__init__`` importing its own modules while they import it back is caught too. The tests walk the packages,
so a module added to ``rules/``, ``costs/``, ``planning/``, ``sim/`` or ``data/`` is covered without editing this
file; ``jobs.job_config`` (settings checked before any import of jax) and ``mpi``'s rank layout, device table and
wire format (read by the launcher and by ``train`` before jax starts) are the pure modules of runtime packages.
"""

from __future__ import annotations

import ast
import json
import pathlib
import pkgutil
import shutil
import subprocess
import sys

import hetpipe_jax
from hetpipe_jax.paths import REPO_ROOT

PURE_PACKAGES = ("rules", "costs", "planning", "sim", "data")
PURE_MODULES = ("hetpipe_jax.paths", "hetpipe_jax.jobs.job_config", "hetpipe_jax.host_timers", "hetpipe_jax.user_code",
                "hetpipe_jax.mpi",
                "hetpipe_jax.mpi.rank_devices", "hetpipe_jax.mpi.rank_layout", "hetpipe_jax.mpi.wire")
HEAVY = ["jax", "jaxlib", "flax", "optax", "mpi4py", "orbax"]
# Optional heavy packages: an import inside a function is allowed only where it keeps one of these off the import of
# the importing module (directly, or through a module of the package that loads it).
HEAVY_OPTIONAL = frozenset(HEAVY) | {"matplotlib", "tqdm"}
# Imports inside functions allowed for another reason: (importer, imported) -> why.
LAZY_BY_NEED = {("hetpipe_jax.runtime.profiler", "jax._src.ad_checkpoint"): "private jax API, with a fallback"}
LINT_IMPORTS = pathlib.Path(sys.executable).parent / "lint-imports"


def pure_modules() -> list[str]:
  names = list(PURE_MODULES)
  for pkg in PURE_PACKAGES:
    path = [str(REPO_ROOT / "hetpipe_jax" / pkg)]
    names.append(f"hetpipe_jax.{pkg}")
    names += [f"hetpipe_jax.{pkg}.{m.name}" for m in pkgutil.iter_modules(path)]
  return names


def test_every_package_is_listed_as_pure_or_runtime():
  packages = {m.name for m in pkgutil.iter_modules(hetpipe_jax.__path__) if m.ispkg}
  assert packages == set(PURE_PACKAGES) | {"models", "runtime", "ps", "jobs", "mpi"}


def test_pure_packages_load_no_runtime_packages():
  modules = pure_modules()
  assert len(modules) > 25 and "hetpipe_jax.sim.engine" in modules and "hetpipe_jax.data.sharding" in modules
  code = (f"import importlib, json, sys\n"
          f"for m in {modules!r}: importlib.import_module(m)\n"
          f"print(json.dumps(sorted({{n.split('.')[0] for n in sys.modules}} & set({HEAVY!r}))))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
  assert out.returncode == 0, out.stderr
  assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# ---- the import-linter contracts and the circles


def lint_imports(root: pathlib.Path) -> subprocess.CompletedProcess:
  """``lint-imports`` on the package and ``.importlinter`` under ``root`` (no cache written)."""
  return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300)


# Run in a fresh interpreter with the package's root first on sys.path: the strongly connected components (more
# than one module) of grimp's module graph, as JSON.
_CYCLES = """
import json, sys
sys.path.insert(0, sys.argv[1])
import grimp
graph = grimp.build_graph("hetpipe_jax", cache_dir=None)
index, low, stack, on_stack, found = {}, {}, [], set(), []
for root in sorted(graph.modules):
  if root in index:
    continue
  work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
  index[root] = low[root] = len(index); stack.append(root); on_stack.add(root)
  while work:
    v, children = work[-1]
    w = next(children, None)
    if w is not None:
      if w not in index:
        index[w] = low[w] = len(index); stack.append(w); on_stack.add(w)
        work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
      elif w in on_stack:
        low[v] = min(low[v], index[w])
      continue
    work.pop()
    if work:
      low[work[-1][0]] = min(low[work[-1][0]], low[v])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop(); on_stack.discard(w); comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        found.append(sorted(comp))
print(json.dumps(sorted(found)))
"""


def import_cycles(root: pathlib.Path) -> list[list[str]]:
  """Every set of modules of the package under ``root`` that import each other in a circle."""
  out = subprocess.run([sys.executable, "-c", _CYCLES, str(root)], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout)


def test_import_contracts_hold():
  out = lint_imports(REPO_ROOT)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "3 kept, 0 broken" in out.stdout, out.stdout


def test_no_import_cycle_between_modules():
  assert import_cycles(REPO_ROOT) == []


def test_an_upward_import_or_a_circle_fails_the_checks(tmp_path):
  """The checks can fail: an upward import (costs -> planning) breaks the stack and the acyclic contract, a pure
  module importing a model breaks the pure contract, and a model importing its package back is a circle."""
  shutil.copytree(REPO_ROOT / "hetpipe_jax", tmp_path / "hetpipe_jax", ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(REPO_ROOT / ".importlinter", tmp_path / ".importlinter")
  cost_model = tmp_path / "hetpipe_jax" / "costs" / "cost_model.py"
  cost_model.write_text(cost_model.read_text() + "\nfrom hetpipe_jax.planning import plan_format  # noqa\n")
  engine = tmp_path / "hetpipe_jax" / "sim" / "engine.py"
  engine.write_text(engine.read_text() + "\n\ndef _model():\n  from hetpipe_jax import models  # noqa\n")
  cnn = tmp_path / "hetpipe_jax" / "models" / "cnn.py"
  cnn.write_text(cnn.read_text() + "\nfrom hetpipe_jax import models  # noqa\n")
  out = lint_imports(tmp_path)
  assert out.returncode != 0 and "0 kept, 3 broken" in out.stdout, out.stdout
  assert "hetpipe_jax.costs.cost_model -> hetpipe_jax.planning.plan_format" in out.stdout
  assert "hetpipe_jax.sim.engine -> hetpipe_jax.models" in out.stdout
  cycles = import_cycles(tmp_path)
  assert any({"hetpipe_jax.models", "hetpipe_jax.models.cnn"} <= set(c) for c in cycles), cycles
  assert any({"hetpipe_jax.costs.cost_model", "hetpipe_jax.planning.plan_format"} <= set(c) for c in cycles), cycles


# ---- imports inside functions


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(REPO_ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom, modules: set[str]) -> list[str]:
  """The modules an import statement loads (``from pkg import mod`` loads ``pkg.mod`` when that is a module)."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names]
  assert node.level == 0, "the package uses absolute imports"
  return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]


def import_sites() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
  """``(module-level imports per module, [(importer, line, imported)] of every import inside a function)``."""
  files = {_module_name(p): p for p in (REPO_ROOT / "hetpipe_jax").rglob("*.py")}
  top: dict[str, set[str]] = {}
  inner: list[tuple[str, int, str]] = []
  for name, path in sorted(files.items()):
    top[name] = set()

    def visit(node, in_function, name=name):
      for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
          for t in _targets(child, set(files)):
            if in_function:
              inner.append((name, child.lineno, t))
            else:
              top[name].add(t)
        visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
  return top, inner


def heavy_loaded(top: dict[str, set[str]]) -> dict[str, set[str]]:
  """Per module of the package, the optional heavy packages its import loads (module-level imports, transitively;
  importing ``a.b`` runs ``a/__init__`` first)."""
  def direct(m: str) -> set[str]:
    parents = {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)}
    return (top.get(m, set()) | parents) - {m}

  out = {m: {t.split(".")[0] for t in direct(m)} & HEAVY_OPTIONAL for m in top}
  changed = True
  while changed:
    changed = False
    for m in top:
      more = set().union(*(out.get(t, set()) for t in direct(m))) - out[m]
      if more:
        out[m] |= more
        changed = True
  return out


def test_imports_inside_functions_only_keep_heavy_packages_optional():
  """An import inside a function must keep an optional heavy package (jax, flax, optax, orbax, mpi4py, matplotlib,
  tqdm) off the import of its module; every other import is at module level, where the contracts see it first."""
  top, inner = import_sites()
  heavy = heavy_loaded(top)
  bad = []
  for importer, line, imported in inner:
    spared = ({imported.split(".")[0]} & HEAVY_OPTIONAL) | heavy.get(imported, set())
    if not spared - heavy[importer] and (importer, imported) not in LAZY_BY_NEED:
      bad.append(f"{importer}:{line} imports {imported} inside a function (it spares no heavy package)")
  assert not bad, "\n".join(bad)
  assert len(inner) <= 30, f"{len(inner)} imports inside functions (30 allowed: add one only with its reason)"
  assert heavy["hetpipe_jax.sim.gantt"] == {"matplotlib"} and "jax" in heavy["hetpipe_jax.jobs.mpi_job"]
