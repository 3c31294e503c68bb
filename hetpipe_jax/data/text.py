"""Byte-level text for language models: files or directories read as bytes, a fixed held-out split, token windows.

Numpy only. The corpus is every regular file under the named paths (directories recursively, sorted by path; files
holding a NUL byte, e.g. the ``.dat`` indexes beside fortune files, are skipped as binary), concatenated. It is cut
into blocks of :data:`BLOCK_BYTES`; block ``i`` is held out when ``i % EVAL_EVERY_BLOCKS == EVAL_EVERY_BLOCKS - 1``
(5 %, spread over the whole corpus), the rest is training text. Each held-out block and each run of training blocks
between them is cut into non-overlapping windows of ``seq_len + 1`` bytes: an example is ``window[:-1]`` (int32
tokens 0..255) and its targets ``window[1:]`` (the next bytes). So every example is contiguous text, no byte of the
held-out blocks is ever in a training example, and shards of windows share no byte.

Default corpus: the Debian package ``fortunes`` (about 2.6 MB of English quotations and jokes under
``/usr/share/games/fortunes``; plain text, DFSG-free, small enough to read in a second and large enough that a small
model does not memorise it in a 15-minute run). ``scripts/setup.sh`` installs it when a config names it.
"""

from __future__ import annotations

import hashlib
import math
import os
import pathlib

from absl import logging
import numpy as np

from hetpipe_jax.data.example_dataset import ExampleDataset
from hetpipe_jax.data.fashion_mnist import DataError

DEFAULT_TEXT_DIRS: tuple[pathlib.Path, ...] = (pathlib.Path("/usr/share/games/fortunes"),)
"""Read when ``config.data_dir`` is empty (Debian package ``fortunes``)."""
BLOCK_BYTES = 1024
EVAL_EVERY_BLOCKS = 20
VOCAB_SIZE = 256  # byte-level: one token per byte
_GET_HINT = ("apt-get install fortunes (scripts/setup.sh does this for experiments/configs/lm.py), or name text files "
             "or directories in config.data_dir (comma-separated)")


def parse_paths(data_dir: str | None) -> list[pathlib.Path]:
  """``config.data_dir`` for text: comma-separated files or directories; empty → :data:`DEFAULT_TEXT_DIRS`."""
  if not data_dir or not str(data_dir).strip():
    return list(DEFAULT_TEXT_DIRS)
  return [pathlib.Path(p.strip()) for p in str(data_dir).split(",") if p.strip()]


def _files_under(path: pathlib.Path) -> list[pathlib.Path]:
  if path.is_file():
    return [path]
  out = []
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for name in sorted(files):
      f = pathlib.Path(root) / name
      if f.is_file() and not f.is_symlink():  # fortune's *.u8 are symlinks to the same files
        out.append(f)
  return out


def read_corpus(paths: list[pathlib.Path]) -> tuple[bytes, list[str]]:
  """Concatenates the text files under ``paths`` (in the order given; directories sorted, recursively).

  Returns:
    ``(corpus bytes, the files read)``.

  Raises:
    DataError: a path does not exist, or no text was found; the message names ``config.data_dir`` and the fix.
  """
  chunks, used, skipped = [], [], []
  for path in paths:
    if not path.exists():
      raise DataError(f"config.data_dir: text path {path} does not exist; {_GET_HINT}")
    for f in _files_under(path):
      data = f.read_bytes()
      if b"\0" in data:
        skipped.append(f.name)
        continue
      chunks.append(data)
      used.append(str(f))
  if skipped:
    logging.info("[data] skipped %d binary files (%s)", len(skipped), ", ".join(skipped[:3] + ["..."][:len(skipped) > 3]))
  corpus = b"".join(chunks)
  if not corpus:
    raise DataError(f"config.data_dir: no text found under {[str(p) for p in paths]}; {_GET_HINT}")
  return corpus, used


def split_runs(corpus: bytes) -> tuple[list[bytes], list[bytes]]:
  """The fixed split as contiguous runs of the corpus: ``(training runs, held-out blocks)``, in corpus order.

  A training run is the text between two held-out blocks, so a training window never joins bytes that are not
  neighbours in the corpus.
  """
  train, held, run = [], [], []
  for i, start in enumerate(range(0, len(corpus), BLOCK_BYTES)):
    block = corpus[start:start + BLOCK_BYTES]
    if i % EVAL_EVERY_BLOCKS == EVAL_EVERY_BLOCKS - 1:
      held.append(block)
      train.append(b"".join(run))
      run = []
    else:
      run.append(block)
  train.append(b"".join(run))
  return [r for r in train if r], held


def split_corpus(corpus: bytes) -> tuple[bytes, bytes]:
  """The fixed split: ``(training bytes, held-out bytes)``, each the concatenation of its blocks in order."""
  train, held = split_runs(corpus)
  return b"".join(train), b"".join(held)


def windows(runs: list[bytes], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Non-overlapping windows of ``seq_len + 1`` bytes within each run (a run's last partial window is dropped), as
  ``(tokens, next tokens)``, int32 ``[n, seq_len]`` each."""
  parts = []
  for data in runs:
    n = len(data) // (seq_len + 1)
    parts.append(np.frombuffer(data, np.uint8, count=n * (seq_len + 1)).reshape(n, seq_len + 1))
  w = np.concatenate(parts).astype(np.int32) if parts else np.zeros((0, seq_len + 1), np.int32)
  return w[:, :-1].copy(), w[:, 1:].copy()


def unigram_entropy_bits(data: bytes) -> float:
  """Entropy of the byte frequencies of ``data`` in bits per byte (the best a context-free model can do on it)."""
  counts = np.bincount(np.frombuffer(data, np.uint8), minlength=VOCAB_SIZE).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log2(p)).sum())


def unigram_cross_entropy_bits(train: bytes, held_out: bytes) -> float:
  """Bits per byte of ``held_out`` under the training bytes' unigram frequencies (add-one smoothed)."""
  counts = np.bincount(np.frombuffer(train, np.uint8), minlength=VOCAB_SIZE).astype(np.float64) + 1.0
  logp = np.log2(counts / counts.sum())
  return float(-logp[np.frombuffer(held_out, np.uint8)].mean())


def load_text_dataset(paths: list[pathlib.Path], seq_len: int) -> ExampleDataset:
  """Reads the corpus, splits it and cuts both splits into windows.

  Args:
    paths: files or directories (:func:`parse_paths`).
    seq_len: tokens per example (the model's context length).

  Returns:
    An :class:`ExampleDataset`: int32 ``[n, seq_len]`` inputs and next-token targets; its description holds the
    files, byte counts, the split rule, the SHA-256 of the held-out and training bytes and the unigram baselines.

  Raises:
    DataError: missing paths, no text, or a split too small for one window.
  """
  if seq_len < 1:
    raise DataError(f"text: seq_len must be >= 1, got {seq_len}")
  corpus, files = read_corpus(paths)
  train_runs, held_blocks = split_runs(corpus)
  train, held = b"".join(train_runs), b"".join(held_blocks)
  x, y = windows(train_runs, seq_len)
  ex, ey = windows(held_blocks, seq_len)
  if ex.shape[0] < 1 or x.shape[0] < 1:
    raise DataError(f"config.data_dir: {len(corpus)} bytes of text are too few: each split (held out: every "
                    f"{EVAL_EVERY_BLOCKS}th block of {BLOCK_BYTES} bytes) needs at least one window of {seq_len + 1} "
                    "bytes; name more text")
  description = {
      "name": "text",
      "sources": [str(p) for p in paths],
      "num_files": len(files),
      "corpus_bytes": len(corpus),
      "train_bytes": len(train),
      "eval_bytes": len(held),
      "seq_len": seq_len,
      "split": f"blocks of {BLOCK_BYTES} bytes; block i held out when i % {EVAL_EVERY_BLOCKS} == "
               f"{EVAL_EVERY_BLOCKS - 1}; non-overlapping windows of seq_len + 1 bytes within each held-out block "
               "and each run of training blocks",
      "eval_sha256": hashlib.sha256(held).hexdigest(),
      "train_sha256": hashlib.sha256(train).hexdigest(),
      "unigram_entropy_bits_per_byte": unigram_entropy_bits(train),
      "eval_unigram_cross_entropy_bits_per_byte": unigram_cross_entropy_bits(train, held),
  }
  logging.info("[data] text: %d files, %d bytes (%d train windows, %d held-out windows of %d tokens); unigram "
               "entropy %.3f bits/byte", len(files), len(corpus), x.shape[0], ex.shape[0], seq_len,
               description["unigram_entropy_bits_per_byte"])
  if not math.isfinite(description["unigram_entropy_bits_per_byte"]):
    raise DataError("config.data_dir: the text's byte statistics are not finite")
  return ExampleDataset(x, y, ex, ey, description)
