"""Token-file batches of LM runs: `--data_path`, `--eval_data_path`.

The training batch of step `s` is the window batch `(seed, s)` of the
training file (`io.tokens.read_batch`), so a resumed run reads exactly what
the interrupted one would have. Eval batch `i` is the window batch
`(eval_seed + EVAL_STREAM, i)` of the eval file (`eval_seed` from
`config.held_out_seed`), the same at every eval. Each process reads only
its own rows; the loop assembles the global batch on the step's input
sharding.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Int

from decompax.io import tokens as tokens_lib
from decompax.placement import transfer
from decompax.recipe.config import held_out_seed

# Offsets the eval stream's seed so its windows never repeat training's
# window sequence, even when both read one file.
EVAL_STREAM = 0xE7A1 << 32


class TokenData(NamedTuple):
  """The opened token files of a run and the batch geometry."""

  train: tokens_lib.Tokens
  eval: tokens_lib.Tokens
  seed: int
  eval_seed: int
  batch_size: int
  seq_len: int


def open_data(config, vocab_size: int) -> TokenData | None:
  """Return the run's token files, or None without `--data_path`.

  Raises:
    ValueError: a file is missing, malformed, tokenized for a larger
      vocabulary, holds ids past its header's vocabulary, or is shorter
      than one sequence.
  """
  if not config.data_path:
    return None
  return open_files(config.data_path, config.eval_data_path, vocab_size,
                    config.seed, held_out_seed(config), config.batch_size,
                    config.seq_len)


def open_files(path: str, eval_path: str | None, vocab_size: int, seed: int,
               eval_seed: int, batch_size: int, seq_len: int) -> TokenData:
  """Return one stream's token files (training, held-out: the training
  file's own windows without `eval_path`); raises as `open_data`."""
  train = tokens_lib.open_tokens(path, vocab_size)
  held_out = train
  if eval_path:
    held_out = tokens_lib.open_tokens(eval_path, vocab_size)
  for opened in (train, held_out):
    if opened.header.num_tokens < seq_len:
      raise ValueError(
        f"token file {opened.path} holds {opened.header.num_tokens} tokens, "
        f"fewer than one --seq_len={seq_len} sequence; lower "
        "--seq_len or tokenize more text")
  tokens_lib.process_rows(batch_size, jax.process_index(),
                          jax.process_count())
  return TokenData(train, held_out, seed, eval_seed, batch_size, seq_len)


def describe(data: TokenData | None) -> str:
  """Return the console line saying where the run's batches come from."""
  if data is None:
    return "[data] uniform random token ids (pass --data_path=NAME.bin)"
  header = data.train.header
  line = (f"[data] {data.train.path}: {header.num_tokens:,} tokens, "
          f"{header.num_documents:,} documents")
  if data.eval is data.train:
    return line + ("; eval windows from the same file (pass "
                   "--eval_data_path for held-out text)")
  return line + f"; eval from {data.eval.path}"


def _rows(tokens: tokens_lib.Tokens, data: TokenData, seed: int,
          index: int) -> Int[np.ndarray, "rows t"]:
  return tokens_lib.read_batch(tokens, seed, index, data.batch_size,
                               data.seq_len, jax.process_index(),
                               jax.process_count())


def _to_global(rows: np.ndarray, sharding: Any) -> jax.Array:
  if sharding is None:
    return jnp.asarray(rows)
  return transfer.global_batch(rows, sharding)


def train_batch(data: TokenData, step: int, sharding: Any = None) -> jax.Array:
  """Return the global training batch `[B, T]` of `step`."""
  return _to_global(_rows(data.train, data, data.seed, step), sharding)


def eval_batches(data: TokenData, n_batches: int,
                 sharding: Any = None) -> jax.Array:
  """Return the held-out batches stacked `[n_batches, B, T]`."""
  seed = data.eval_seed + EVAL_STREAM
  return jnp.stack([_to_global(_rows(data.eval, data, seed, i), sharding)
                    for i in range(n_batches)])


def example_batch(data: TokenData) -> jax.ShapeDtypeStruct:
  """Return the global batch's shape, for compiling and placing the step."""
  return jax.ShapeDtypeStruct((data.batch_size, data.seq_len), jnp.int32)
