"""Part-of-speech tag statistics of units over a tagged token stream: the
sufficient statistics of every tag profile, accumulated batch by batch.

A unit is anything with a non-negative activity at each position: a
component (its CI), an MLP neuron or a head (`unit_activity`). Each
position carries a fine tag id (into a tag stream's vocabulary, `f`
tags), the fine tag of the position before it, and a document group.
`coarse_of[f]` maps fine tags to `k` coarse classes.

Per batch, with `a[p, u]` the activity of unit `u` at position `p`:
- `fine[u, t] = Σ_p a[p, u]·[tag_p = t]`;
- `coarse[g, u, c] = Σ_p a[p, u]·[group_p = g]·[class_p = c]`, the class
  profile per document group, so a bootstrap can resample documents;
- `bigram[u, c', c] = Σ_p a[p, u]·[class_{p−1} = c']·[class_p = c]`;
- `base_fine[t]` and `base_coarse[g, c]`: how many positions carry each
  tag (each class, per group), the base rates.
A unit's total activity is `coarse.sum((0, 2))`: every position has
exactly one class. Everything is a sum over positions, so statistics of
two batches add (`add_tag_stats`) and a harvest can save and resume them;
memory is units × tags, never positions. A batch sums in fp32 on the
device; the host totals are fp64 and int64 (`zero_tag_stats`).

Document groups: document `d` (its index in the token file) is in group
`d mod n_groups`; with `n_groups` at least the number of documents, each
group is one document.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


class TagStats(NamedTuple):
  """Tag statistics of one set of units (one site, one layer's neurons)."""

  fine: Float[Array, "u f"]
  coarse: Float[Array, "g u k"]
  bigram: Float[Array, "u k k"]
  base_fine: Int[Array, " f"]
  base_coarse: Int[Array, "g k"]


def dense_sums() -> bool:
  """Whether the activity sums run as one-hot matmuls: on accelerators,
  whose scatters add their updates row by row and whose matrix units make
  a `[n, p] @ [p, u]` product nearly free; on a CPU the scatter does less
  work."""
  return jax.default_backend() != "cpu"


def _segment_sum(values: Array, segment: Int[Array, " p"], n: int,
                 dense: bool = False) -> Array:
  """Return `values` summed per segment `[n, …]`; `dense`: as a one-hot
  product, at full fp32 precision (the one-hot factor is exact)."""
  if not dense:
    return jax.ops.segment_sum(values, segment, num_segments=n)
  one_hot = jax.nn.one_hot(segment, n, dtype=values.dtype)
  return jnp.einsum("pn,pu->nu", one_hot, values,
                    precision=jax.lax.Precision.HIGHEST)


def batch_tag_stats(
  activity: Float[Array, "*l u"], tags: Int[Array, "*l"],
  previous: Int[Array, "*l"], group: Int[Array, "*l"],
  coarse_of: Int[Array, " f"], n_classes: int, n_groups: int,
  dense: bool | None = None,
) -> TagStats:
  """Return one batch's tag statistics (see the module docstring).

  `previous` is the fine tag of the position before each one in the
  stream (not in the window: a window's first position has one too).
  `dense` chooses how the activity sums run (None: `dense_sums()`).
  """
  dense = dense_sums() if dense is None else dense
  u, f = activity.shape[-1], coarse_of.shape[0]
  a = activity.reshape(-1, u).astype(jnp.float32)
  tags, previous, group = (x.reshape(-1) for x in (tags, previous, group))
  cls, prev_cls = coarse_of[tags], coarse_of[previous]
  at_group = group * n_classes + cls
  at_bigram = prev_cls * n_classes + cls
  ones = jnp.ones(tags.shape, jnp.int32)
  return TagStats(
    fine=_segment_sum(a, tags, f, dense).T,
    coarse=_segment_sum(a, at_group, n_groups * n_classes, dense)
    .reshape(n_groups, n_classes, u).transpose(0, 2, 1),
    bigram=_segment_sum(a, at_bigram, n_classes * n_classes, dense)
    .reshape(n_classes, n_classes, u).transpose(2, 0, 1),
    base_fine=_segment_sum(ones, tags, f),
    base_coarse=_segment_sum(ones, at_group, n_groups * n_classes)
    .reshape(n_groups, n_classes))


def zero_tag_stats(n_units: int, n_tags: int, n_classes: int,
                   n_groups: int) -> TagStats:
  """Return empty host totals: fp64 sums, int64 counts."""
  return TagStats(
    fine=np.zeros((n_units, n_tags)),
    coarse=np.zeros((n_groups, n_units, n_classes)),
    bigram=np.zeros((n_units, n_classes, n_classes)),
    base_fine=np.zeros(n_tags, np.int64),
    base_coarse=np.zeros((n_groups, n_classes), np.int64))


def add_tag_stats(total: TagStats, batch: TagStats) -> TagStats:
  """Return host totals with one more batch added, in the totals' dtypes."""
  return TagStats(*(np.add(t, np.asarray(b), dtype=t.dtype)
                    for t, b in zip(total, batch)))


def unit_mass(stats: TagStats) -> Float[np.ndarray, " u"]:
  """Return every unit's total activity."""
  return np.asarray(stats.coarse).sum(axis=(0, 2))


def class_counts(stats: TagStats) -> Float[np.ndarray, "u k"]:
  """Return every unit's activity per coarse class, over all groups."""
  return np.asarray(stats.coarse).sum(axis=0)


def concat_units(parts: list[TagStats]) -> TagStats:
  """Return the statistics of the union of unit sets harvested over the
  same positions (the total over sites); ValueError if their base counts
  differ, i.e. they saw other positions."""
  first = parts[0]
  for p in parts[1:]:
    if not (np.array_equal(p.base_fine, first.base_fine)
            and np.array_equal(p.base_coarse, first.base_coarse)):
      raise ValueError("unit sets saw different positions; their tag"
                       " statistics cannot be joined")
  return TagStats(
    fine=np.concatenate([p.fine for p in parts], axis=0),
    coarse=np.concatenate([p.coarse for p in parts], axis=1),
    bigram=np.concatenate([p.bigram for p in parts], axis=0),
    base_fine=first.base_fine, base_coarse=first.base_coarse)


def select_units(stats: TagStats, keep: np.ndarray) -> TagStats:
  """Return the statistics of the units `keep` (a mask or index array)
  picks, such as the alive components."""
  return stats._replace(fine=np.asarray(stats.fine)[keep],
                        coarse=np.asarray(stats.coarse)[:, keep],
                        bigram=np.asarray(stats.bigram)[keep])


def position_tags(
  tag_ids: np.ndarray, index: Int[np.ndarray, "*l"], before_start: int,
) -> tuple[Int[np.ndarray, "*l"], Int[np.ndarray, "*l"]]:
  """Return the tag of each stream position `index` and of the position
  before it (`before_start` for the stream's first position; the boundary
  tag fits, as a document starts there)."""
  index = np.asarray(index, np.int64)
  tags = np.asarray(tag_ids[index], np.int32)
  prev = np.asarray(tag_ids[np.maximum(index - 1, 0)], np.int32)
  return tags, np.where(index > 0, prev, before_start).astype(np.int32)


def position_groups(
  document_starts: Int[np.ndarray, " d"], index: Int[np.ndarray, "*l"],
  n_groups: int,
) -> Int[np.ndarray, "*l"]:
  """Return the document group of each stream position, from the offsets
  of each document's first token (ascending, the first 0)."""
  document = np.searchsorted(np.asarray(document_starts, np.int64),
                             np.asarray(index, np.int64), side="right") - 1
  return (document % n_groups).astype(np.int32)
