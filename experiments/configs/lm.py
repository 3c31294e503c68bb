"""A byte-level GPT language model under HetPipe on CPU: 2 VWs x 2 stages, Nm = 1, D = 0, text from ``fortunes``.

``gpt_bytes`` (embedding, 4 pre-norm blocks of d_model 128, head; 64-byte context) on the Debian package ``fortunes``
(about 2.6 MB of English; every 20th 1 KiB block held out, its SHA-256 in config.json). Held-out loss is reported in
bits per byte (``test_bits_per_byte``) beside the corpus's unigram entropy (``dataset_info``); target: >= 40 % below
it within 15 minutes on a 2-core machine (measured: 2.61 bits/byte, 45.5 % below 4.79, in 10.1 minutes with set-up;
docs/measurements/lm_fortunes.md). Run (from the repo root; ``CONFIG=... bash scripts/run_main.sh`` also
installs ``fortunes``):

  CONFIG=experiments/configs/lm.py WORKDIR=runs/lm bash scripts/run_main.sh

Smoke mode (seconds; CI): ``--config.num_minibatches=4 --config.eval_every_epochs=0``.
"""

from experiments.configs import default


def get_config():
  c = default.get_config()
  c.model = "gpt_bytes"
  c.dataset = "text"
  c.data_dir = ""  # "" -> /usr/share/games/fortunes; or comma-separated files / directories of your own text
  c.plan = ""  # no plan: 2 VWs x 2 stages, an even split of the 6 layers (0:3,3:6)
  c.partition = ""
  # Nm = 1, D = 0: no stale gradient anywhere, which this model under Adam needs (docs/measurements/lm_fortunes.md):
  # a gradient one update old (Nm = 2 inside a VW, or the other VW's latest minibatch missing under D = 1) cuts the
  # loss drop per minibatch sharply (600 minibatches: Nm 2, D 1 -> 4.50 bits/byte, Nm 1, D 1 -> 3.92, Nm 1, D 0 ->
  # 3.53). On 2 cores the two VWs' tasks already keep both cores busy, so pipelining inside a VW buys little
  # (measured 3.3 minibatches/s at Nm 1, D 0 against 3.8 at Nm 2, D 1), and at D = 0 each VW pulls every wave.
  c.num_inflight = 1
  c.staleness_bound = 0
  c.batch_size = 32  # windows of 64 bytes per minibatch
  c.optimizer = "adam"
  # Per VW: the PS adds both VWs' Adam updates, so the global weights move about twice as far per round (2e-3 and
  # 3e-3 learned slower in 300-round runs).
  c.learning_rate = 1e-3
  c.lr_schedule = "warmup_cosine"
  c.warmup_minibatches = 100
  c.num_minibatches = 1000  # per VW (2,000 minibatches, 4.1 M training tokens in all: about 1.7 epochs)
  c.eval_every_epochs = 0.25
  c.eval_batch_size = 500
  c.log_every_waves = 25
  return c
