"""A README training command's checks before any work, without running it (tests/test_readme.py's ``validate``).

  python -m tests.readme_check --world_size=N <the command's hetpipe_jax.train arguments>

Parses the arguments with ``hetpipe_jax.train``'s own flags, then calls the checks an MPI job (``mpi_job.run``) or a
virtual-time job (``virtual_job.run``) makes before it loads data: the settings (and the plan), the PS shards and
stage ranks, the world size, the model, the partitions, the emulated or plan task times and the PS layer placement.
Exit 0 when they pass; one ``error:`` line and exit 2 otherwise.
"""

import sys

from absl import app, flags

from hetpipe_jax import train  # noqa: F401  (defines --config, --workdir, --plan, --mode, --resume)

_WORLD_SIZE = flags.DEFINE_integer("world_size", 1, "The command's MPI world size (mpiexec -n).")


def main(argv) -> None:
  del argv
  import jax
  from hetpipe_jax import models
  from hetpipe_jax.jobs import emulation, job_config, run_context
  from hetpipe_jax.runtime.param_layout import ParamLayout
  config = train._CONFIG.value  # pylint: disable=protected-access
  if train._PLAN.value is not None:  # pylint: disable=protected-access
    config.plan = train._PLAN.value  # pylint: disable=protected-access
  resume = train._RESUME.value  # pylint: disable=protected-access
  try:
    settings = job_config.resolve_job(config, train._MODE.value, resume)  # pylint: disable=protected-access
    if train._MODE.value == "virtual":  # pylint: disable=protected-access
      if _WORLD_SIZE.value != 1:
        raise job_config.ConfigError(f"--mode=virtual runs in one process (world size {_WORLD_SIZE.value})")
      run_context.prepare(settings, settings.world_size, check_local_devices=False)
      emulation.virtual_task_times(settings)
    else:
      spec, partitions = run_context.prepare(settings, _WORLD_SIZE.value, check_local_devices=False)
      emulation.emulated_task_times(settings)
      if settings.num_ps_ranks:  # the PS methods
        offsets = ParamLayout.from_layer_params(
            jax.eval_shape(lambda: models.init_layer_params(spec, jax.random.key(config.seed)))).layer_offsets
        job_config.ps_layer_shards(settings, partitions, [b > a for a, b in zip(offsets, offsets[1:])])
  except job_config.ConfigError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  print(f"ok: {settings.num_virtual_workers} VWs, world size {settings.world_size}")


if __name__ == "__main__":
  app.run(main)
