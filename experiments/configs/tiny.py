"""A seconds-long smoke run: tiny MLP, 2 VWs x 2 stages, Nm = 2, D = 1, 40 minibatches per VW.

  .venv/bin/mpiexec -n 3 .venv/bin/python -m mpi4py -m hetpipe_jax.train \
      --config=experiments/configs/tiny.py --workdir=runs/tiny
"""

from experiments.configs import default


def get_config():
  c = default.get_config()
  c.model = "mlp_tiny"
  c.plan = ""
  c.partition = ""
  c.batch_size = 32
  c.num_minibatches = 40
  c.log_every_waves = 5
  c.eval_every_epochs = 0.0
  c.lr_schedule = "constant"
  return c
