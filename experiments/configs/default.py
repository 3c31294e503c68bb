"""Default HetPipe job: 2 VWs x 2 stages on CPU devices, Nm = 2, D = 1, the default CNN on Fashion-MNIST.

Run (from the repo root):
  .venv/bin/mpiexec -n 3 .venv/bin/python -m mpi4py -m hetpipe_jax.train \
      --config=experiments/configs/default.py --workdir=runs/default
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Model and data.
  # A registry name (hetpipe_jax.models.available_models()) or "package.module:factory", a zero-argument function
  # returning a hetpipe_jax.models.ModelSpec (docs/usage.md, "Your own model and data").
  c.model = "cnn"
  # "fashion_mnist" | "text" (byte-level windows of the model's context length; hetpipe_jax/data/text.py) |
  # "package.module:factory", factory(config) returning a hetpipe_jax.data.dataset.ExampleDataset.
  c.dataset = "fashion_mnist"
  # fashion_mnist: "" -> $HETPIPE_DATA_DIR, then /usr/share/datasets/fashion-mnist. text: comma-separated files or
  # directories, "" -> /usr/share/games/fortunes (Debian package fortunes).
  c.data_dir = ""
  c.check_counts = True  # fashion_mnist: require the real 60,000 / 10,000 examples (False: any counts, for tests)
  c.seed = 0
  c.batch_size = 64  # minibatch size per VW (examples)
  # A plan from `python -m hetpipe_jax.plan --cluster=local_cpu --model=cnn --batch_size=64 --policy=ED
  # --num_vws=2 --output=experiments/plans/local_cpu_cnn_b64.json` decides the VWs, stages, partitions and Nm.
  # "" -> no plan: the layout comes from the fields below.
  c.plan = "experiments/plans/local_cpu_cnn_b64.json"
  # Plan-decided settings: unset (None) -> the plan's value (without a plan: 2 VWs, 2 stages, an even split, Nm 2).
  # Set with a plan, they must equal the plan's (an error names both otherwise); num_inflight may differ when it is
  # at most the plan's Max_m (memory). config.json records the values that ran and where each came from.
  c.num_virtual_workers = config_dict.placeholder(int)  # ranks = 1 PS + num_virtual_workers VWs
  c.num_stages = config_dict.placeholder(int)
  c.partition = config_dict.placeholder(str)  # "start:end" per stage, e.g. "0:3,3:7" ("a;b" per VW); "" = even
  c.num_inflight = config_dict.placeholder(int)  # Nm: minibatches in flight per VW; a wave is Nm minibatches
  c.stage_devices = ""  # local device index per stage, e.g. "0,1"; "" -> 0..num_stages-1 (or the plan's)
  c.platform = "cpu"  # "cpu" (each VW process gets forced host devices) or "gpu"
  c.num_cpu_devices = 0  # host devices per process on "cpu"; 0 -> as many as the stages need
  # Emulated heterogeneous devices: pad every task to the time it would take on the GPU its device stands in for.
  c.emulate_stage_ms = ""  # e.g. "20,80" (ms per minibatch per stage, every VW) or "20,80;40,40" (per VW)
  # True: the cost model's times for the plan's GPU types (needs config.plan). Unset: --mode=virtual takes them when
  # neither emulate_stage_ms nor timing_plan is given (it needs some times); under MPI, off. False: never.
  c.emulate_plan = config_dict.placeholder(bool)
  # --mode=virtual only: another plan whose cost-model times drive simulated time (e.g. the paper-scale ResNet-152
  # on hetpipe_paper) while config.model's numerics run on the config's layout, which must match it (method, VWs,
  # stages per VW, num_inflight, batch size). Needs config.plan = "". experiments/paper/convergence.py uses it.
  c.timing_plan = ""
  # Training method (hetpipe_jax.rules.methods): "hetpipe" (Nm in flight + WSP), "pipedream" (async 1F1B with
  # weight stashing + WSP; num_inflight defaults to NOAM), "gpipe" / "1f1b_flush" (num_inflight = M micro-batches
  # per step, one update at the flush, all-reduce BSP across VWs, no PS), "horovod" (one-stage VWs, all-reduce BSP).
  # The all-reduce methods run one MPI rank per VW (no PS rank).
  c.method = "hetpipe"
  c.vertical_sync = False  # pipedream: every stage uses the weight version stage 0 used for the minibatch
  # hetpipe / pipedream: "dc" corrects each stale gradient at its step by DC-ASGD's g + λ·g⊙g⊙(W_now − W_used)
  # (hetpipe_jax.runtime.delay_compensation); dc_lambda is λ (0.04: the DC-ASGD paper's constant λ₀, DC-ASGD-c).
  c.delay_compensation = "none"
  c.dc_lambda = 0.04
  # hetpipe / pipedream: "optimizer" runs minibatch p, forward and backward on every stage, on the weights its update
  # will meet, predicted from the optimizer's own next step: W - s * lr * d (SpecTrain / PipeOptim), s the updates
  # that land before p's own, d the step of adam / nadam / nadamw / momentum / muon from its current state
  # (hetpipe_jax.rules.weight_prediction); p's gradient then updates the current weights. "none": off.
  c.weight_prediction = "none"
  # hetpipe / pipedream: "pipemare" scales each minibatch's step by tau^-(1 - min(t/T, 1)) (PipeMare's learning-rate
  # rescheduling), tau its delay (updates since the weights it used; tau = 0: scale 1), t its step, T =
  # pipemare_warmup_minibatches (hetpipe_jax.rules.weight_prediction). "none": off.
  c.delay_scaled_lr = "none"
  c.pipemare_warmup_minibatches = 500
  c.remat = False  # gpipe / 1f1b_flush / horovod: rematerialise each stage's activations (jax.checkpoint)
  # HetPipe pipeline and WSP (HetPipe §4-§5).
  c.staleness_bound = 1  # D: a VW may run at most D waves ahead of the slowest
  # Pull policy. True (our refinement): also pull, without waiting, at every wave end, asking for what the next
  # wave needs, so VWs in step never wait for a pull. False (HetPipe §5): pull only when the bound D requires it,
  # at the end of a wave, and wait for the reply.
  c.pull_every_wave = True
  # How the PS applies wave updates. "on_receipt" (HetPipe §5): each VW's wave update is added to the global
  # weights when it arrives, so pulls also see faster VWs' newer waves. "clock_aligned": wave c is added once every
  # VW pushed it (deterministic order; an ablation).
  c.ps_apply = "on_receipt"
  # Staleness-aware wave updates at the PS (arXiv 1511.05950): "none" (HetPipe), "inverse" (each wave update times
  # 1/(1 + tau)) or "exp" (times exp(-ps_staleness_alpha * tau)); tau = waves of other VWs applied since the VW's
  # last pull reply (rules/wsp.ParameterServerState). hetpipe and pipedream with one PS shard.
  c.ps_staleness_scaling = "none"
  c.ps_staleness_alpha = 1.0
  # Sharded parameter servers (MPI jobs; HetPipe §8.1): ranks 0..S-1 are PS shards, each holding some layers.
  # Unset: one shard per node of the plan (1 without a plan: one PS on rank 0). config.json records the value.
  c.num_ps_shards = config_dict.placeholder(int)
  # Which shard holds each layer: "default" (round-robin, as TensorFlow), "local" (the shard of the node that runs
  # the layer; ED plans), "" -> the plan's choice ("default" without a plan).
  c.ps_placement = ""
  # Stage ranks (MPI jobs): a VW's stages on separate MPI ranks. False: one process per VW (ranks S..S+N-1). True:
  # rank S+v is VW v's driver and runs its first stage(s); one rank per further stage (grouping "gpu") or per further
  # plan node of the VW (grouping "node") follows the drivers, VW by VW. `python -m hetpipe_jax.launch --stage_ranks`
  # places them; config.json records both fields.
  c.stage_ranks = False
  c.stage_rank_grouping = "gpu"  # "gpu" (one rank per stage) | "node" (a VW's stages on one plan node share a rank)
  # Optimizer (optax), applied by every VW to its own minibatches.
  # "adam" | "nadam" (Nesterov Adam) | "nadamw" (NAdam + decoupled weight decay) | "muon" (optax.contrib.muon:
  # orthogonalized momentum on the 2-D hidden weights, i.e. Dense kernels outside the output layer; NAdamW on
  # embeddings, the head, norms, biases and conv kernels; hetpipe_jax/runtime/optimizers.py) | "sgd" | "momentum".
  # Every stage keeps its own optimizer state.
  c.optimizer = "adam"
  c.learning_rate = 1e-3
  c.lr_schedule = "cosine"  # "constant" | "cosine" (decays to 0 over each VW's minibatches) | "warmup_cosine"
  c.warmup_minibatches = 0  # warmup_cosine only (> 0): linear warm-up over this many of each VW's minibatches
  c.momentum = 0.9  # "momentum" only
  # adam / nadam / nadamw / muon (its Adam part): decay rates of the gradient's mean and second moment (optax's b1,
  # b2), each in [0, 1); b1 = 0.99 for delay-tolerant NAdam (Ajanthan et al., ICML 2025).
  c.adam_b1 = 0.9
  c.adam_b2 = 0.999
  c.weight_decay = 0.0  # nadamw / muon only (>= 0): decoupled weight decay, multiplied by the learning rate (optax)
  c.muon_beta = 0.95  # muon only: its momentum decay rate, in [0, 1)
  # muon only (>= 0): > 0 scales each orthogonalized update to this RMS per element (optax's consistent_rms; 0.2
  # matches AdamW's, so Muon's weights take the Adam learning rate: Liu et al., arXiv 2502.16982); 0 = optax's
  # width scaling sqrt(max(1, fan_out / fan_in)). 0.2 made gpt_bytes nearly delay-tolerant (lm_delay_sweep.md).
  c.muon_consistent_rms = 0.0
  c.grad_clip_norm = 0.0  # > 0: clip each minibatch's gradient to this norm over ALL stages (optax clip_by_global_norm
  # on the whole model, whatever the partition; the stages exchange their squared norms); 0 = off
  # Length, logging, evaluation.
  c.num_epochs = 5.0  # passes over the training set (all VWs together)
  c.num_minibatches = 0  # > 0: minibatches per VW instead of num_epochs (rounded down to whole waves)
  c.log_every_waves = 20  # a metrics.jsonl line every this many global-clock ticks
  c.eval_every_epochs = 1.0  # test-set evaluation on the PS
  c.eval_batch_size = 1000
  c.progress = True  # progress bar on rank 0
  c.save_task_trace = False  # write per-task dispatch/completion times (tasks.jsonl)
  # Checkpoints (orbax, under <workdir>/checkpoints/): every this many global-clock ticks a consistent cut (a WSP
  # barrier, docs/design.md) and at the end; 0: only the final weights. `--resume` continues from the newest. Unset:
  # 100 for the PS methods (hetpipe, pipedream), 0 for the all-reduce methods (they refuse a value above 0).
  c.checkpoint_every_waves = config_dict.placeholder(int)
  c.checkpoint_max_to_keep = 3
  # Progress watchdog on the PS (MPI jobs of the PS methods): a VW silent this many seconds while the PS owes it
  # nothing (hetpipe_jax/rules/watchdog.py) is hung; the job stops with an error naming it, so that
  # `python -m hetpipe_jax.launch --max_restarts=K` restarts it. 0: off (the launcher sets it with --max_restarts).
  c.ps_watchdog_s = 0.0
  # Fault drill: "vw:wave" puts a NaN into that VW's update of that wave, which the PS must refuse ("" = none).
  c.debug_nan_update = ""
  return c
