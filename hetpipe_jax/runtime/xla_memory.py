"""XLA's own accounting of a pipeline stage's memory: the compiled programs of its train step (HetPipe §4, §7).

Runtime layer (jax). The stage's jitted functions (:mod:`hetpipe_jax.runtime.stages`) are lowered and compiled
for one minibatch in flight; nothing executes. Each program's ``memory_analysis()`` gives its argument, output,
temporary and aliased bytes; the stage's peak is the largest program's ``argument + output + temp - alias`` plus
the stage's persistent buffers that are not among that program's arguments (optimizer state and the gradient
accumulator during the forward and backward). The forward's outputs include the VJP residuals the stage keeps
for the backward, so this is the number to set against the cost model's
:meth:`~hetpipe_jax.costs.cost_model.StageCosts.stage_memory_bytes` at ``Nm = 1``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from hetpipe_jax.models import ModelSpec
from hetpipe_jax.runtime import profiler, stages


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
  """One compiled program's ``memory_analysis()`` (bytes)."""

  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int

  @property
  def total_bytes(self) -> int:
    return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


@dataclasses.dataclass(frozen=True)
class StageMemory:
  """XLA's accounting of one stage at one minibatch in flight.

  Attributes:
    programs: ``"forward"``, ``"backward"`` (non-last stages) or ``"forward_backward"`` (last stage), and
      ``"update"``: each program's memory.
    param_bytes, optimizer_state_bytes: the stage's weights and optimizer state.
    peak_bytes: the stage's peak (module docstring).
  """

  programs: dict[str, ProgramMemory]
  param_bytes: int
  optimizer_state_bytes: int
  peak_bytes: int


def _program_memory(compiled: Any) -> ProgramMemory:
  m = compiled.memory_analysis()
  return ProgramMemory(int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.temp_size_in_bytes),
                       int(m.alias_size_in_bytes))


def stage_memory(spec: ModelSpec, layer_range: tuple[int, int], batch_size: int, *, is_last: bool,
                 optimizer: str = "momentum", device: jax.Device | None = None) -> StageMemory:
  """Compiles one stage's train-step programs and reads XLA's memory accounting.

  Args:
    spec: the model.
    layer_range: the stage's half-open ``(start, end)`` layer range.
    batch_size: examples per minibatch.
    is_last: whether the stage is the pipeline's last (one forward+backward program with the loss).
    optimizer: ``"sgd"``, ``"momentum"`` or ``"adam"`` (:func:`hetpipe_jax.runtime.profiler.profile_model`).
    device: the device to compile for (default ``jax.devices()[0]``).

  Returns:
    A :class:`StageMemory`.

  Raises:
    ValueError: unknown optimizer, bad layer range or non-positive batch size.
  """
  if optimizer not in profiler.OPTIMIZERS:
    raise ValueError(f"unknown optimizer {optimizer!r}: must be one of {sorted(profiler.OPTIMIZERS)}")
  if batch_size <= 0:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  start, end = layer_range
  if not 0 <= start < end <= spec.num_layers:
    raise ValueError(f"layer_range {layer_range} outside [0, {spec.num_layers}]")
  device = device or jax.devices()[0]
  opt = profiler.OPTIMIZERS[optimizer]()
  # One stage of ``[start, end)`` (first when start == 0); the others only fix its position.
  partition = [r for r in ((0, start), (start, end), (end, spec.num_layers)) if r[0] < r[1]]
  position = partition.index((start, end))
  if is_last and end != spec.num_layers:
    partition = partition[:position + 1]
    spec = dataclasses.replace(spec, layers=spec.layers[:end])
  st = stages.build_stages(spec, partition, [device] * len(partition), opt)[position]
  x = jax.ShapeDtypeStruct((batch_size,) + tuple(spec.input_shape), spec.input_dtype)
  params, x_in = [], None
  for i, layer in enumerate(spec.layers[:end]):
    if i == start:
      x_in = x
    p = jax.eval_shape(layer.init, jax.random.key(0), x).get("params", {})
    if i >= start:
      params.append(p)
    x = jax.eval_shape(lambda p, a, layer=layer: layer.apply({"params": p}, a), p, x)
  opt_state = jax.eval_shape(opt.init, params)
  param_bytes, opt_bytes = profiler.tree_bytes(params), profiler.tree_bytes(opt_state)
  programs = {}
  if st.is_last:
    labels_shape = tuple(x.shape[:-1])  # the logits' shape less classes: [b], or [b, seq] for next-token targets
    labels = jax.ShapeDtypeStruct(labels_shape, jnp.int32)
    programs["forward_backward"] = _program_memory(st.forward_backward.lower(params, x_in, labels).compile())
  else:
    out, vjp = jax.eval_shape(st.forward, params, x_in)
    programs["forward"] = _program_memory(st.forward.lower(params, x_in).compile())
    programs["backward"] = _program_memory(st.backward.lower(vjp, out).compile())
  norm = jax.ShapeDtypeStruct((), jnp.float32)  # the minibatch's global gradient norm (read only when clipping)
  programs["update"] = _program_memory(st.update.lower(params, opt_state, params, params, norm).compile())
  resident = opt_bytes + param_bytes  # optimizer state and the gradient accumulator outside fwd/bwd's arguments
  peak = max(pm.total_bytes + (0 if name == "update" else resident) for name, pm in programs.items())
  return StageMemory(programs=programs, param_bytes=param_bytes, optimizer_state_bytes=opt_bytes,
                     peak_bytes=int(peak))
