"""Test helper (issue 23): ``hetpipe_jax.train`` with VW 1's all-reduced gradients perturbed, so its replica diverges
from VW 0's; the job must then end with a non-zero exit and an ``error:`` line (tests/test_global_clip.py).

  mpiexec -n 2 python -m mpi4py tests/diverging_replica.py --config=... --config.method=horovod ...
"""

import runpy

from hetpipe_jax.runtime import flush_step

_apply_reduced = flush_step.FlushUpdate.apply_reduced


def _diverging(self, step, summed):
  if self.vw.vw_id == 1:
    summed = summed.copy()
    summed[0] += 1.0  # one gradient element of this replica's step differs
  return _apply_reduced(self, step, summed)


flush_step.FlushUpdate.apply_reduced = _diverging
runpy.run_module("hetpipe_jax.train", run_name="__main__", alter_sys=True)
