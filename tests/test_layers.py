"""The two-layer rule (STYLE.md): the pure packages never load jax, flax, optax, mpi4py or orbax, even transitively.

The test walks the packages, so a module added to ``rules/``, ``costs/``, ``planning/``, ``sim/`` or ``data/`` is covered
without editing this file; ``jobs.job_config`` (settings checked before any import of jax) is the one pure module
of a runtime package.
"""

import json
import pkgutil
import subprocess
import sys

import hetpipe_jax
from hetpipe_jax.paths import REPO_ROOT

PURE_PACKAGES = ("rules", "costs", "planning", "sim", "data")
PURE_MODULES = ("hetpipe_jax.paths", "hetpipe_jax.jobs.job_config", "hetpipe_jax.rank_devices")
HEAVY = ["jax", "jaxlib", "flax", "optax", "mpi4py", "orbax"]


def pure_modules() -> list[str]:
  names = list(PURE_MODULES)
  for pkg in PURE_PACKAGES:
    path = [str(REPO_ROOT / "hetpipe_jax" / pkg)]
    names.append(f"hetpipe_jax.{pkg}")
    names += [f"hetpipe_jax.{pkg}.{m.name}" for m in pkgutil.iter_modules(path)]
  return names


def test_every_package_is_listed_as_pure_or_runtime():
  packages = {m.name for m in pkgutil.iter_modules(hetpipe_jax.__path__) if m.ispkg}
  assert packages == set(PURE_PACKAGES) | {"models", "runtime", "ps", "jobs"}


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
