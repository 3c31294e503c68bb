"""The byte-level GPT and the text dataset: causal masking, the replay oracle with Nm > 1, the next-token objective
against a numpy reference, the text loader's split and shards, and the LM config's smoke run under MPI."""

import hashlib
import json

import jax
import numpy as np
import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.data import sharding, text
from hetpipe_jax.jobs.evaluation import Evaluator
from hetpipe_jax.runtime.param_layout import ParamLayout
from tests.mpi_util import read_jsonl, run_job
from tests.pipeline_util import assert_params_close, build_vw, sequential_replay

SEQ = 16  # gpt_tiny's context


def test_causal_masking_later_tokens_do_not_change_earlier_logits():
  spec = models.get_model("gpt_tiny")
  params = models.init_layer_params(spec, jax.random.key(3))
  apply = jax.jit(lambda p, t: models.apply_layers(spec.layers, p, t))
  tokens = np.random.default_rng(0).integers(0, 256, (2, SEQ)).astype(np.int32)
  logits = np.asarray(apply(params, tokens))
  assert logits.shape == (2, SEQ, 256)
  for t in (0, 5, SEQ - 2):
    changed = tokens.copy()
    changed[:, t + 1:] = (changed[:, t + 1:] + 7) % 256  # every token after t
    other = np.asarray(apply(params, changed))
    np.testing.assert_array_equal(other[:, :t + 1], logits[:, :t + 1])
    assert np.max(np.abs(other[:, t + 1] - logits[:, t + 1])) > 1e-4  # ... and the change does reach position t+1


def _ref_log_softmax(z):
  z = z.astype(np.float64)
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_next_token_evaluation_matches_a_numpy_reference_in_bits_per_byte(text_dir):
  spec = models.get_model("gpt_tiny")
  params = jax.device_get(models.init_layer_params(spec, jax.random.key(1)))
  data = text.load_text_dataset([text_dir], SEQ)
  x, y = data.eval_inputs[:37], data.eval_targets[:37]  # 37: the last batch of 16 is padded
  layout = ParamLayout.from_layer_params(params)
  result = Evaluator(spec, layout, x, y, batch_size=16).evaluate(layout.flatten(params))
  logits = np.asarray(models.apply_layers(spec.layers, params, x))
  logp = np.take_along_axis(_ref_log_softmax(logits), y[..., None], -1)[..., 0]
  assert result["test_loss"] == pytest.approx(-logp.mean(), rel=1e-5)
  assert result["test_bits_per_byte"] == pytest.approx(-logp.mean() / np.log(2), rel=1e-5)
  assert result["test_accuracy"] == pytest.approx(np.mean(np.argmax(logits, -1) == y), abs=1e-9)


@pytest.mark.parametrize("num_inflight,partition", [(2, [(0, 2), (2, 4)]), (3, [(0, 1), (1, 3), (3, 4)])])
def test_replay_oracle_on_the_transformer(text_dir, num_inflight, partition):
  """A pipelined VW (Nm > 1, cuts between blocks) equals plain training where minibatch p's gradient is taken at its
  recorded weight version."""
  n = 12
  data = text.load_text_dataset([text_dir], SEQ)
  vw, source, params0, tx, _ = build_vw(None, model="gpt_tiny", partition=partition, num_inflight=num_inflight,
                                        optimizer=optax.sgd(0.3, momentum=0.9), batch_size=8, dataset=data)
  vw.run(n)
  versions = [r.version_local_updates for r in vw.records]
  assert any(v < p for p, v in enumerate(versions))  # pipelining really happened
  expected = sequential_replay(models.get_model("gpt_tiny"), params0, tx, [source.get(p) for p in range(n)],
                               versions)
  assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(params0))) > 1e-3
  assert_params_close(vw.layer_params(), expected, rtol=1e-5, atol=1e-6)


def test_text_split_is_fixed_and_held_out_bytes_never_trained_on(tmp_path):
  rng = np.random.default_rng(7)
  corpus = rng.integers(0, 256, 50_000).astype(np.uint8).tobytes().replace(b"\x00", b"\x01")  # random: 24-grams unique
  (tmp_path / "c.txt").write_bytes(corpus)
  data = text.load_text_dataset([tmp_path / "c.txt"], SEQ)
  again = text.load_text_dataset([tmp_path / "c.txt"], SEQ)
  np.testing.assert_array_equal(data.train_inputs, again.train_inputs)
  assert data.description == again.description
  # The held-out split, computed here from the rule: every 20th block of 1,024 bytes.
  blocks = [corpus[i:i + 1024] for i in range(0, len(corpus), 1024)]
  held = b"".join(b for i, b in enumerate(blocks) if i % 20 == 19)
  assert data.description["eval_sha256"] == hashlib.sha256(held).hexdigest()
  assert data.num_eval == sum(len(b) // (SEQ + 1) for i, b in enumerate(blocks) if i % 20 == 19)
  held_positions = {corpus.find(held[i:i + 24]) for i in range(0, len(held) - 24)}
  for v in range(2):  # every training example of both VWs' shards over two epochs
    shard = sharding.ShardedMinibatches(data, 2, v, 32, seed=0)
    for p in range(2 * shard.num_batches_per_epoch):
      xs, ys = shard.get(p)
      np.testing.assert_array_equal(xs[:, 1:], ys[:, :-1])  # targets are the next bytes
      for row in np.concatenate([xs, ys[:, -1:]], axis=1).astype(np.uint8):
        window = row.tobytes()
        assert window not in held and corpus.find(window) >= 0
        assert corpus.find(window[:24]) not in held_positions


def test_text_shards_are_disjoint_deterministic_windows(text_dir):
  data = text.load_text_dataset([text_dir], SEQ)
  assert data.description["num_files"] == 2  # the binary .dat file was skipped
  shards = [sharding.ShardedMinibatches(data, 2, v, 16, seed=5) for v in range(2)]
  assert not set(shards[0].shard) & set(shards[1].shard)
  assert len(set(shards[0].shard) | set(shards[1].shard)) == 2 * (data.num_train // 2)
  for p in (0, 3, shards[0].num_batches_per_epoch + 1):  # the same minibatch for the same (seed, shard, id)
    again = sharding.ShardedMinibatches(data, 2, 0, 16, seed=5).get(p)
    np.testing.assert_array_equal(again[0], shards[0].get(p)[0])


def test_missing_text_path_names_the_setting_and_the_fix(tmp_path):
  with pytest.raises(text.DataError, match=r"config.data_dir: text path .*nope does not exist; apt-get install "
                                           r"fortunes"):
    text.load_text_dataset([tmp_path / "nope"], SEQ)


@pytest.mark.mpi
def test_lm_config_smoke_under_mpi(tmp_path, text_dir):
  """experiments/configs/lm.py end to end over MPI (2 VWs x 2 stages), a few minibatches on a small corpus."""
  proc = run_job(tmp_path, 3, {"data_dir": str(text_dir), "num_minibatches": 4, "warmup_minibatches": 2,
                               "eval_every_epochs": 0},
                 config="experiments/configs/lm.py")
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["model"] == summary["model"] == "gpt_bytes" and config["dataset"] == "text"
  assert summary["objective"] == config["objective"] == "next_token"
  assert summary["partition"] == config["partition"] == "0:3,3:6"
  # The config's choice (HetPipe's staleness on: Nm = 2, D = 1; Muon at Adam's RMS with weight prediction) is what
  # ran and what config.json records as its source.
  assert summary["num_inflight"] == config["num_inflight"] == 2
  assert config["setting_sources"]["num_inflight"] == "config"
  assert summary["staleness_bound"] == config["staleness_bound"] == 1
  assert (config["optimizer"], config["learning_rate"], config["lr_schedule"]) == ("muon", 1e-3, "warmup_cosine")
  assert (config["muon_consistent_rms"], config["weight_prediction"]) == (0.2, "optimizer")
  assert summary["optimizer"]["muon_consistent_rms"] == 0.2
  info = config["dataset_info"]
  assert info["eval_sha256"] and 0 < info["unigram_entropy_bits_per_byte"] < 8
  assert summary["test_bits_per_byte"] == pytest.approx(summary["test_loss"] / np.log(2))
  records = read_jsonl(tmp_path / "minibatches.jsonl")
  assert len(records) == 8
  for r in records:  # HetPipe §4-5: minibatch p of a VW ran on its own first p - (Nm - 1) updates or more (never
    # its own p-th: not done yet), in wave p // Nm, on weights holding every VW's waves below its clock - D
    p = r["minibatch_id"]
    assert r["wave_id"] == p // 2 and max(0, p - 1) <= r["version_local_updates"] <= p
    assert r["version_global_clock"] >= r["local_clock_at_injection"] - 1
  assert (tmp_path / "metrics.png").exists()


def test_metrics_plot_shows_bits_per_byte_for_language_models(tmp_path):
  from hetpipe_jax.jobs import outputs
  lm = [{"minibatches": 4, "wall_time_s": 1.0, "loss": 3.0},
        {"minibatches": 8, "wall_time_s": 2.0, "loss": 2.5, "test_accuracy": 0.3, "test_bits_per_byte": 3.4}]
  image = [{"minibatches": 8, "wall_time_s": 2.0, "loss": 0.5, "test_accuracy": 0.8}]
  assert outputs.held_out_metric(lm) == ("test_bits_per_byte", "held-out bits per byte")
  assert outputs.held_out_metric(image) == ("test_accuracy", "test accuracy")
  path = tmp_path / "metrics.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in lm))
  assert outputs.plot_metrics(path, tmp_path / "m.png").stat().st_size > 5_000
