"""Per-layer profiler: compute time, FLOPs, bytes, and memory of every layer of a registered model (HetPipe §7).

Runtime layer (jax). For each layer at a batch size: forward and backward time on the device at hand (jitted,
median of repeats; optional), FLOPs and bytes accessed from XLA's cost analysis of the compiled forward and
backward, parameter and optimizer-state bytes, output-activation bytes (what crosses a cut), the residual bytes
the layer keeps per in-flight minibatch for its backward, and XLA's temporary-buffer bytes. Layers with the same
configuration and input shape are compiled once. Nothing is executed when ``measure=False``, so ImageNet-sized
models are profiled from cost analysis alone.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any, Callable

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetpipe_jax.costs import profile_format
from hetpipe_jax.models import ModelSpec, load_model

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
}


def tree_bytes(tree: Any) -> int:
  return int(sum(np.prod(a.shape, dtype=np.int64) * np.dtype(a.dtype).itemsize
                 for a in jax.tree_util.tree_leaves(tree)))


def _cost(compiled: Any) -> tuple[float, float]:
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else {}
  ca = ca or {}
  return float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0))


def _temp_bytes(compiled: Any) -> int:
  try:
    return int(compiled.memory_analysis().temp_size_in_bytes)
  except Exception:  # pylint: disable=broad-except  # not every backend reports memory statistics
    return 0


def stash_bytes(fn: Callable, params: Any, x: Any) -> int:
  """Bytes of the vjp residuals of ``fn(params, x)`` that are not parameters (kept until the backward)."""
  try:
    from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=g-import-not-at-top
    res = saved_residuals(fn, params, x)
    return int(sum(np.prod(a.shape, dtype=np.int64) * np.dtype(a.dtype).itemsize
                   for a, why in res if "argument params" not in why))
  except Exception:  # pylint: disable=broad-except  # private API; fall back to an upper bound
    _, vjp_fn = jax.eval_shape(lambda p, a: jax.vjp(fn, p, a), params, x)
    return max(tree_bytes(vjp_fn) - tree_bytes(params), 0)


def _median_ms(fn: Callable, args: tuple, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # warm-up (compile)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


def profile_model(spec: ModelSpec, batch_size: int, *, measure: bool, repeats: int = 5,
                  optimizer: str = "momentum", device: jax.Device | None = None) -> profile_format.ModelProfile:
  """Profiles every layer of ``spec``.

  Args:
    spec: the model.
    batch_size: examples per minibatch.
    measure: run each layer's compiled forward/backward ``repeats`` times and record the median (ms); when
      False only XLA's cost analysis is used (nothing executes).
    repeats: timed repetitions per layer (after one warm-up call).
    optimizer: ``"sgd"``, ``"momentum"`` or ``"adam"``: what ``optimizer_state_bytes`` is computed for.
    device: device to profile on (default: ``jax.devices()[0]``).

  Returns:
    A :class:`profile_format.ModelProfile`.

  Raises:
    ValueError: unknown optimizer or non-positive batch size.
  """
  if optimizer not in OPTIMIZERS:
    raise ValueError(f"unknown optimizer {optimizer!r}: must be one of {sorted(OPTIMIZERS)}")
  if batch_size <= 0:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  device = device or jax.devices()[0]
  opt = OPTIMIZERS[optimizer]()
  x = jax.ShapeDtypeStruct((batch_size,) + tuple(spec.input_shape), spec.input_dtype)
  input_bytes = tree_bytes(x)
  cache: dict[tuple[str, tuple[int, ...]], profile_format.LayerProfile] = {}
  layers = []
  for i, layer in enumerate(spec.layers):
    name = f"{i}:{type(layer).__name__}"
    key = (repr(layer), tuple(x.shape))
    params = jax.eval_shape(layer.init, jax.random.key(0), x).get("params", {})
    fn = lambda params, a, layer=layer: layer.apply({"params": params}, a)
    y, vjp_fn = jax.eval_shape(lambda p, a, fn=fn: jax.vjp(fn, p, a), params, x)
    if key not in cache:
      fwd = jax.jit(fn)
      bwd = jax.jit(lambda v, g: v(g))
      fwd_c = fwd.lower(params, x).compile()
      bwd_c = bwd.lower(vjp_fn, y).compile()
      fwd_flops, fwd_bytes = _cost(fwd_c)
      bwd_flops, bwd_bytes = _cost(bwd_c)
      fwd_ms = bwd_ms = None
      if measure:
        rng = np.random.default_rng(i)
        p_real = jax.device_put(layer.init(jax.random.key(i), jnp.zeros(x.shape, x.dtype)).get("params", {}),
                                device)
        if jnp.issubdtype(x.dtype, jnp.floating):
          x_real = jax.device_put(rng.standard_normal(x.shape).astype(np.float32), device)
        else:  # token ids
          x_real = jax.device_put(rng.integers(0, spec.num_classes, x.shape).astype(x.dtype), device)
        fwd_ms = _median_ms(fwd, (p_real, x_real), repeats)
        _, vjp_real = jax.jit(lambda p, a, fn=fn: jax.vjp(fn, p, a))(p_real, x_real)
        g_real = jax.device_put(rng.standard_normal(y.shape).astype(np.float32), device)
        bwd_ms = _median_ms(bwd, (vjp_real, g_real), repeats)
      cache[key] = profile_format.LayerProfile(
          name=name, fwd_time_ms=fwd_ms, bwd_time_ms=bwd_ms, fwd_flops=fwd_flops, bwd_flops=bwd_flops,
          fwd_bytes_accessed=fwd_bytes, bwd_bytes_accessed=bwd_bytes, param_bytes=tree_bytes(params),
          optimizer_state_bytes=tree_bytes(jax.eval_shape(opt.init, params)),
          output_activation_bytes=tree_bytes(y), stash_bytes=stash_bytes(fn, params, x),
          workspace_bytes=max(_temp_bytes(fwd_c), _temp_bytes(bwd_c)))
      logging.info("[profiler] %s %s: fwd %.3g GFLOP, bwd %.3g GFLOP", spec.name, name, fwd_flops / 1e9,
                   bwd_flops / 1e9)
    layers.append(dataclasses.replace(cache[key], name=name))
    x = y
  return profile_format.ModelProfile(
      model=spec.name, batch_size=batch_size, device_kind=device.platform if device.platform == "cpu"
      else device.device_kind, measured=measure, input_activation_bytes=input_bytes, optimizer=optimizer,
      layers=tuple(layers))


def load_or_profile(model: str, batch_size: int, *, measure: bool, path: str | None = None,
                    refresh: bool = False, **kwargs: Any) -> profile_format.ModelProfile:
  """Loads the saved profile for (model, batch size, this device) or profiles the model and saves it.

  A measured profile also satisfies a request for a cost-analysis-only one.

  Args:
    model: registry name.
    batch_size: examples per minibatch.
    measure: whether layer times must be measured.
    path: explicit JSON path (default: ``profile_format.default_profile_path``).
    refresh: re-profile even when a saved profile exists.
    **kwargs: passed to :func:`profile_model`.

  Returns:
    The profile.
  """
  kind = jax.devices()[0].platform
  kind = kind if kind == "cpu" else jax.devices()[0].device_kind
  candidates = [path] if path else [profile_format.default_profile_path(model, batch_size, kind, True)]
  if not path and not measure:
    candidates.append(profile_format.default_profile_path(model, batch_size, kind, False))
  if not refresh:
    for c in candidates:
      if os.path.isfile(c):
        prof = profile_format.load_profile(c)
        if prof.model == model and prof.batch_size == batch_size and (prof.measured or not measure):
          return prof
  prof = profile_model(load_model(model), batch_size, measure=measure, **kwargs)
  out = path or profile_format.default_profile_path(model, batch_size, kind, measure)
  profile_format.save_profile(prof, out)
  logging.info("[profiler] wrote %s", out)
  return prof
