r"""HetPipe against the 2026 baseline, fully sharded data parallelism (ZeRO-3 / FSDP), on the paper's cluster and x4.

  .venv/bin/python experiments/paper/fsdp_compare.py [--quick] [--results_dir=experiments/paper/results]

For VGG-19 and ResNet-152 (batch 32) and GPT-2 medium and large (batch 2 x 1,024 tokens) on ``hetpipe_paper`` (16
GPUs, 4 VWs) and ``hetpipe_paper_x4`` (64 GPUs, 16 VWs), both with the calibrated efficiencies
(:mod:`experiments.paper.calibration`), ``compare`` (:mod:`hetpipe_jax.planning.compare`: every method planned and
run by the event engine, D = 0, HetPipe §5's pull policy, shared NICs) gives one row per method: HetPipe's best allocation
(the fastest of NP / ED / HD / auto x PS placement), PipeDream, GPipe and 1F1B-flush (their fastest allocation),
Horovod (the GPUs that hold the model), and fsdp with even shards (ZeRO-3) and with shards by memory and examples by
speed (:mod:`hetpipe_jax.costs.fsdp_cost`), each without or, when that does not fit, with activation
checkpointing (``+ remat``). Examples per step differ by method (a VW's minibatch, Horovod's and fsdp's ``batch`` per
GPU), so the rates compare throughput, not convergence. Every number is a prediction; none is in the paper.
"""

from __future__ import annotations

import pathlib
import sys
import time

if str(pathlib.Path(__file__).resolve().parents[2]) not in sys.path:  # run as a file: find the package
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from absl import app, flags  # noqa: E402

from experiments.paper import calibration  # noqa: E402
from experiments.paper import common  # noqa: E402
from hetpipe_jax import models  # noqa: E402
from hetpipe_jax.costs import cluster as cluster_lib  # noqa: E402
from hetpipe_jax.planning import compare as compare_lib  # noqa: E402

MODELS = (("vgg19_imagenet", 32, "VGG-19"), ("resnet152_imagenet", 32, "ResNet-152"),
          ("gpt2_medium", 2, "GPT-2 medium"), ("gpt2_large", 2, "GPT-2 large"))
CLUSTERS = (("hetpipe_paper", 4), ("hetpipe_paper_x4", 16))  # (cluster, VWs of the pipelined methods)
QUICK_MODELS = ("gpt2_medium",)
QUICK_CLUSTERS = ("hetpipe_paper",)


def method_rows(table: list) -> list:
  """HetPipe's fastest row, then every other method's table row (compare keeps the fastest allocation of each)."""
  hetpipe = max((r for r in table if r.method == "hetpipe"), key=lambda r: r.images_per_s)
  return [hetpipe] + [r for r in table if r.method != "hetpipe"]


def _label(r) -> str:
  place = f" / {r.placement}" if r.placement else ""
  return f"{r.method} {r.allocation}{place}"


def run(results_dir: str, quick: bool, clusters: tuple[str, ...] = ()) -> str:
  t0 = time.perf_counter()
  base_cal = None
  sections, claims, payload_rows, cells = [], [], [], []
  for cluster_name, num_vws in CLUSTERS:
    if (quick and cluster_name not in QUICK_CLUSTERS) or (clusters and cluster_name not in clusters):
      continue
    base = cluster_lib.load_cluster(cluster_name)
    if base_cal is None:
      _, base_cal = calibration.calibrate()
    cluster = base_cal.apply(base)
    for model, batch, name in MODELS:
      if quick and model not in QUICK_MODELS:
        continue
      profile = common.load_profile(model, batch)
      config = compare_lib.CompareConfig(num_vws=num_vws, staleness_bound=0, pull_every_wave=False,
                                         num_waves=8 if quick else 20)
      table, _ = compare_lib.compare(cluster, profile, config)
      rows = method_rows(table)
      unit = models.example_unit(model)
      lines = [f"**{name}** (batch {batch}) on `{cluster_name}` ({len(cluster.gpus())} GPUs, {num_vws} VWs for the "
               "pipelined methods)", "",
               f"| method | allocation | GPUs | {unit}/s | vs HetPipe | bottleneck | memory |",
               "|---|---|---:|---:|---:|---|---|"]
      het = rows[0].images_per_s
      for r in rows:
        rel = f"{r.images_per_s / het:.2f}x" if het > 0 and r.images_per_s > 0 else "-"
        mem = f"fits ({100 * r.memory_use:.0f}%)" if r.memory_use == r.memory_use else "does not fit"
        alloc = r.allocation + (f" / {r.placement}" if r.placement else "")
        lines.append(f"| {r.method} | {alloc} | {r.gpus_used} | {r.images_per_s:.1f} | {rel} | {r.bottleneck} | "
                     f"{mem} |")
        payload_rows.append({"cluster": cluster_name, "model": model, "batch_size": batch, "method": r.method,
                             "allocation": alloc, "gpus": r.gpus_used, "rate": r.images_per_s, "unit": f"{unit}/s",
                             "bottleneck": r.bottleneck, "memory_use": r.memory_use, "notes": r.notes})
      sections.append("\n".join(lines))
      fastest = max(rows, key=lambda r: r.images_per_s)
      fsdp = max((r for r in rows if r.method == "fsdp"), key=lambda r: r.images_per_s)
      cells.append((f"{name} on {cluster_name}", fastest.method, fsdp.images_per_s / het if het > 0 else float("inf")))
      claims.append(common.claim(
          f"{name} on {cluster_name}: fastest method, and fsdp against HetPipe's best allocation", "-",
          f"{_label(fastest)} {fastest.images_per_s:.1f} {unit}/s; HetPipe {rows[0].allocation}"
          f"{' / ' + rows[0].placement if rows[0].placement else ''} {het:.1f}; best fsdp ({fsdp.allocation}) "
          f"{fsdp.images_per_s:.1f}", f"fsdp / HetPipe = {fsdp.images_per_s / het:.2f}x" if het > 0 else "-",
          f"HetPipe bottleneck: {rows[0].bottleneck}; fsdp: {fsdp.bottleneck}", common.command("fsdp_compare"),
          False))
  wins = [c for c, m, _ in cells if m == "hetpipe"]
  summary = (f"HetPipe's best allocation is the fastest method in {len(wins)} of {len(cells)} cells"
             f"{' (' + ', '.join(wins) + ')' if wins else ''}; the faster fsdp variant over HetPipe: "
             + ", ".join(f"{c} {r:.2f}x" for c, _, r in cells) + ". fsdp rows marked `+ remat` checkpoint "
             "activations (the pipelined methods here do not: `compare --remat` gives GPipe / 1F1B-flush theirs).")
  markdown = "\n\n".join(
      ["fsdp (ZeRO-3 / FSDP) beside HetPipe's best allocation and the other methods: predicted by the event engine "
       "(calibrated efficiencies, D = 0, shared NICs); fsdp's notes (`python -m hetpipe_jax.compare ... --all`) give "
       "its no-overlap bound and per-GPU split", summary] + sections)
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(9, 0.3 * len(payload_rows) + 1.5))
  labels = [f"{p['cluster'].replace('hetpipe_paper', 'paper')} {p['model']} {p['method']}" for p in payload_rows]
  ax.barh(labels[::-1], [p["rate"] for p in payload_rows][::-1],
          color=["tab:olive" if p["method"] == "fsdp" else "tab:blue" if p["method"] == "hetpipe" else "lightgrey"
                 for p in payload_rows][::-1])
  ax.set_xscale("symlog")
  ax.set_xlabel("predicted examples/s (images or sequences)")
  ax.tick_params(axis="y", labelsize=6)
  fig.tight_layout()
  payload = {"claims": claims, "rows": payload_rows, "quick": quick, "seconds": time.perf_counter() - t0}
  return common.write_results(results_dir, "fsdp_compare", payload, markdown, fig)


def main(argv):
  del argv
  common.print_results(run(flags.FLAGS.results_dir, flags.FLAGS.quick, tuple(flags.FLAGS.clusters)))


if __name__ == "__main__":
  flags.DEFINE_string("results_dir", common.RESULTS_DIR, "Where to write fsdp_compare.{json,md,png}.")
  flags.DEFINE_bool("quick", False, "One model on the paper's cluster, few waves (a smoke run, not a result).")
  flags.DEFINE_list("clusters", [], "Only these of hetpipe_paper, hetpipe_paper_x4 (default: both).")
  app.run(main)
