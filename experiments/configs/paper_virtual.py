"""The paper's 16-GPU cluster (4 VWs x 4 GPUs, ED) training the default CNN in virtual time on one CPU machine.

  .venv/bin/python -m hetpipe_jax.plan --cluster=hetpipe_paper --model=cnn --batch_size=64 --policy=ED \
      --num_vws=4 --output=experiments/plans/hetpipe_paper_cnn_b64_ed.json
  .venv/bin/python -m hetpipe_jax.train --mode=virtual --config=experiments/configs/paper_virtual.py \
      --workdir=runs/paper_virtual
"""

from experiments.configs import default


def get_config():
  c = default.get_config()
  c.plan = "experiments/plans/hetpipe_paper_cnn_b64_ed.json"
  c.emulate_plan = True  # task durations from the cost model for TITAN V / TITAN RTX / RTX 2060 / P4000
  c.staleness_bound = 1
  # The paper's WSP (HetPipe §5): the PS applies wave updates on receipt and a VW pulls only when the staleness
  # bound requires it (at the end of a wave, waiting for the reply).
  c.ps_apply = "on_receipt"
  c.pull_every_wave = False
  return c
