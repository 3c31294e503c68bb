"""Cost model of a pipeline stage: time and memory on a GPU type (HetPipe §4 "Model Partitioning", §7).

Costs layer: standard library and numpy only.

Time. A stage running layers ``[i, j)`` on a GPU of type ``t`` takes, per minibatch,
``compute_ms(i, j, t) + recv_ms(boundary i, link to the previous stage) + recv_ms(boundary j, link to the next
stage)``: forward+backward compute of its layers, receiving activations in the forward pass and gradients in the
backward pass (same bytes as the activations across that cut). Layer compute times are the measured profile times
when the profile was measured on the type's ``measured_device_kind`` (local runs), otherwise a roofline estimate
from XLA's cost analysis: ``max(flops / (peak_flops * compute_efficiency),
bytes_accessed / (memory_bandwidth * memory_efficiency))`` for the forward and the backward, where a GPU type's own
``roofline_efficiency`` (a calibration, :class:`~hetpipe_jax.costs.cluster.GpuType`) replaces both
efficiencies. Transfers use ``LinkSpec.transfer_time_s`` (peak bandwidth x scale-down constant + latency, HetPipe
§7).

Memory. A stage at position ``s`` of ``S`` with ``Nm`` minibatches in flight holds at most
``h = max_inflight_per_stage(S, Nm)[s]`` minibatches and needs
``params * (1 + versions) + optimizer state + gradient accumulator + h * (max(stash, input) + gradient)
+ (Nm - h) * input + workspace`` bytes, where ``versions = h`` on non-last stages (HetPipe §4: "for every
minibatch p, w_p must be kept in GPU memory until the backward pass for p is executed") and 0 on the last stage
(its forward+backward is one task that uses the current weights); ``input`` is the activation received at the
stage's first layer (queued minibatches whose forward has not started), ``gradient`` the gradient received at its
last layer, and ``workspace`` the temporary bytes beyond the stash: ``max over k in [i, j) of (transient_k -
stash of layers k+1..j-1)``. ``transient_k`` is what layer k's forward or backward needs besides the stash: XLA's
temporary-buffer bytes of its forward or backward (the larger) plus the activation gradients its backward receives
and produces (output- and input-sized; separate programs count them as arguments and outputs, a stage's one
program as temporaries; at the stage's last layer the received one is also the held ``gradient``). A layer's
backward runs after the backward of every later layer of the stage, which has consumed and freed their residuals,
so its temporaries reuse that memory (and in the forward, layer k runs before the later layers' residuals exist):
only the part of ``transient_k`` above what was freed adds to the stash.

Memory per method (``CostModelConfig.method``, :mod:`hetpipe_jax.rules.methods`; for the flush methods ``Nm`` is M,
the micro-batches per step, and the costs are built from the micro-batch profile,
``profile_format.micro_batch_profile``): the same formula with the method's held count
``h = methods.max_held_per_stage(...)`` and weight copies:

* ``hetpipe``: h = Nm on non-last stages (FIFO's safe bound), one weight version per held minibatch;
* ``pipedream``: h = K_0 = Nm (stage s holds Nm - s under 1F1B; the position-free bound is stage 0's), one
  stashed weight version per held minibatch (weight stashing);
* ``gpipe``: h = M (every micro-batch's stash at the end of the forwards), one weight copy plus the gradient
  accumulator; with ``remat`` (``jax.checkpoint`` per stage) a held micro-batch keeps only the stage's input and one
  micro-batch's stash exists at a time (during its recomputation);
* ``1f1b_flush``: h = min(S, M) (stage s holds min(S - s, M)), no versions;
* ``horovod``: one stage (the whole model), the last-stage formula: weights, the gradient buffer, the optimizer state
  and one minibatch's stash.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from hetpipe_jax.costs.cluster import ClusterSpec, GpuType
from hetpipe_jax.costs.profile_format import ModelProfile
from hetpipe_jax.rules import methods

MS_PER_S = 1e3
INFLIGHT_MEMORY = ("conservative", "schedule")
# Per ``Method.weight_copies``: the weight versions a non-last stage keeps besides its own, given (Nm or M, held).
_WEIGHT_COPIES = {
    "inflight": lambda num_inflight, held: num_inflight,  # HetPipe: one per minibatch in flight
    "held": lambda num_inflight, held: held,  # PipeDream: one stashed per minibatch the stage holds
    "none": lambda num_inflight, held: 0,  # flush: every micro-batch of a step uses the one version
}
INTRA = "intra"
INTER = "inter"


@dataclasses.dataclass(frozen=True)
class CostModelConfig:
  """Knobs of the cost model.

  Attributes:
    compute_efficiency: achieved / peak FLOP/s for roofline estimates. The default 0.5 is a documented,
      uncalibrated guess for cuDNN convolutions on the paper's GPUs; :func:`calibrate_efficiency` computes it
      for a device whose measured profile exists (the local CPU), and a measured profile on a GPU would do the
      same for that GPU type.
    memory_efficiency: achieved / peak memory bandwidth for roofline estimates (same calibration).
    precision: ``"fp32"`` or ``"fp16"``: which peak FLOP/s the roofline uses.
    weight_versions: keep one weight version per held minibatch on non-last stages (HetPipe §4; PipeDream's
      weight stashing); only for the methods that keep versions (``hetpipe``, ``pipedream``).
    gradient_accumulator: one params-sized buffer for the wave's aggregated update (WSP push, HetPipe §5), or the
      accumulated gradients the all-reduce reduces.
    method: the training method whose memory the model counts (module docstring).
    remat: rematerialisation per stage (``gpipe``, ``1f1b_flush``): a held micro-batch keeps only its input.
    inflight_memory: how many minibatches a ``hetpipe`` stage is counted to hold (:data:`INFLIGHT_MEMORY`):
      ``"conservative"`` (default): Nm on every non-last stage, safe whatever the task times
      (:func:`max_inflight_per_stage`); ``"schedule"``: each stage's peak under the schedule rules at the
      partition's own task times (:mod:`hetpipe_jax.sim.inflight_memory`), safe only while tasks take the
      plan's times (the runtime observes, does not enforce, what a stage holds).
  """

  compute_efficiency: float = 0.5
  memory_efficiency: float = 0.5
  precision: str = "fp32"
  weight_versions: bool = True
  gradient_accumulator: bool = True
  method: str = "hetpipe"
  remat: bool = False
  inflight_memory: str = "conservative"

  def __post_init__(self):
    methods.get_method(self.method)
    if self.inflight_memory not in INFLIGHT_MEMORY:
      raise ValueError(f"inflight_memory must be one of {list(INFLIGHT_MEMORY)}, got {self.inflight_memory!r}")
    if self.inflight_memory == "schedule" and not methods.get_method(self.method).schedule_peaks:
      raise ValueError(f"inflight_memory='schedule' is for method 'hetpipe' (FIFO rule); method {self.method!r} "
                       "has a closed-form held count: use inflight_memory='conservative'")
    for f in ("compute_efficiency", "memory_efficiency"):
      if not 0 < getattr(self, f) <= 1:
        raise ValueError(f"{f} must be in (0, 1], got {getattr(self, f)}")
    if self.precision not in ("fp32", "fp16"):
      raise ValueError(f"precision must be 'fp32' or 'fp16', got {self.precision!r}")


def max_inflight_per_stage(num_stages: int, num_inflight: int) -> list[int]:
  """Most minibatches each stage can hold at once under HetPipe's schedule rules (HetPipe §4).

  A stage *holds* minibatch p from the moment its forward task for p on that stage finishes until its backward
  task for p on that stage finishes (the activations/residuals it must keep for the backward). The last stage
  runs forward+backward of p as one task, so it holds p only while that task runs.

  Bound: ``[Nm] * (S - 1) + [1]`` (``[1]`` when ``S == 1``). At most ``Nm`` minibatches are in flight in the
  virtual worker and a minibatch is in flight while any stage holds it, so no stage holds more than ``Nm``; the
  last stage runs one task at a time, so it holds at most 1.

  Tight (no timing-independent bound is smaller, e.g. ``min(Nm, S - s)`` is not safe): for any non-last stage s,
  let stages ``0..s-1`` be fast and stage s slow. Minibatches 1..Nm are injected at once and reach stage s at
  times ~0; the backward of minibatch 1 becomes ready on stage s only after stage s finishes forward 1 and the
  later stages process it, i.e. later than forwards 2..Nm became ready. With forwards in order and FIFO among
  ready tasks, stage s runs forwards 1..Nm before any backward and holds all Nm. (With 1F1B-like timings the
  observed peak is closer to ``min(Nm, S - s)``; memory planning must use the safe bound.)

  Args:
    num_stages: S >= 1.
    num_inflight: Nm >= 1, minibatches in flight in the virtual worker.

  Returns:
    Per-stage bound, stage 0 first.

  Raises:
    ValueError: non-positive arguments.
  """
  if num_stages < 1:
    raise ValueError(f"num_stages must be >= 1, got {num_stages}")
  if num_inflight < 1:
    raise ValueError(f"num_inflight must be >= 1, got {num_inflight}")
  return [num_inflight] * (num_stages - 1) + [1]


def _roofline_ms(flops: float, bytes_accessed: float, gpu: GpuType, config: CostModelConfig) -> float:
  peak = gpu.peak_fp32_flops_per_s if config.precision == "fp32" else gpu.peak_fp16_flops_per_s
  compute_eff, memory_eff = config.compute_efficiency, config.memory_efficiency
  if gpu.roofline_efficiency is not None:  # a per-type calibration replaces both (GpuType.roofline_efficiency)
    compute_eff = memory_eff = gpu.roofline_efficiency
  t = max(flops / (peak * compute_eff), bytes_accessed / (gpu.memory_bandwidth_bytes_per_s * memory_eff))
  return t * MS_PER_S


def uses_measured_times(profile: ModelProfile, gpu: GpuType) -> bool:
  """Whether ``gpu``'s layer times come from ``profile``'s measurements rather than the roofline."""
  return (profile.measured and gpu.measured_device_kind is not None
          and gpu.measured_device_kind == profile.device_kind)


def layer_times_ms(profile: ModelProfile, gpu: GpuType, config: CostModelConfig) -> np.ndarray:
  """Forward+backward time of every layer on ``gpu``, in ms. Shape ``[num_layers]``.

  Measured times when :func:`uses_measured_times`, else the roofline estimate (see the module docstring).
  """
  if uses_measured_times(profile, gpu):
    return np.array([l.fwd_time_ms + l.bwd_time_ms for l in profile.layers], dtype=np.float64)
  return np.array([_roofline_ms(l.fwd_flops, l.fwd_bytes_accessed, gpu, config)
                   + _roofline_ms(l.bwd_flops, l.bwd_bytes_accessed, gpu, config) for l in profile.layers],
                  dtype=np.float64)


def calibrate_efficiency(profile: ModelProfile, gpu: GpuType) -> float:
  """The single efficiency e (used for both compute and memory) for which the roofline's total time over all
  layers equals the measured total on ``gpu``: ``e = sum(roofline at e=1) / sum(measured)``.

  Raises:
    ValueError: the profile has no measured times.
  """
  if not profile.measured:
    raise ValueError(f"profile of {profile.model!r} has no measured times to calibrate against")
  ideal = layer_times_ms(profile, dataclasses.replace(gpu, measured_device_kind=None),
                         CostModelConfig(compute_efficiency=1.0, memory_efficiency=1.0))
  measured = sum(l.fwd_time_ms + l.bwd_time_ms for l in profile.layers)
  return float(ideal.sum() / measured)


@dataclasses.dataclass(frozen=True)
class StageCosts:
  """Vectorised per-range costs of one model on one cluster (shared by every partitioner).

  Attributes:
    num_layers: L.
    compute_prefix_ms: GPU type name -> ``[L + 1]`` prefix sums of layer fwd+bwd time (ms).
    recv_ms: ``INTRA``/``INTER`` -> ``[L + 1]``: time to receive the activation (or gradient) at cut ``b``
      (between layers ``b-1`` and ``b``); 0 at ``b = 0`` and ``b = L`` (nothing crosses).
    boundary_bytes: ``[L + 1]``: bytes crossing cut b (``[0]`` is the input minibatch, ``[L]`` is 0).
    param_prefix, optimizer_prefix, stash_prefix: ``[L + 1]`` prefix sums (bytes).
    workspace_max: ``[L + 1, L + 1]``: the workspace of a stage running ``[i, j)``: XLA temp bytes beyond its
      stash (module docstring; 0 when ``j <= i``).
    capacity_bytes: GPU type name -> usable memory (memory_bytes - reserved_bytes).
    config: the cost-model configuration used.
    forward_prefix_ms: GPU type name -> ``[L + 1]`` prefix sums of the layers' forward time alone (ms), which splits a
      stage's compute into its forward and backward tasks (``inflight_memory="schedule"`` needs it); None when
      the costs were built by hand.
  """

  num_layers: int
  compute_prefix_ms: dict[str, np.ndarray]
  recv_ms: dict[str, np.ndarray]
  boundary_bytes: np.ndarray
  param_prefix: np.ndarray
  optimizer_prefix: np.ndarray
  stash_prefix: np.ndarray
  workspace_max: np.ndarray
  capacity_bytes: dict[str, int]
  config: CostModelConfig
  forward_prefix_ms: dict[str, np.ndarray] | None = None

  def compute_ms(self, gpu_type: str, i: int, j: int) -> float:
    p = self.compute_prefix_ms[gpu_type]
    return float(p[j] - p[i])

  def stage_time_ms(self, gpu_type: str, i: int, j: int, prev_link: str | None, next_link: str | None) -> float:
    """Time of a stage running layers ``[i, j)``; ``prev_link``/``next_link`` None at the pipeline's ends."""
    t = self.compute_ms(gpu_type, i, j)
    if prev_link is not None:
      t += float(self.recv_ms[prev_link][i])
    if next_link is not None:
      t += float(self.recv_ms[next_link][j])
    return t

  def compute_matrix_ms(self, gpu_type: str) -> np.ndarray:
    """``[L + 1, L + 1]``: compute time of ``[i, j)`` for ``i < j``, +inf elsewhere."""
    p = self.compute_prefix_ms[gpu_type]
    m = p[None, :] - p[:, None]
    m[np.tril_indices(self.num_layers + 1)] = np.inf
    return m

  def memory_matrix_bytes(self, is_last: bool, num_stages: int, num_inflight: int,
                          held: int | None = None) -> np.ndarray:
    """``[L + 1, L + 1]``: memory (bytes) of a stage running ``[i, j)`` (valid for ``i < j``), see module doc.

    ``held``: the minibatches the stage is counted to hold (``inflight_memory="schedule"``: the stage's peak under
    the schedule rules, :mod:`hetpipe_jax.sim.inflight_memory`); None: the method's closed form
    (``methods.max_held_per_stage``, stage 0's on non-last stages). A ``hetpipe`` non-last stage keeps Nm weight
    versions whatever ``held`` is: the runtime keeps each in-flight minibatch's version of every stage until the
    minibatch completes (``runtime.virtual_worker`` ``WeightVersion``), and in steady state every injection follows
    a completion, so the Nm in-flight minibatches use Nm distinct versions.

    Raises:
      ValueError: ``held`` outside ``[1, num_inflight]``.
    """
    method = methods.get_method(self.config.method)
    closed = methods.max_held_per_stage(method, num_stages, num_inflight)[-1 if is_last else 0]
    if held is None:
      held = closed
    elif not 1 <= held <= max(num_inflight, 1):
      raise ValueError(f"held={held} must be in [1, num_inflight={num_inflight}]")
    params = self.param_prefix[None, :] - self.param_prefix[:, None]
    opt = self.optimizer_prefix[None, :] - self.optimizer_prefix[:, None]
    stash = self.stash_prefix[None, :] - self.stash_prefix[:, None]
    inp = self.boundary_bytes[:, None].astype(np.float64)
    grad = np.where(np.arange(self.num_layers + 1) == self.num_layers, 0.0, self.boundary_bytes)[None, :]
    versions = self.config.weight_versions and not is_last
    copies = 1 + (_WEIGHT_COPIES[method.weight_copies](num_inflight, held) if versions else 0)
    copies += 1 if self.config.gradient_accumulator else 0
    if self.config.remat and method.remat:
      kept = held * (inp + grad) + stash  # inputs of the held micro-batches; one stash while recomputing
    else:
      kept = held * (np.maximum(stash, inp) + grad)
    return params * copies + opt + kept + (num_inflight - held) * inp + self.workspace_max

  def stage_memory_bytes(self, i: int, j: int, is_last: bool, num_stages: int, num_inflight: int,
                         held: int | None = None) -> float:
    return float(self.memory_matrix_bytes(is_last, num_stages, num_inflight, held)[i, j])


def build_stage_costs(profile: ModelProfile, cluster: ClusterSpec,
                      config: CostModelConfig = CostModelConfig()) -> StageCosts:
  """Precomputes :class:`StageCosts` for ``profile`` on every GPU type of ``cluster``."""
  layers = profile.layers
  n = len(layers)
  prefix = lambda v: np.concatenate([[0.0], np.cumsum(np.asarray(v, dtype=np.float64))])
  compute = {name: prefix(layer_times_ms(profile, t, config)) for name, t in cluster.gpu_types.items()}
  bbytes = np.array([profile.input_activation_bytes] + [l.output_activation_bytes for l in layers[:-1]] + [0],
                    dtype=np.float64)
  recv = {}
  for kind, link in ((INTRA, cluster.intra_node_link), (INTER, cluster.inter_node_link)):
    r = np.array([link.transfer_time_s(b) * MS_PER_S for b in bbytes])
    r[0] = r[n] = 0.0
    recv[kind] = r
  stash = prefix([l.stash_bytes for l in layers])
  return StageCosts(
      num_layers=n, compute_prefix_ms=compute, recv_ms=recv, boundary_bytes=bbytes,
      param_prefix=prefix([l.param_bytes for l in layers]),
      optimizer_prefix=prefix([l.optimizer_state_bytes for l in layers]),
      stash_prefix=stash,
      workspace_max=workspace_beyond_stash(
          [l.workspace_bytes + b + l.output_activation_bytes for l, b in zip(layers, bbytes)], stash),
      capacity_bytes={name: t.memory_bytes - t.reserved_bytes for name, t in cluster.gpu_types.items()},
      config=config, forward_prefix_ms=forward_prefix_ms(profile, cluster, config))


def workspace_beyond_stash(transient_bytes: list[float], stash_prefix: np.ndarray) -> np.ndarray:
  """``[L + 1, L + 1]``: ``w[i, j] = max over k in [i, j) of (transient_bytes[k] - (stash_prefix[j] -
  stash_prefix[k + 1]))`` for ``i < j``, else 0 (bytes): the temporaries of a stage running ``[i, j)`` beyond its
  stash (module docstring). Never below ``transient_bytes[j - 1]``.

  Args:
    transient_bytes: ``[L]`` what each layer's forward or backward needs besides the stash (module docstring).
    stash_prefix: ``[L + 1]`` prefix sums of the layers' stash bytes.
  """
  ws = np.asarray(transient_bytes, dtype=np.float64)
  n = len(ws)
  reach = ws + stash_prefix[1:]  # layer k's temporaries plus the stash up to and including layer k
  out = np.zeros((n + 1, n + 1))
  for i in range(n):
    out[i, i + 1:] = np.maximum.accumulate(reach[i:]) - stash_prefix[i + 1:]
  return out


def _forward_only(profile: ModelProfile) -> ModelProfile:
  """The profile with every backward cost zeroed, so :func:`layer_times_ms` gives forward times only."""
  layers = tuple(dataclasses.replace(l, bwd_time_ms=0.0 if l.bwd_time_ms is not None else None, bwd_flops=0.0,
                                     bwd_bytes_accessed=0.0) for l in profile.layers)
  return dataclasses.replace(profile, layers=layers)


def forward_prefix_ms(profile: ModelProfile, cluster: ClusterSpec, config: CostModelConfig) -> dict[str, np.ndarray]:
  """Per GPU type, ``[L + 1]`` prefix sums of the layers' forward times (ms): splits a stage's compute into its
  forward and backward tasks."""
  return {name: np.concatenate([[0.0], np.cumsum(layer_times_ms(_forward_only(profile), t, config))])
          for name, t in cluster.gpu_types.items()}


def vw_throughput_per_s(stage_times_ms: list[float], num_inflight: int) -> float:
  """Predicted minibatches/s of a virtual worker: ``min(1 / max stage time, Nm / round trip)``.

  Steady state of a pipeline with ``Nm`` minibatches in flight: the slowest stage bounds the rate, and by
  Little's law ``Nm`` in flight over a round trip of ``sum(stage times)`` (every stage's compute plus each cut's
  activation and gradient transfer) bounds it too. Stage times in ms.
  """
  if not stage_times_ms:
    raise ValueError("stage_times_ms is empty")
  if num_inflight < 1:
    raise ValueError(f"num_inflight must be >= 1, got {num_inflight}")
  return min(MS_PER_S / max(stage_times_ms), num_inflight * MS_PER_S / sum(stage_times_ms))


def saturating_num_inflight(stage_times_ms: list[float]) -> int:
  """Smallest Nm at which :func:`vw_throughput_per_s` reaches ``1 / max stage time`` for these stage times."""
  return max(1, math.ceil(sum(stage_times_ms) / max(stage_times_ms) - 1e-9))
