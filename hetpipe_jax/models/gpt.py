"""GPT-style decoder-only transformers as layer lists: embedding, N pre-norm blocks, final norm + head.

Layer 0 maps int32 tokens ``[b, seq]`` to ``[b, seq, d_model]`` (token + learned position embeddings); each block is
one layer (``x + attn(LN(x))`` with causal self-attention, then ``x + MLP(LN(x))``; Radford et al. 2019, GPT-2 §2.3);
the last layer is LayerNorm + a linear head to ``[b, seq, vocab]`` logits. Cut points lie between any two layers, so
a stage holds whole blocks. Objective ``next_token`` (:mod:`hetpipe_jax.runtime.objectives`). No dropout: a stage is
a pure function of (weights, input) (HetPipe §4).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from hetpipe_jax.models.spec import ModelSpec

_INIT = nn.initializers.normal(stddev=0.02)


class TokenEmbed(nn.Module):
  """Token + learned position embedding. int32 ``[b, seq] -> [b, seq, d_model]`` float32."""

  vocab_size: int
  d_model: int
  max_len: int

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(self.vocab_size, self.d_model, embedding_init=_INIT, name="tokens")(tokens)
    pos = self.param("positions", _INIT, (self.max_len, self.d_model))
    return x + pos[None, :tokens.shape[1]]


class CausalSelfAttention(nn.Module):
  """Multi-head self-attention where position ``t`` attends to positions ``<= t``. ``[b, s, d] -> [b, s, d]``."""

  d_model: int
  num_heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    b, s, _ = x.shape
    head_dim = self.d_model // self.num_heads
    qkv = nn.Dense(3 * self.d_model, kernel_init=_INIT, name="qkv")(x)
    q, k, v = jnp.split(qkv.reshape(b, s, 3, self.num_heads, head_dim), 3, axis=2)
    q, k, v = (a[:, :, 0] for a in (q, k, v))  # [b, s, heads, head_dim]
    causal = jnp.tril(jnp.ones((s, s), bool))[None, None]  # [1, 1, s_q, s_k]
    out = nn.dot_product_attention(q, k, v, mask=causal)
    return nn.Dense(self.d_model, kernel_init=_INIT, name="out")(out.reshape(b, s, self.d_model))


class Block(nn.Module):
  """Pre-norm transformer block. ``[b, s, d] -> [b, s, d]``."""

  d_model: int
  num_heads: int
  mlp_ratio: int = 4

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + CausalSelfAttention(self.d_model, self.num_heads, name="attn")(nn.LayerNorm(name="ln1")(x))
    h = nn.Dense(self.mlp_ratio * self.d_model, kernel_init=_INIT, name="fc")(nn.LayerNorm(name="ln2")(x))
    return x + nn.Dense(self.d_model, kernel_init=_INIT, name="proj")(nn.gelu(h))


class Head(nn.Module):
  """Final LayerNorm and the output projection. ``[b, s, d] -> [b, s, vocab]`` logits."""

  vocab_size: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(self.vocab_size, kernel_init=_INIT, name="logits")(nn.LayerNorm(name="ln_f")(x))


def gpt(name: str, *, vocab_size: int, seq_len: int, d_model: int, num_heads: int, num_blocks: int) -> ModelSpec:
  """A decoder of ``num_blocks + 2`` layers (embedding, blocks, head) for int32 ``[b, seq_len]`` token inputs.

  Raises:
    ValueError: ``d_model`` not divisible by ``num_heads``, or a non-positive size.
  """
  if min(vocab_size, seq_len, d_model, num_heads, num_blocks) < 1 or d_model % num_heads:
    raise ValueError(f"gpt {name}: sizes must be positive and d_model ({d_model}) divisible by num_heads "
                     f"({num_heads})")
  layers = ((TokenEmbed(vocab_size, d_model, seq_len),) +
            tuple(Block(d_model, num_heads) for _ in range(num_blocks)) + (Head(vocab_size),))
  return ModelSpec(name, layers, (seq_len,), vocab_size, input_dtype="int32", objective="next_token")


def gpt_tiny() -> ModelSpec:
  """Byte-level, 16 tokens, d_model 32, 2 heads, 2 blocks (4 layers): for tests."""
  return gpt("gpt_tiny", vocab_size=256, seq_len=16, d_model=32, num_heads=2, num_blocks=2)


def gpt_bytes() -> ModelSpec:
  """Byte-level, 64 tokens, d_model 128, 4 heads, 4 blocks (6 layers, ~0.84 M parameters): the CPU LM config's."""
  return gpt("gpt_bytes", vocab_size=256, seq_len=64, d_model=128, num_heads=4, num_blocks=4)


GPT2_VOCAB = 50257
GPT2_CONTEXT = 1024


def gpt2_small() -> ModelSpec:
  """GPT-2 small shapes (Radford et al. 2019, Table 2: 12 blocks, d_model 768, 12 heads, ~163 M parameters with an
  untied head, 124 M tied), vocabulary 50,257, context 1,024. For planning and the GPU check
  (``scripts/gpu_check.sh``)."""
  return gpt("gpt2_small", vocab_size=GPT2_VOCAB, seq_len=GPT2_CONTEXT, d_model=768, num_heads=12, num_blocks=12)


def gpt2_medium() -> ModelSpec:
  """GPT-2 medium shapes (Radford et al. 2019, Table 2: 24 blocks, d_model 1024, 16 heads, ~355 M parameters with
  an untied head), BPE vocabulary 50,257, context 1,024. For planning (XLA cost analysis); tokens are BPE ids here,
  so ``test_bits_per_byte`` would be bits per token."""
  return gpt("gpt2_medium", vocab_size=GPT2_VOCAB, seq_len=GPT2_CONTEXT, d_model=1024, num_heads=16, num_blocks=24)


def gpt2_large() -> ModelSpec:
  """GPT-2 large shapes (36 blocks, d_model 1280, 20 heads, ~774 M parameters with an untied head), vocabulary
  50,257, context 1,024. For planning (XLA cost analysis)."""
  return gpt("gpt2_large", vocab_size=GPT2_VOCAB, seq_len=GPT2_CONTEXT, d_model=1280, num_heads=20, num_blocks=36)
