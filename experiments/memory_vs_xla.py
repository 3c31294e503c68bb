"""The cost model's stage memory against XLA's own accounting of the stage's compiled programs (issue 28).

For each model and each stage of a one-stage and a two-stage split, at one minibatch in flight: the cost model's
``stage_memory_bytes`` (built from a fresh cost-analysis profile of the model at that batch size) against
:func:`hetpipe_jax.runtime.xla_memory.stage_memory`'s peak on the local device, and the ratio model / XLA.

  .venv/bin/python experiments/memory_vs_xla.py --models=cnn:64,gpt_tiny:8 --out=/tmp/memory_vs_xla.json
"""

from __future__ import annotations

import json

from absl import app, flags, logging

from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.costs import cost_model
from hetpipe_jax.models import load_model
from hetpipe_jax.runtime import profiler, xla_memory

_MODELS = flags.DEFINE_string("models", "cnn:64,gpt_tiny:8", "comma-separated model:batch pairs")
_OUT = flags.DEFINE_string("out", "", "JSON file for the rows (optional)")

MIB = 2 ** 20


def compare(model: str, batch_size: int, optimizer: str = "momentum") -> list[dict]:
  """Rows ``{model, batch_size, stage, layer_range, is_last, model_bytes, xla_bytes, ratio, programs}``."""
  spec = load_model(model)
  prof = profiler.profile_model(spec, batch_size, measure=False, optimizer=optimizer)
  cluster = cluster_lib.load_cluster("local_cpu")  # memory needs no GPU type: any cluster does
  costs = cost_model.build_stage_costs(prof, cluster)
  n = spec.num_layers
  rows = []
  for split in ([(0, n)], [(0, n // 2), (n // 2, n)]):
    for s, (i, j) in enumerate(split):
      is_last = s == len(split) - 1
      xla = xla_memory.stage_memory(spec, (i, j), batch_size, is_last=is_last, optimizer=optimizer)
      ours = costs.stage_memory_bytes(i, j, is_last, len(split), 1)
      rows.append(dict(model=model, batch_size=batch_size, stage=s, num_stages=len(split), layer_range=[i, j],
                       is_last=is_last, model_bytes=int(ours), xla_bytes=xla.peak_bytes,
                       ratio=round(ours / xla.peak_bytes, 3),
                       programs={k: vars(v) for k, v in xla.programs.items()}))
      logging.info("[memory_vs_xla] %s b%d stage %d/%d [%d, %d): model %.1f MiB, XLA %.1f MiB, ratio %.2f", model,
                   batch_size, s, len(split), i, j, ours / MIB, xla.peak_bytes / MIB, ours / xla.peak_bytes)
  return rows


def main(argv):
  del argv
  rows = []
  for item in _MODELS.value.split(","):
    model, batch = item.split(":")
    rows += compare(model, int(batch))
  for r in rows:
    print(f"{r['model']} b{r['batch_size']} stage {r['stage']}/{r['num_stages']} {r['layer_range']}: "
          f"model {r['model_bytes'] / MIB:.1f} MiB, XLA {r['xla_bytes'] / MIB:.1f} MiB, ratio {r['ratio']:.2f}")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
