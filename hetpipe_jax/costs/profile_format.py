"""Per-layer model profiles (HetPipe §7; PipeDream's profiler output), saved as JSON and reused.

Written by ``hetpipe_jax.runtime.profiler`` (runtime layer, jax); read by the cost model (costs layer: stdlib only).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from hetpipe_jax.paths import REPO_ROOT, write_json

PROFILE_FORMAT_VERSION = 1
PROFILE_DIR = str(REPO_ROOT / "experiments" / "profiles")


@dataclasses.dataclass(frozen=True)
class LayerProfile:
  """One layer at one batch size.

  Attributes:
    name: ``"<index>:<class>"``.
    fwd_time_ms: measured forward time on the profiling device (median of repeats, compiled), or None when the
      profile was not executed (cost analysis only).
    bwd_time_ms: measured backward time (recomputes nothing: the vjp from saved residuals), or None.
    fwd_flops: forward FLOPs from XLA's cost analysis.
    bwd_flops: backward FLOPs (the vjp function applied to residuals) from XLA's cost analysis.
    fwd_bytes_accessed: bytes read+written by the forward per XLA's cost analysis.
    bwd_bytes_accessed: same for the backward.
    param_bytes: bytes of this layer's parameters.
    optimizer_state_bytes: bytes of the optimizer state for these parameters.
    output_activation_bytes: bytes of this layer's output for one minibatch: what crosses a cut after it (the
      gradient sent back has the same size).
    stash_bytes: bytes this layer keeps per in-flight minibatch from its forward until its backward (vjp
      residuals, parameters excluded).
    workspace_bytes: XLA temporary buffer bytes of the larger of the forward/backward computations.
  """

  name: str
  fwd_time_ms: float | None
  bwd_time_ms: float | None
  fwd_flops: float
  bwd_flops: float
  fwd_bytes_accessed: float
  bwd_bytes_accessed: float
  param_bytes: int
  optimizer_state_bytes: int
  output_activation_bytes: int
  stash_bytes: int
  workspace_bytes: int


@dataclasses.dataclass(frozen=True)
class ModelProfile:
  """All layers of one model at one batch size, on one profiling device.

  Attributes:
    model: registry name.
    batch_size: examples per minibatch.
    device_kind: where times were measured (``"cpu"``, ``"NVIDIA H100 80GB HBM3"``, ...).
    measured: whether ``fwd_time_ms``/``bwd_time_ms`` are present (False: cost analysis only).
    input_activation_bytes: bytes of one input minibatch (what stage 0 receives).
    optimizer: optimizer the state bytes were computed for (e.g. ``"momentum"``).
    layers: per-layer profiles, model order.
  """

  model: str
  batch_size: int
  device_kind: str
  measured: bool
  input_activation_bytes: int
  optimizer: str
  layers: tuple[LayerProfile, ...]

  @property
  def num_layers(self) -> int:
    return len(self.layers)


def profile_to_dict(profile: ModelProfile) -> dict[str, Any]:
  d = dataclasses.asdict(profile)
  d["layers"] = [dataclasses.asdict(layer) for layer in profile.layers]
  d["format_version"] = PROFILE_FORMAT_VERSION
  return d


def profile_from_dict(d: dict[str, Any]) -> ModelProfile:
  """Parses a profile dict.

  Raises:
    ValueError: wrong ``format_version`` or a missing field.
  """
  if d.get("format_version") != PROFILE_FORMAT_VERSION:
    raise ValueError(f"profile format_version {d.get('format_version')!r} != {PROFILE_FORMAT_VERSION}")
  try:
    layers = tuple(LayerProfile(**layer) for layer in d["layers"])
    return ModelProfile(model=d["model"], batch_size=int(d["batch_size"]), device_kind=d["device_kind"],
                        measured=bool(d["measured"]), input_activation_bytes=int(d["input_activation_bytes"]),
                        optimizer=d["optimizer"], layers=layers)
  except (KeyError, TypeError) as e:
    raise ValueError(f"malformed profile: {e}") from None


def default_profile_path(model: str, batch_size: int, device_kind: str, measured: bool) -> str:
  """``experiments/profiles/<model>_b<batch>_<device kind>[_costonly].json`` (kind lower-cased, spaces -> _)."""
  kind = device_kind.lower().replace(" ", "_").replace("/", "_")
  suffix = "" if measured else "_costonly"
  return os.path.join(PROFILE_DIR, f"{model}_b{batch_size}_{kind}{suffix}.json")


def save_profile(profile: ModelProfile, path: str) -> None:
  write_json(profile_to_dict(profile), path)


def load_profile(path: str) -> ModelProfile:
  with open(path) as f:
    return profile_from_dict(json.load(f))


def micro_batch_profile(profile: ModelProfile, num_microbatches: int) -> ModelProfile:
  """The profile of one micro-batch when a minibatch is split into ``num_microbatches`` (GPipe, 1F1B-flush).

  Per-example quantities scale by ``1 / M``: measured times, FLOPs, activation, stash and workspace bytes, and the
  bytes accessed beyond the layer's weights (a forward reads its parameters once, a backward reads them and writes
  their gradients once per micro-batch, whatever its size). Parameter and optimizer-state bytes do not scale.
  Linear scaling of times is an approximation: a GPU is less efficient on small micro-batches, so this is optimistic
  for large M (the roofline's weight traffic is the part that does not shrink).

  Raises:
    ValueError: ``num_microbatches`` < 1 or not a divisor of the batch size.
  """
  m = num_microbatches
  if m < 1 or profile.batch_size % m:
    raise ValueError(f"num_microbatches={m} must be >= 1 and divide the batch size {profile.batch_size}")
  if m == 1:
    return profile

  def scaled(v, fixed=0.0):
    if v is None:
      return None
    fixed = min(fixed, v)
    return fixed + (v - fixed) / m

  layers = tuple(dataclasses.replace(
      l, fwd_time_ms=scaled(l.fwd_time_ms), bwd_time_ms=scaled(l.bwd_time_ms), fwd_flops=l.fwd_flops / m,
      bwd_flops=l.bwd_flops / m, fwd_bytes_accessed=scaled(l.fwd_bytes_accessed, l.param_bytes),
      bwd_bytes_accessed=scaled(l.bwd_bytes_accessed, 2.0 * l.param_bytes),
      output_activation_bytes=l.output_activation_bytes // m, stash_bytes=l.stash_bytes // m,
      workspace_bytes=l.workspace_bytes // m) for l in profile.layers)
  return dataclasses.replace(profile, batch_size=profile.batch_size // m,
                             input_activation_bytes=profile.input_activation_bytes // m, layers=layers)
