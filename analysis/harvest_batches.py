"""The batches a harvest streams: token windows of a token file for
language models (their starts spread over the file or consecutive), the
toy's own input distribution for toys, a tagged token file's tag stream
beside its tokens (`tag_source`), and what one batch costs in memory.
"""

from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from decompax.analysis import explore, harvest_settings
from decompax.io import tokens as tokens_lib
from decompax.measures import tag_context, tag_profile
from decompax.placement import transfer
from decompax.targets import brown, brown_tags, registry


def _bytes(tree: Any) -> int:
  return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
             for leaf in jax.tree.leaves(tree))


def batch_bytes(run: explore.LoadedRun,
                settings: harvest_settings.Settings) -> int:
  """Return a floor on the bytes one harvested batch holds at once: its
  inputs, the clean output and every component's CI at each of its
  positions (float32), each as shaped, nothing of the forward between."""
  inputs = batch_shape(run, settings)
  output = jax.eval_shape(
    lambda w, x: run.target.clean_forward(w, x, ())[0], run.weights, inputs)
  components = sum(site.c for site in run.target.sites)
  ci = settings.batch_size * settings.seq_len * components * 4
  return _bytes(inputs) + _bytes(output) + ci


def memory_floor(run: explore.LoadedRun, settings: harvest_settings.Settings,
                 ablation_chunk: int) -> int:
  """Return a floor on the bytes a harvest of `settings` holds at once:
  one batch (`batch_bytes`), and where it measures ablation effects,
  `ablation_chunk` ablated forwards of it besides."""
  one = batch_bytes(run, settings)
  return one * (1 + (ablation_chunk if settings.ablation_batches else 0))


def batch_shape(run: explore.LoadedRun, settings: harvest_settings.Settings):
  """Return the shapes of one harvested batch (token ids `[B, T]`, or the
  toy's own inputs)."""
  if settings.data_path:
    return jax.ShapeDtypeStruct((settings.batch_size, settings.seq_len),
                                jnp.int32)
  return harvest_settings.toy_batch(run, settings.batch_size)


def window_starts(settings: harvest_settings.Settings, i: int, num_tokens: int
                  ) -> np.ndarray:
  """Return the starts of batch `i`'s windows in a token file of
  `num_tokens`: the harvest's windows tile the file without overlap,
  spread evenly over it (`io.tokens.spread_window_starts`), so no
  position is counted twice and no context is a top context twice; an
  older harvest's, drawn at random, as it drew them."""
  b = settings.batch_size
  if settings.windows != harvest_settings.SPREAD:
    return tokens_lib.window_starts(settings.seed, i, range(b), num_tokens,
                                    settings.seq_len)
  return tokens_lib.spread_window_starts(
    range(i * b, (i + 1) * b), settings.n_batches * b, num_tokens,
    settings.seq_len)


def window_positions(settings: harvest_settings.Settings, i: int,
                     num_tokens: int
                     ) -> np.ndarray:
  """Return the stream positions `[B, T]` of batch `i`."""
  return (window_starts(settings, i, num_tokens)[:, None]
          + np.arange(settings.seq_len))


def batch_source(run: explore.LoadedRun, settings: harvest_settings.Settings,
                 sharding: Any = None):
  """Return `batch(i)`: the i-th harvested batch, a pure function of the
  seed and `i` (so a resumed harvest reads what it would have), laid out
  by `sharding` (a batch's shardings; None: on the default device)."""
  if settings.data_path:
    try:
      opened = tokens_lib.open_tokens(settings.data_path,
                                     explore.vocab_size(run))
    except OSError as e:
      raise ValueError(f"data_path: {e}") from None
    if opened.header.num_tokens < settings.seq_len:
      raise ValueError(f"data_path: {settings.data_path} holds fewer tokens "
                       f"than one seq_len={settings.seq_len} sequence")
    n = opened.header.num_tokens
    read = lambda i: np.asarray(opened.ids[  # noqa: E731
      window_positions(settings, i, n)], np.int32)
    if sharding is None:
      return lambda i: jnp.asarray(read(i))
    # Straight from the host into each device's rows.
    return lambda i: transfer.put(read(i), sharding)
  toy = registry.get(run.config.target)
  key = jax.random.key(settings.seed)
  sample = lambda i: toy.sample_inputs(  # noqa: E731
    jax.random.fold_in(key, i), settings.batch_size)
  if sharding is None:
    return jax.jit(sample)
  # Each device draws its own rows; the partitionable counter-based RNG
  # draws the same batch however it is split.
  return jax.jit(sample, out_shardings=sharding)


class TagSource(NamedTuple):
  """A tag harvest's positions: `read(i)` gives batch `i`'s tags, previous
  tags and document groups (each laid out like the batch), `coarse_of`
  each tag's coarse class, `record` what the manifest says of them, `mix`
  each token id's class mix over the harvested positions
  (`token_mix`)."""

  read: Callable[[int], tuple[Any, Any, Any]]
  coarse_of: np.ndarray
  record: dict
  mix: np.ndarray


def tag_source(settings: harvest_settings.Settings, sharding: Any = None
               ) -> Optional[TagSource]:
  """Return the tag stream's positions of every harvested batch, the very
  windows `batch_source` reads (None without tag statistics)."""
  if not settings.tag_groups:
    return None
  try:
    opened = tokens_lib.open_tokens(settings.data_path)
  except OSError as e:
    raise ValueError(f"data_path: {e}") from None
  stream = tokens_lib.open_tags(opened)
  documents = np.asarray([d["start"] for d in stream.documents], np.int64)
  # The position before the stream's first one: a document starts there.
  before = (stream.tags.index(brown.EOS_TAG)
            if brown.EOS_TAG in stream.tags else 0)
  n = opened.header.num_tokens

  def read(i):
    index = window_positions(settings, i, n)
    tags, previous = tag_profile.position_tags(stream.ids, index, before)
    group = tag_profile.position_groups(documents, index,
                                        settings.tag_groups)
    if sharding is None:
      return tuple(map(jnp.asarray, (tags, previous, group)))
    return tuple(transfer.put(x, sharding) for x in (tags, previous, group))

  coarse_of = brown_tags.coarse_ids(stream.tags)
  record = {"tags": list(stream.tags), "classes": list(brown_tags.COARSE),
            "coarse_of": coarse_of.tolist(), "groups": settings.tag_groups,
            "documents": [d["name"] for d in stream.documents]}
  return TagSource(read, coarse_of, record,
                   token_mix(settings, opened, stream.ids, coarse_of))


def token_mix(settings: harvest_settings.Settings, opened: tokens_lib.Tokens,
              tag_ids: np.ndarray, coarse_of: np.ndarray) -> np.ndarray:
  """Return each token id's class mix `[vocab, classes]` over every
  position the harvest reads (a pass over the token and tag files only,
  before any unit is streamed; `measures/tag_context.py`)."""
  n = opened.header.num_tokens
  counts = np.zeros((opened.header.vocab_size, len(brown_tags.COARSE)),
                    np.int64)
  for i in range(settings.n_batches):
    index = window_positions(settings, i, n).reshape(-1)
    counts += tag_context.token_class_counts(
      np.asarray(opened.ids[index], np.int64),
      coarse_of[np.asarray(tag_ids[index], np.int64)], *counts.shape)
  return tag_context.class_given_token(counts)
