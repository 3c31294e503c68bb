r"""Plans HetPipe training on a cluster: allocation, partitions, Nm, parameter placement (HetPipe §4, §7, §8.1).

  python -m hetpipe_jax.plan --cluster=hetpipe_paper --model=resnet152_imagenet --batch_size=32 \
      --policy=ED --num_vws=4 --output=plan.json

Prints a table and writes a versioned plan JSON that ``hetpipe_jax.train --plan=plan.json`` runs from.
"""

from __future__ import annotations

import sys

from absl import app
from absl import flags

from hetpipe_jax import profiles
from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.costs import cost_model
from hetpipe_jax.costs import profile_format
from hetpipe_jax.planning import allocator
from hetpipe_jax.planning import partitioner
from hetpipe_jax.planning import plan_format
from hetpipe_jax.planning import planner
from hetpipe_jax.rules import methods

_CLUSTER = flags.DEFINE_string("cluster", "local_cpu", "Cluster name (experiments/clusters/<name>.json) or path.")
_MODEL = flags.DEFINE_string("model", None, "Registered model name.")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Examples per minibatch.")
_POLICY = flags.DEFINE_enum("policy", "ED", list(allocator.POLICIES), "Resource allocation policy.")
_NUM_VWS = flags.DEFINE_integer("num_vws", 4, "Number of virtual workers.")
_PLACEMENT = flags.DEFINE_enum("ps_placement", "default", ["default", "local"], "Parameter placement.")
_METHOD = flags.DEFINE_enum("method", "hetpipe", ["hetpipe", "pipedream", "gpipe", "1f1b_flush", "horovod"],
                            "Training method (hetpipe_jax.rules.methods).")
_NUM_INFLIGHT = flags.DEFINE_integer("num_inflight", 0, "hetpipe (NP/ED/HD): Nm (0: the planner's choice); "
                                     "pipedream: Nm (0: NOAM); gpipe/1f1b_flush/horovod: micro-batches per step M "
                                     "(0: the planner's choice; horovod: 1).")
_REMAT = flags.DEFINE_bool("remat", False, "gpipe/1f1b_flush: rematerialise each stage's activations (memory).")
_INFLIGHT_MEMORY = flags.DEFINE_enum(
    "inflight_memory", "conservative", ["conservative", "schedule"],
    "hetpipe: minibatches each stage is counted to hold in memory: 'conservative' Nm on every non-last stage (safe "
    "whatever the task times); 'schedule' each stage's peak under the schedule rules at the plan's task times (safe "
    "only at those times; hetpipe_jax.sim.inflight_memory). Recorded in the plan's cost_model.")
_MAX_VW_GPUS = flags.DEFINE_integer(
    "max_vw_gpus", None, "--policy=auto: the largest virtual worker searched (unset: ceil(GPUs / num_vws) + 1); the "
    "value used is recorded in the plan's allocation_search.")
_PROFILE = flags.DEFINE_string("profile", None, "Profile JSON to use instead of the saved/default one.")
_OUTPUT = flags.DEFINE_string("output", None, "Where to write the plan JSON.")
flags.mark_flags_as_required(["model"])


def get_profile(model: str, batch_size: int, cluster: cluster_lib.ClusterSpec,
                path: str | None) -> profile_format.ModelProfile:
  """:func:`hetpipe_jax.profiles.get_profile` (kept here for callers of the planner's entry point)."""
  return profiles.get_profile(model, batch_size, cluster, path)


class FlagError(ValueError):
  """A flag is invalid, or not used by the method; the message names it and the fix."""


def check_flags() -> None:
  """The flags' checks, before any planning: values in range, and no flag the method does not use (it used to be
  dropped, or recorded without running): ``--remat`` but for the flush methods, ``--ps_placement`` but for the PS
  methods, ``--policy`` and ``--num_vws`` with the single-stage methods (Horovod: every GPU that holds the model
  is one worker).

  Raises:
    FlagError: naming the flag and the fix.
  """
  method, spec = _METHOD.value, methods.get_method(_METHOD.value)
  if _BATCH.value <= 0:
    raise FlagError(f"--batch_size must be positive, got {_BATCH.value}")
  if _INFLIGHT_MEMORY.value == "schedule" and not spec.schedule_peaks:
    raise FlagError(f"--inflight_memory=schedule is for --method=hetpipe (FIFO rule); --method={method} has a "
                    "closed-form held count: use --inflight_memory=conservative")
  if _MAX_VW_GPUS.value is not None and _POLICY.value != "auto":
    raise FlagError(f"--max_vw_gpus applies to --policy=auto only, not --policy={_POLICY.value}")
  if _MAX_VW_GPUS.value is not None and _MAX_VW_GPUS.value < 1:
    raise FlagError(f"--max_vw_gpus must be >= 1, got {_MAX_VW_GPUS.value}")
  unused = set()
  if method not in methods.FLUSH_METHODS:
    unused.add("remat")
  if method not in methods.PS_METHODS:
    unused.add("ps_placement")
  if spec.single_stage:  # every GPU that holds the model is one worker
    unused |= {"policy", "num_vws"}
  for name in sorted(unused):
    if flags.FLAGS[name].present and (name != "remat" or _REMAT.value):  # --noremat asks for what runs
      raise FlagError(f"--{name}={flags.FLAGS[name].value} is not used by --method={method}: leave it out")


def main(argv):
  del argv
  try:
    check_flags()
  except FlagError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  cluster = cluster_lib.load_cluster(_CLUSTER.value)
  profile = get_profile(_MODEL.value, _BATCH.value, cluster, _PROFILE.value)
  config = planner.PlannerConfig(policy=_POLICY.value, num_vws=_NUM_VWS.value, ps_placement=_PLACEMENT.value,
                                 method=_METHOD.value, num_inflight=_NUM_INFLIGHT.value, remat=_REMAT.value,
                                 max_vw_gpus=_MAX_VW_GPUS.value,
                                 cost=cost_model.CostModelConfig(inflight_memory=_INFLIGHT_MEMORY.value))
  try:
    plan = planner.make_plan(cluster, profile, config)
  except (allocator.AllocationError, partitioner.InfeasiblePartitionError, ValueError) as e:
    # No plan for these settings (a model too large for some VW's GPUs, ...): one line, exit 2, no traceback.
    print(f"error: no plan for --cluster={_CLUSTER.value} --model={_MODEL.value} --batch_size={_BATCH.value} "
          f"--policy={_POLICY.value} --num_vws={_NUM_VWS.value}: {e}", file=sys.stderr)
    sys.exit(2)
  print(planner.format_table(plan))
  if _OUTPUT.value:
    plan_format.write_plan(plan, _OUTPUT.value)
    print(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
  app.run(main)
