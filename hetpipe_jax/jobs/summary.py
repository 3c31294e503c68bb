"""``summary.json``: one :class:`Summary` type every driver fills (MPI and virtual time, PS and all-reduce methods).

Runtime layer (jax only for Muon's parameter names). Its keys and values are the records' contract: the run's mode
and time unit, its results, its times and rates, the settings that ran (:func:`settings_summary`, the values
``config.json`` holds), the final global clock, then the driver's own records.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from hetpipe_jax.jobs.job import Job
from hetpipe_jax.jobs.job_config import METHOD_SETTINGS, format_partitions, optimizer_summary

TIME_UNITS = {"mpi": "wall-clock seconds", "virtual": "simulated seconds"}


@dataclasses.dataclass
class Summary:
  """One run's ``summary.json``, in its key order.

  Attributes:
    mode: ``"mpi"`` or ``"virtual"`` (its ``time_unit`` follows).
    results: the final test metrics, the last training loss and the minibatches trained (:func:`wsp_results`,
      :func:`allreduce_results`).
    rates: the run's seconds and rates (:func:`rates`), plus the mode's own (steady rate, host seconds).
    settings: :func:`settings_summary`.
    global_clock: the final global clock (waves, or all-reduce steps).
    fields: the driver's own records (PS log fields, shards, per-VW statistics, evaluations, checkpoints, ...).
  """

  mode: str
  results: Mapping[str, Any]
  rates: Mapping[str, Any]
  settings: Mapping[str, Any]
  global_clock: int
  fields: Mapping[str, Any]

  def to_json(self) -> dict[str, Any]:
    """The summary as ``summary.json`` holds it."""
    return {"mode": self.mode, "time_unit": TIME_UNITS[self.mode], **self.results, **self.rates, **self.settings,
            "global_clock": self.global_clock, **self.fields}

  def write(self, outputs: Any) -> dict[str, Any]:
    """Writes ``summary.json`` (:meth:`hetpipe_jax.jobs.outputs.RunOutputs.finish`); returns its dict."""
    d = self.to_json()
    outputs.finish(d)
    return d


def wsp_results(final: Mapping[str, Any], objective: Mapping[str, Any], train_loss: float, num_minibatches: int,
                num_minibatches_per_vw: int) -> dict[str, Any]:
  """A parameter-server run's results: the final test metrics (all of ``final``), the objective and its loss unit
  (config.json's), the last training loss, and the minibatches of all VWs and of each."""
  return {"test_accuracy": final["test_accuracy"], "test_loss": final["test_loss"], **final,
          "objective": objective["objective"], "loss_unit": objective["loss_unit"], "final_train_loss": train_loss,
          "num_minibatches": num_minibatches, "num_minibatches_per_vw": num_minibatches_per_vw}


def rates(mode: str, seconds: float, minibatches: int, batch_size: int, **between: Any) -> dict[str, Any]:
  """The run's seconds (virtual time: ``simulated_time_s`` and ``wall_time_s`` both the simulated seconds) and its
  rates over them; ``between`` goes between the seconds and the rates (virtual time's ``shared_nic``).

  Args:
    mode: ``"mpi"`` or ``"virtual"``.
    seconds: the run's wall-clock or simulated seconds.
    minibatches: the minibatches the rates count (all VWs).
    batch_size: examples per minibatch.
  """
  out = {"simulated_time_s": seconds} if mode == "virtual" else {}
  return {**out, "wall_time_s": seconds, **between, "minibatches_per_s": minibatches / seconds,
          "images_per_s": minibatches * batch_size / seconds}


def _wsp_method_settings(job: Job) -> dict[str, Any]:
  """The PS methods' ``method_settings``: Nm, D, and the method's own settings of :data:`~hetpipe_jax.jobs.
  job_config.METHOD_SETTINGS` that are recorded (pipedream's ``vertical_sync``), ``delay_compensation`` (and
  ``dc_lambda`` when on), ``weight_prediction``, ``delay_scaled_lr`` (and ``pipemare_warmup_minibatches`` when on)."""
  own = {s.name: bool(getattr(job.pipeline, s.name)) for s in METHOD_SETTINGS
         if s.name in _RECORDED_SETTINGS and job.method in s.methods}
  dc = job.optim.delay_compensation  # DC-ASGD (runtime.delay_compensation): λ recorded when on
  own["delay_compensation"] = dc
  if dc != "none":
    own["dc_lambda"] = float(job.optim.dc_lambda)
  own["weight_prediction"] = job.optim.weight_prediction  # rules.weight_prediction
  own["delay_scaled_lr"] = job.optim.delay_scaled_lr  # PipeMare: T recorded when on
  if own["delay_scaled_lr"] != "none":
    own["pipemare_warmup_minibatches"] = int(job.optim.pipemare_warmup_minibatches)
  return {"num_inflight": job.num_inflight, "staleness_bound": job.staleness_bound,
          "sync": "WSP (parameter server)", **own,
          "ps_staleness_scaling": job.ps.staleness_scaling,
          "ps_staleness_alpha": float(job.ps.staleness_alpha)}


def _allreduce_method_settings(job: Job) -> dict[str, Any]:
  """The all-reduce methods' ``method_settings``: micro-batches per step and their size, remat."""
  return {"num_microbatches": job.num_inflight, "micro_batch_size": job.batch_size // job.num_inflight,
          "sync": "all-reduce BSP (MPI Allreduce per reduction segment, no PS)",
          "remat": job.pipeline.remat}


_RECORDED_SETTINGS = ("vertical_sync",)  # method-only flags recorded in a PS method's method_settings
_METHOD_SETTINGS = {"wsp": _wsp_method_settings, "allreduce": _allreduce_method_settings}  # by the method's sync


def settings_summary(job: Job, partitions: Sequence[Sequence[Sequence[int]]], spec: Any = None) -> dict[str, Any]:
  """The settings that ran, as every job records them in ``summary.json`` (the same values as ``config.json``); with
  ``optimizer='muon'`` and the model ``spec``, the optimizer's ``muon_params`` (the leaves its rule gave Muon,
  ``"layer:path"``)."""
  optimizer = optimizer_summary(job.optim)
  if job.optim.optimizer == "muon" and spec is not None:
    import jax  # pylint: disable=g-import-not-at-top
    from hetpipe_jax import models  # pylint: disable=g-import-not-at-top
    from hetpipe_jax.runtime import optimizers  # pylint: disable=g-import-not-at-top
    shapes = jax.eval_shape(lambda: models.init_layer_params(spec, jax.random.key(job.seed)))
    optimizer["muon_params"] = optimizers.muon_leaf_names(shapes)
  return {
      "method": job.method,
      "method_settings": _METHOD_SETTINGS[job.pipeline.sync](job),
      "model": job.model,
      "optimizer": optimizer,
      "batch_size": job.batch_size,
      "num_virtual_workers": job.num_virtual_workers,
      "num_stages": job.num_stages,
      "num_stages_per_vw": [len(p) for p in partitions],
      "partition": format_partitions(partitions),
      "partitions": {str(v): [list(r) for r in p] for v, p in enumerate(partitions)},
      "num_inflight": job.num_inflight,
      "local_staleness": job.num_inflight - 1,
      "staleness_bound": job.staleness_bound,
      "ps_apply": job.wsp.ps_apply,
      "pull_every_wave": job.wsp.pull_every_wave,
      "plan": job.plan_path,  # config.json's: the plan file the run resolved from ("" without one)
      "memory_caps": None if job.memory_caps is None else [list(c) for c in job.memory_caps],
      "setting_sources": dict(job.sources),
  }


def allreduce_results(final: Mapping[str, Any], train_loss: float, steps: int, num_vws: int,
                      num_microbatches: int) -> dict[str, Any]:
  """An all-reduce run's results as both its jobs record them in ``summary.json`` (MPI and virtual time): the final
  test metrics, the last training loss and the (micro-)batches trained, ``steps`` steps of ``num_vws`` replicas,
  ``num_microbatches`` (M) per step."""
  return {
      "test_accuracy": final["test_accuracy"],
      "test_loss": final["test_loss"],
      "final_train_loss": train_loss,
      "num_minibatches": steps * num_vws,
      "num_minibatches_per_vw": steps,
      "num_microbatches_per_vw": steps * num_microbatches,
  }
