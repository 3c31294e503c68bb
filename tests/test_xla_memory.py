"""XLA's own accounting of a stage's memory (``runtime/xla_memory``) and the cost model against it on CPU (issue 28)."""

from __future__ import annotations

import jax
import pytest

from experiments import memory_vs_xla
from hetpipe_jax.models import load_model
from hetpipe_jax.runtime import profiler
from hetpipe_jax.runtime import stages
from hetpipe_jax.runtime import xla_memory


def test_stage_memory_reads_the_stage_programs():
  spec = load_model("mlp_tiny")
  first = xla_memory.stage_memory(spec, (0, 2), 512, is_last=False)  # activations outweigh the weights
  last = xla_memory.stage_memory(spec, (2, 4), 512, is_last=True)
  assert set(first.programs) == {"forward", "backward", "update"}
  assert set(last.programs) == {"forward_backward", "update"}
  # The forward's outputs are what jax returns: the activation and the VJP closure's leaves (the residuals).
  x = jax.ShapeDtypeStruct((512,) + tuple(spec.input_shape), spec.input_dtype)
  params = [jax.eval_shape(spec.layers[0].init, jax.random.key(0), x).get("params", {})]
  x1 = jax.eval_shape(lambda p, a: spec.layers[0].apply({"params": p}, a), params[0], x)
  params.append(jax.eval_shape(spec.layers[1].init, jax.random.key(0), x1).get("params", {}))
  st = stages.build_stages(spec, [(0, 2), (2, 4)], [jax.devices()[0]] * 2, profiler.OPTIMIZERS["momentum"]())[0]
  out = jax.eval_shape(st.forward, params, x)
  extra = first.programs["forward"].output_bytes - profiler.tree_bytes(out)
  assert 0 <= extra <= 8 * len(jax.tree.leaves(out))  # and the output tuple's table: one pointer per leaf on CPU
  assert first.param_bytes == profiler.tree_bytes(params) == first.optimizer_state_bytes  # momentum: one buffer
  resident = first.param_bytes + first.optimizer_state_bytes
  assert first.peak_bytes == max(first.programs["forward"].total_bytes + resident,
                                 first.programs["backward"].total_bytes + resident,
                                 first.programs["update"].total_bytes)
  assert first.peak_bytes > first.programs["update"].total_bytes  # set by the forward or backward here
  with pytest.raises(ValueError, match="layer_range"):
    xla_memory.stage_memory(spec, (2, 2), 8, is_last=True)
  with pytest.raises(ValueError, match="optimizer"):
    xla_memory.stage_memory(spec, (0, 2), 8, is_last=False, optimizer="lion")


@pytest.mark.parametrize("model,batch_size", [("cnn", 64), ("gpt_tiny", 8)])
def test_cost_model_within_20_percent_of_xla_on_two_stages(model, batch_size):
  # Both sides: a model that over-counts refuses plans that fit, one that under-counts admits plans that do not.
  rows = [r for r in memory_vs_xla.compare(model, batch_size) if r["num_stages"] == 2]
  assert len(rows) == 2
  for r in rows:
    assert 0.8 <= r["model_bytes"] / r["xla_bytes"] <= 1.2, r
