"""Finding a model's profile for the planner's entry points (``plan``, ``compare``): a saved one, else the profiler.

No flags here, so every entry point can share it; jax is imported only when a profile has to be made.
"""

from __future__ import annotations

import os

from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.costs import profile_format


def get_profile(model: str, batch_size: int, cluster: cluster_lib.ClusterSpec,
                path: str | None) -> profile_format.ModelProfile:
  """A saved profile when one fits (no jax import), else runs the profiler (measuring when the cluster maps a
  GPU type onto this host's device kind)."""
  if path:
    prof = profile_format.load_profile(path)
    if prof.model != model or prof.batch_size != batch_size:
      raise ValueError(f"profile {path} is for model {prof.model!r} at batch {prof.batch_size}, not {model!r} at "
                       f"batch {batch_size}")
    return prof
  measured_kinds = {t.measured_device_kind for t in cluster.gpu_types.values() if t.measured_device_kind}
  for kind in sorted(measured_kinds) or ["cpu"]:
    for measured in (True, False) if not measured_kinds else (True,):
      p = profile_format.default_profile_path(model, batch_size, kind, measured)
      if os.path.isfile(p):
        return profile_format.load_profile(p)
  from hetpipe_jax.runtime import profiler  # pylint: disable=g-import-not-at-top  # jax only when profiling is needed
  return profiler.load_or_profile(model, batch_size, measure=bool(measured_kinds))
