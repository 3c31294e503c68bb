"""The staleness study's grid, as data: the tasks (models and their held-out metric), the variants (an optimizer plus
at most the staleness remedies, each naming its Nm = 1, D = 0 reference) and the rows (group, task, method, variant,
VWs, Nm, D, seeds) that ``experiments/staleness_study.py`` runs. Adding a row or a variant is a line here.
"""

from __future__ import annotations

import dataclasses

# Every row of the grid, in batches as the machine allows (each run's own command is in its record).
RERUN_COMMAND = ("nice -n 10 .venv/bin/python experiments/staleness_study.py --jobs=2 "
                 "--output_dir=experiments/results/staleness --results_dir=experiments/paper/results")
LOWER_IS_BETTER = {"test_bits_per_byte": True, "test_accuracy": False}


@dataclasses.dataclass(frozen=True)
class Task:
  """A model, its data and how it is measured.

  Attributes:
    name: the table's key (``lm``, ``cnn``, ``paper``).
    label: for tables and plots.
    config: the config file the runs start from.
    overrides: config fields every run of the task sets.
    metric: the summary's held-out quality (``test_bits_per_byte``: lower is better; ``test_accuracy``).
    minibatches: minibatches in all (every VW together); 0: ``num_epochs`` of the overrides.
    evals: evaluations per run (besides the final one), for the curves.
    num_stages: stages per VW of the pipelined methods.
  """

  name: str
  label: str
  config: str
  overrides: dict
  metric: str
  minibatches: int
  evals: int
  num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class Variant:
  """An optimizer and the remedies applied with it (config fields).

  Attributes:
    name: the table's key.
    label: for tables and plots.
    overrides: config fields.
    reference: the variant whose Nm = 1, D = 0 run (same method, VWs and seed) is this one's reference: itself for
      an optimizer, the optimizer's for a remedy that changes nothing without staleness.
    needs: a config field the checkout must have (a setting another branch adds); without it the rows are
      reported as not run, naming it.
  """

  name: str
  label: str
  overrides: dict
  reference: str
  needs: str = ""


VARIANTS = {v.name: v for v in (
    Variant("adam", "Adam (b1 0.9)", {"optimizer": "adam"}, "adam"),
    Variant("nadam99", "NAdam b1 0.99", {"optimizer": "nadam", "adam_b1": 0.99}, "nadam99"),
    Variant("nadamw99", "NAdamW b1 0.99, wd 0.01", {"optimizer": "nadamw", "adam_b1": 0.99, "weight_decay": 0.01},
            "nadamw99"),
    Variant("muon", "Muon (NAdamW elsewhere)", {"optimizer": "muon"}, "muon"),
    Variant("adam_dc", "Adam + DC (λ 0.04)", {"optimizer": "adam", "delay_compensation": "dc"}, "adam"),
    Variant("nadam99_dc", "NAdam b1 0.99 + DC (λ 0.04)",
            {"optimizer": "nadam", "adam_b1": 0.99, "delay_compensation": "dc"}, "nadam99"),
    Variant("adam_ps_inverse", "Adam + PS 1/(1+τ)", {"optimizer": "adam", "ps_staleness_scaling": "inverse"},
            "adam"),
    Variant("adam_ps_exp", "Adam + PS e^(−τ)", {"optimizer": "adam", "ps_staleness_scaling": "exp"}, "adam"),
    Variant("adam_wp", "Adam + weight prediction", {"optimizer": "adam", "weight_prediction": "optimizer"}, "adam",
            needs="weight_prediction"),
    Variant("nadam99_wp", "NAdam b1 0.99 + weight prediction",
            {"optimizer": "nadam", "adam_b1": 0.99, "weight_prediction": "optimizer"}, "nadam99",
            needs="weight_prediction"),
    Variant("adam_pipemare", "Adam + PipeMare lr/τ^(1−t/T) (T 500)", {"optimizer": "adam",
                                                                      "delay_scaled_lr": "pipemare"}, "adam",
            needs="delay_scaled_lr"),
    Variant("adam_wp_pipemare", "Adam + weight prediction + PipeMare",
            {"optimizer": "adam", "weight_prediction": "optimizer", "delay_scaled_lr": "pipemare"}, "adam",
            needs="delay_scaled_lr"),
    Variant("muon_rms", "Muon, consistent RMS 0.2", {"optimizer": "muon", "muon_consistent_rms": 0.2}, "muon_rms"),
    Variant("muon_rms_wp", "Muon, consistent RMS 0.2 + weight prediction",
            {"optimizer": "muon", "muon_consistent_rms": 0.2, "weight_prediction": "optimizer"}, "muon_rms"),
    # Muon with prediction (the in-VW lag) plus a remedy for the drift between VWs (the PS's e^(−τ) scaling) or
    # PipeMare's in-VW rescheduling: the remedies that each helped Adam, stacked on the best setting.
    Variant("muon_rms_wp_ps_exp", "Muon RMS 0.2 + prediction + PS e^(−τ)",
            {"optimizer": "muon", "muon_consistent_rms": 0.2, "weight_prediction": "optimizer",
             "ps_staleness_scaling": "exp"}, "muon_rms"),
    Variant("muon_rms_wp_pipemare", "Muon RMS 0.2 + prediction + PipeMare",
            {"optimizer": "muon", "muon_consistent_rms": 0.2, "weight_prediction": "optimizer",
             "delay_scaled_lr": "pipemare"}, "muon_rms", needs="delay_scaled_lr"),
    # The paper-timing proxy: SGD as experiments/paper/convergence.py trains it (lr 0.01 per VW).
    Variant("sgd", "SGD (lr 0.01 per VW)", {"optimizer": "sgd", "learning_rate": 0.01, "lr_schedule": "constant"},
            "sgd"),
    Variant("sgd_dc", "SGD + DC (λ 0.04)", {"optimizer": "sgd", "learning_rate": 0.01, "lr_schedule": "constant",
                                            "delay_compensation": "dc"}, "sgd"),
    Variant("sgd_ps_inverse", "SGD + PS 1/(1+τ)", {"optimizer": "sgd", "learning_rate": 0.01,
                                                   "lr_schedule": "constant", "ps_staleness_scaling": "inverse"},
            "sgd"),
    # The proxy with momentum SGD (μ 0.9, lr 0.001: the SGD rows' long-run step, lr / (1 − μ) = 0.01): an optimizer
    # with a direction of its own, so that weight prediction has a time-to-target row (plain SGD has none).
    Variant("momentum", "Momentum SGD (μ 0.9, lr 0.001 per VW)",
            {"optimizer": "momentum", "momentum": 0.9, "learning_rate": 0.001, "lr_schedule": "constant"}, "momentum"),
    Variant("momentum_wp", "Momentum SGD + weight prediction",
            {"optimizer": "momentum", "momentum": 0.9, "learning_rate": 0.001, "lr_schedule": "constant",
             "weight_prediction": "optimizer"}, "momentum", needs="weight_prediction"),
)}


@dataclasses.dataclass(frozen=True)
class Row:
  """One configuration of the grid, run for ``seeds`` seeds (0 .. seeds - 1).

  Attributes:
    group: the goal the row measures (``lm_in_vw``, ``lm_cross_vw``, ``cnn``, or a time-to-target group of
      ``staleness_report.PAPER_GROUPS``: ``paper``, ``paper_hetpipe_fit``, ``paper_momentum``, ...).
    task: a key of the tasks.
    method: ``hetpipe``, ``pipedream``, or a reference (``horovod``, ``1f1b_flush``: Nm = 1, D = 0).
    variant: a key of :data:`VARIANTS`.
    num_vws: virtual workers.
    nm: minibatches in flight per VW (Nm; the all-reduce references: micro-batches per step).
    d: the staleness bound D.
    seeds: how many seeds.
    timing: ``paper`` rows: the timing plan's key (``hetpipe``, ``horovod``, ``1f1b_flush``; with
      :data:`HETPIPE_FIT` appended: on the second calibration's cluster).
  """

  group: str
  task: str
  method: str
  variant: str
  num_vws: int
  nm: int
  d: int
  seeds: int
  timing: str = ""

  @property
  def key(self) -> str:
    return f"{self.group}.{self.task}.{self.method}.{self.variant}.v{self.num_vws}.nm{self.nm}.d{self.d}"


# A ``paper`` row's timing key with this suffix is timed on the cluster fitted on VGG-19's HetPipe cells (the second
# calibration, experiments/paper/calibration_hetpipe.py); without it, on the one fitted on the Horovod cells.
HETPIPE_FIT = "@hetpipe_fit"


def _rows(group, task, method, variants, num_vws, nms, ds, seeds, timing=""):
  return [Row(group, task, method, v, num_vws, nm, d, seeds, timing) for v in variants for nm in nms for d in ds]


# The headline rows (the README's and the goals' main numbers: each goal's uncompensated row, its best remedy and
# their references) run on 3 seeds, every other row on 2 (issue 25).
HEADLINE_SEEDS = 3
HEADLINE = frozenset((
    "lm_in_vw.lm.hetpipe.adam.v1.nm1.d0", "lm_in_vw.lm.hetpipe.adam.v1.nm2.d0",
    "lm_cross_vw.lm.hetpipe.muon_rms.v2.nm1.d0", "lm_cross_vw.lm.hetpipe.muon_rms_wp.v2.nm2.d1",
    "cnn.cnn.hetpipe.adam.v2.nm1.d0", "cnn.cnn.hetpipe.adam.v2.nm4.d4",
    "cnn.cnn.hetpipe.muon_rms.v2.nm1.d0", "cnn.cnn.hetpipe.muon_rms_wp.v2.nm4.d4",
    *(f"{g}.paper.{k}" for g in ("paper", "paper_hetpipe_fit") for k in (
        "horovod.sgd.v16.nm1.d0", "1f1b_flush.sgd.v4.nm32.d0", "hetpipe.sgd.v4.nm4.d0", "hetpipe.sgd_dc.v4.nm4.d0")),
))


def _headline(rows) -> tuple:
  return tuple(dataclasses.replace(r, seeds=HEADLINE_SEEDS) if r.key in HEADLINE else r for r in rows)


# The grid, in the order it runs (the first rows first). What was left out of the cross product (every
# optimizer x remedy x Nm x D x method) and why is said in REPRODUCTION.md ("Staleness and its remedies"): the study
# runs on 2 shared CPU cores, about 5 minutes per LM or CNN run. ``EXTENSION`` rows run when selected.
GRID = _headline(
    # LM inside one VW (D = 0): Nm 1 (the reference) against Nm 2.
    _rows("lm_in_vw", "lm", "hetpipe", ["adam", "nadam99"], 1, [1, 2], [0], 2)
    + _rows("lm_in_vw", "lm", "hetpipe", ["adam_wp"], 1, [2], [0], 2)
    + _rows("lm_in_vw", "lm", "hetpipe", ["adam_dc"], 1, [2], [0], 2)
    # LM across 2 VWs: Nm 1, D 0 (the reference) against Nm 2, D 1.
    + _rows("lm_cross_vw", "lm", "hetpipe", ["adam"], 2, [1], [0], 2)
    + _rows("lm_cross_vw", "lm", "hetpipe", ["adam", "adam_ps_inverse"], 2, [2], [1], 2)
    # CNN, 2 VWs, one epoch: Nm 1, D 0 (the reference) against Nm 4, D 4.
    + _rows("cnn", "cnn", "hetpipe", ["adam"], 2, [1], [0], 2)
    + _rows("cnn", "cnn", "hetpipe", ["adam", "adam_dc", "adam_ps_inverse", "adam_wp"], 2, [4], [4], 2)
    # Time to target on the paper's cluster: VGG-19 timing (4 ED-local VWs, the plan's Nm 4), mlp_tiny numerics.
    + _rows("paper", "paper", "horovod", ["sgd"], 16, [1], [0], 2, "horovod")
    + _rows("paper", "paper", "1f1b_flush", ["sgd"], 4, [32], [0], 2, "1f1b_flush")
    + _rows("paper", "paper", "hetpipe", ["sgd", "sgd_dc", "sgd_ps_inverse"], 4, [4], [0, 4], 2, "hetpipe")
    # The same rows timed on the second calibration (experiments/paper/calibration_hetpipe.py: the efficiencies that
    # give HetPipe its paper speed on VGG-19), so that the time-to-target conclusion does not rest on one fit.
    + _rows("paper_hetpipe_fit", "paper", "horovod", ["sgd"], 16, [1], [0], 2, "horovod" + HETPIPE_FIT)
    + _rows("paper_hetpipe_fit", "paper", "1f1b_flush", ["sgd"], 4, [32], [0], 2, "1f1b_flush" + HETPIPE_FIT)
    + _rows("paper_hetpipe_fit", "paper", "hetpipe", ["sgd", "sgd_dc", "sgd_ps_inverse"], 4, [4], [0, 4], 2,
            "hetpipe" + HETPIPE_FIT)
)
# Extensions, in order of interest (``--extensions``: run as compute allows; the tables say which did not run).
EXTENSION = _headline(
    _rows("lm_in_vw", "lm", "hetpipe", ["adam", "nadam99"], 1, [4], [0], 2)
    + _rows("lm_in_vw", "lm", "hetpipe", ["muon"], 1, [1, 2], [0], 2)
    + _rows("lm_in_vw", "lm", "hetpipe", ["adam_wp", "nadam99_wp", "adam_pipemare"], 1, [4], [0], 2)
    + _rows("lm_in_vw", "lm", "hetpipe", ["nadam99_wp"], 1, [2], [0], 2)
    + _rows("lm_in_vw", "lm", "pipedream", ["adam"], 1, [2], [0], 2)
    + _rows("lm_cross_vw", "lm", "hetpipe", ["nadam99"], 2, [1], [0], 2)
    + _rows("lm_cross_vw", "lm", "hetpipe", ["nadam99", "adam_dc"], 2, [2], [1], 2)
    + _rows("cnn", "cnn", "hetpipe", ["nadam99"], 2, [1], [0], 2)
    + _rows("cnn", "cnn", "hetpipe", ["nadam99", "adam_ps_exp", "adam_pipemare", "adam_wp_pipemare"], 2, [4], [4], 2)
    + _rows("cnn", "cnn", "pipedream", ["adam"], 2, [4], [4], 2)
    + _rows("cnn", "cnn", "horovod", ["adam"], 2, [1], [0], 2)
    + _rows("cnn", "cnn", "1f1b_flush", ["adam"], 2, [1], [0], 2)
    # Muon at Adam's RMS, the LM's best setting (docs/measurements/lm_delay_sweep.md), on the CNN.
    + _rows("cnn", "cnn", "hetpipe", ["muon_rms"], 2, [1], [0], 2)
    + _rows("cnn", "cnn", "hetpipe", ["muon_rms", "muon_rms_wp"], 2, [4], [4], 2)
    # lm.py's default (Muon at Adam's RMS, weight prediction) across 2 VWs, in virtual time (exact numerics).
    + _rows("lm_cross_vw", "lm", "hetpipe", ["muon_rms"], 2, [1], [0], 2)
    + _rows("lm_cross_vw", "lm", "hetpipe", ["muon_rms", "muon_rms_wp"], 2, [2], [1], 2)
    # The best setting with a remedy for the drift between VWs stacked on it.
    + _rows("cnn", "cnn", "hetpipe", ["muon_rms_wp_ps_exp", "muon_rms_wp_pipemare"], 2, [4], [4], 2)
    + _rows("lm_cross_vw", "lm", "hetpipe", ["muon_rms_wp_ps_exp"], 2, [2], [1], 2)
    # Time to target with weight prediction: the paper rows' proxy on momentum SGD, under both calibrations.
    + [r for g, fit in (("paper_momentum", ""), ("paper_momentum_hetpipe_fit", HETPIPE_FIT)) for r in (
        _rows(g, "paper", "horovod", ["momentum"], 16, [1], [0], 2, "horovod" + fit)
        + _rows(g, "paper", "1f1b_flush", ["momentum"], 4, [32], [0], 2, "1f1b_flush" + fit)
        + _rows(g, "paper", "hetpipe", ["momentum", "momentum_wp"], 4, [4], [0, 4], 2, "hetpipe" + fit))]
)

QUICK_GRID = tuple(
    _rows("lm_in_vw", "lm", "hetpipe", ["adam"], 1, [1], [0], 1)
    + _rows("lm_in_vw", "lm", "hetpipe", ["adam_dc"], 1, [2], [0], 1)
    + _rows("cnn", "cnn", "hetpipe", ["adam"], 2, [1], [0], 1)
    + _rows("cnn", "cnn", "pipedream", ["adam_ps_inverse"], 2, [4], [4], 1)
    + _rows("cnn", "cnn", "horovod", ["adam"], 2, [1], [0], 1)
)


def make_tasks(quick: bool, lm_minibatches: int, text_dir: str, fashion_dir: str) -> dict[str, Task]:
  """The study's tasks; ``quick`` shrinks each to a few minibatches of a tiny model (synthetic data allowed)."""
  common = {"plan": "", "partition": "", "progress": False, "checkpoint_every_waves": 0, "log_every_waves": 10**6,
            "emulate_stage_ms": "10,10"}
  # The LM rows start from lm.py's model, data and schedule with plain Adam and no remedy (lm.py's own default is
  # Muon with weight prediction); each variant names its optimizer and remedies.
  text = {"optimizer": "adam", "muon_consistent_rms": 0.0, "weight_prediction": "none",
          **({"data_dir": text_dir} if text_dir else {})}
  fashion = {"data_dir": fashion_dir} if fashion_dir else {}
  if quick:
    return {
        "lm": Task("lm", "gpt_tiny on text (quick)", "experiments/configs/lm.py",
                   {**common, **text, "model": "gpt_tiny", "warmup_minibatches": 2, "eval_batch_size": 64}, 
                   "test_bits_per_byte", 16, 1),
        "cnn": Task("cnn", "mlp_tiny on synthetic Fashion-MNIST (quick)", "experiments/configs/default.py",
                    {**common, **fashion, "model": "mlp_tiny", "check_counts": False, "num_epochs": 1.0,
                     "eval_batch_size": 64}, "test_accuracy", 0, 1),
    }
  return {
      "lm": Task("lm", f"gpt_bytes on fortunes, bits/byte after {lm_minibatches} minibatches",
                 "experiments/configs/lm.py", {**common, **text}, "test_bits_per_byte", lm_minibatches, 3),
      "cnn": Task("cnn", "default CNN on Fashion-MNIST, test accuracy after one epoch",
                  "experiments/configs/default.py", {**common, **fashion, "num_epochs": 1.0}, "test_accuracy", 0, 3),
      "paper": Task("paper", "mlp_tiny on Fashion-MNIST under the paper's VGG-19 timing, one epoch",
                    "experiments/configs/paper_virtual.py",
                    {"plan": "", "emulate_plan": False, "partition": "", "progress": False, "checkpoint_every_waves": 0,
                     "log_every_waves": 10**6, "model": "mlp_tiny", "batch_size": 32, "num_epochs": 1.0, **fashion},
                    "test_accuracy", 0, 20, 4),
  }
