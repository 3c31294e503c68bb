"""A byte-level GPT language model under HetPipe on CPU: 2 VWs x 2 stages, Nm = 2, D = 1, Muon with weight
prediction, text from ``fortunes``.

``gpt_bytes`` (embedding, 4 pre-norm blocks of d_model 128, head; 64-byte context) on the Debian package ``fortunes``
(about 2.6 MB of English; every 20th 1 KiB block held out, its SHA-256 in config.json). Held-out loss is reported in
bits per byte (``test_bits_per_byte``) beside the corpus's unigram entropy (``dataset_info``); target: >= 40 % below
it within 15 minutes on a 2-core machine (measured: 2.54 bits/byte, 46.9 % below 4.79, in 7.9 minutes with set-up;
``experiments/lm_check.py``, docs/measurements/lm_fortunes.md). Run (from the repo root; ``CONFIG=... bash
scripts/run_main.sh`` also installs ``fortunes``):

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
  # HetPipe's two sources of staleness on: Nm = 2 inside each VW, D = 1 across VWs. Under Adam this model cannot take
  # them (600 minibatches: Nm 2, D 1 -> 4.50 bits/byte against 3.53 at Nm 1, D 0); Muon with its updates at Adam's
  # RMS and weight prediction from Muon's own next step can (1,000 per VW: 2.54 against Adam's 2.61 at Nm 1, D 0).
  # It still pays for them: Muon at Nm 1, D 0 reaches 2.42, and on 2 cores the stages cannot overlap, so Nm 1, D 0 is
  # also faster here (4.8 against 4.3 minibatches/s): --config.num_inflight=1 --config.staleness_bound=0
  # --config.weight_prediction=none (docs/measurements/lm_fortunes.md).
  c.num_inflight = 2
  c.staleness_bound = 1
  c.batch_size = 32  # windows of 64 bytes per minibatch
  c.optimizer = "muon"  # Muon on the blocks' matrices, NAdam on the embedding, head, norms and biases
  c.muon_consistent_rms = 0.2  # each orthogonalized update at Adam's RMS (optax's consistent_rms)
  c.weight_prediction = "optimizer"  # each minibatch runs on the weights its update will meet (Muon's next step)
  # Per VW: the PS adds both VWs' updates, so the global weights move about twice as far per round.
  c.learning_rate = 1e-3
  c.lr_schedule = "warmup_cosine"
  c.warmup_minibatches = 100
  c.num_minibatches = 1000  # per VW (2,000 minibatches, 4.1 M training tokens in all: about 1.7 epochs)
  c.eval_every_epochs = 0.25
  c.eval_batch_size = 500
  c.log_every_waves = 25
  return c
