"""A byte-level GPT language model under HetPipe on CPU: 2 VWs x 2 stages, Nm = 2, D = 1, text from ``fortunes``.

``gpt_bytes`` (embedding, 4 pre-norm blocks of d_model 128, head; 64-byte context) on the Debian package ``fortunes``
(about 2.6 MB of English; every 20th 1 KiB block held out, its SHA-256 in config.json). Held-out loss is reported in
bits per byte (``test_bits_per_byte``) beside the corpus's unigram entropy (``dataset_info``); target: >= 40 % below
it within 15 minutes on a 2-core machine. Run (from the repo root; ``CONFIG=... bash scripts/run_main.sh`` also
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
  c.plan = ""  # no plan: 2 VWs x 2 stages, an even split of the 6 layers (0:3,3:6), Nm = 2
  c.partition = ""
  c.batch_size = 32  # windows of 64 bytes per minibatch
  c.optimizer = "adam"
  # Per VW: the PS adds both VWs' Adam updates, so the global weights move about twice as far per round.
  c.learning_rate = 2e-3
  c.lr_schedule = "warmup_cosine"
  c.warmup_minibatches = 100
  c.num_minibatches = 1000  # per VW (2,000 minibatches, 4.1 M training tokens in all: about 1.7 epochs)
  c.eval_every_epochs = 0.5
  c.eval_batch_size = 500
  c.log_every_waves = 25
  return c
