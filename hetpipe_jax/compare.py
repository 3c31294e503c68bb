r"""Which method, and which allocation, for my cluster? Every method planned and run by the event engine.

  python -m hetpipe_jax.compare --cluster=hetpipe_paper --model=vgg19_imagenet --batch_size=32 --num_vws=4 \
      --output=/tmp/compare

Prints one Markdown table (HetPipe NP/ED/HD/auto x default/local PS placement, PipeDream, GPipe and 1F1B-flush with
all-reduce across VWs, Horovod, and fsdp (ZeRO-3) with even shards and with shards by memory and examples by
speed): GPUs used, Nm or M, predicted images/s from the engine, the bottleneck, memory feasibility and the bytes
crossing nodes per step; writes ``<output>.json`` (every candidate) and ``<output>.png``
(a bar chart). ``--smoke``: a seconds-long run on ``local_cpu`` (CI). ``--num_inflight_by_engine``: HetPipe's Nm is
the engine's fastest under ``--staleness_bound`` (every Nm up to the smallest Max_m), as HetPipe §8.3 sets it, instead
of the planner's closed form; ``--cluster`` also takes a file, e.g. the calibrated paper cluster that
``experiments/paper/calibration.py --write_cluster=PATH`` writes.
"""

from __future__ import annotations

import json
import os
import time

from absl import app
from absl import flags

from hetpipe_jax import flag_checks
from hetpipe_jax import models
from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.planning import compare as compare_lib
from hetpipe_jax.profiles import get_profile
from hetpipe_jax.rules import methods

_CLUSTER = flags.DEFINE_string("cluster", "hetpipe_paper", "Cluster name (experiments/clusters/<name>.json) or path.")
_MODEL = flags.DEFINE_string("model", "vgg19_imagenet", "Registered model name (a saved profile, or one is made).")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Examples per minibatch (per VW; per GPU for Horovod and fsdp).")
_NUM_VWS = flags.DEFINE_integer("num_vws", 4, "Virtual workers for the pipelined methods.")
_D = flags.DEFINE_integer("staleness_bound", 0, "WSP staleness bound D for hetpipe and pipedream.")
_PULL = flags.DEFINE_bool("pull_every_wave", False, "WSP pull policy (False: HetPipe §5's).")
_WAVES = flags.DEFINE_integer("num_waves", 40, "Waves (steps) the engine runs per VW.")
_REMAT = flags.DEFINE_bool("remat", False, "GPipe / 1F1B-flush rematerialisation (memory model).")
_SHARED_NIC = flags.DEFINE_bool("shared_nic", True, "VWs on one node share its network interface for inter-node "
                                 "traffic (hetpipe_jax.rules.network); --noshared_nic: every transfer at full link "
                                 "speed.")
_NM_ENGINE = flags.DEFINE_bool("num_inflight_by_engine", False, "HetPipe NP/ED/HD: the Nm the engine runs fastest "
                                "under --staleness_bound, not the planner's closed-form choice (HetPipe §8.3).")
_PROFILE = flags.DEFINE_string("profile", None, "Profile JSON to use instead of the saved/default one.")
_OUTPUT = flags.DEFINE_string("output", None, "Write <output>.json and <output>.png.")
_ALL = flags.DEFINE_bool("all", False, "Print every candidate allocation, not only the fastest per method.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Seconds-long check: local_cpu, cnn, batch 64, 2 VWs, 10 waves.")


def main(argv):
  del argv
  t0 = time.perf_counter()
  cluster_name, model, batch, num_vws, waves = (_CLUSTER.value, _MODEL.value, _BATCH.value, _NUM_VWS.value,
                                                _WAVES.value)
  if _SMOKE.value:
    flag_checks.refuse_replaced("--smoke", [f.name for f in (_CLUSTER, _MODEL, _BATCH, _NUM_VWS, _WAVES)])
    cluster_name, model, batch, num_vws, waves = "local_cpu", "cnn", 64, 2, 10
  cluster = cluster_lib.load_cluster(cluster_name)
  profile = get_profile(model, batch, cluster, _PROFILE.value)
  config = compare_lib.CompareConfig(num_vws=num_vws, staleness_bound=_D.value, pull_every_wave=_PULL.value,
                                     num_waves=waves, remat=_REMAT.value, shared_nic=_SHARED_NIC.value,
                                     num_inflight_by_engine=_NM_ENGINE.value)
  table, every = compare_lib.compare(cluster, profile, config)
  title = (f"{model} on {cluster.name}, batch {batch}, {num_vws} VWs (HetPipe/PipeDream D={_D.value}); "
           f"{'shared' if _SHARED_NIC.value else 'per-link (no shared)'} NICs; predicted by the event engine")
  unit = models.example_unit(model)
  print(compare_lib.format_table(every if _ALL.value else table, title, unit))
  for r in every:
    for note in r.notes:
      if methods.get_method(r.method).single_stage or not r.memory_fits:  # which GPUs hold what
        print(f"note ({r.label}): {note}")
  elapsed = time.perf_counter() - t0
  print(f"compared {len(every)} configurations in {elapsed:.1f} s")
  if _OUTPUT.value:
    out = _OUTPUT.value
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w", encoding="utf-8") as f:
      json.dump({"cluster": cluster.name, "model": model, "batch_size": batch, "num_vws": num_vws,
                 "staleness_bound": _D.value, "num_inflight_by_engine": _NM_ENGINE.value, "num_waves": waves,
                 "shared_nic": _SHARED_NIC.value, "seconds": elapsed, "rate_unit": f"{unit}/s",
                 "table": compare_lib.rows_to_json(table), "all": compare_lib.rows_to_json(every)}, f, indent=2)
    compare_lib.plot(table, out + ".png", title, unit)
    print(f"wrote {out}.json and {out}.png")


if __name__ == "__main__":
  app.run(main)
