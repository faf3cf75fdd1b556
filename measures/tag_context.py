"""Whether a unit knows more than the token it sits on: its token-implied
purity, streamed beside its tag statistics (`tag_profile`;
`docs/tag_profiles.md`).

A token's class mix `P(class | token)` is counted over the harvested
positions themselves (a tag-only pass, `token_class_counts`, before the
units are streamed). A unit's **token-implied profile** is what its class
profile would be were its activity at a position spread over the classes
as that position's token is over all its occurrences:
`implied[u, c] = Σ_p a[p, u]·P(c | token_p)`. Its purity is the
**token-implied purity**; the **excess** is the measured purity minus it.
A unit that fires on a token whatever its tag there has excess about 0
(its measured profile is its token-implied one); a unit that fires on an
ambiguous token only where it carries one tag has a large excess.

Like the tag statistics, `implied` and `on` (the positions where a unit's
activity is above zero) are sums over positions, so batches add and a
harvest saves and resumes them; memory is units × classes. A batch sums in
fp32 on the device, the host totals in fp64 and int64.
"""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from decompax.measures import tag_metrics


class ContextStats(NamedTuple):
  """A unit set's streamed context statistics."""

  on: Int[Array, " u"]  # positions where the unit's activity is above 0
  implied: Float[Array, "u k"]  # its token-implied class profile


class ContextPurity(NamedTuple):
  """Per unit: measured purity, token-implied purity and their difference
  (NaN for a dead unit)."""

  purity: Float[np.ndarray, " u"]
  implied_purity: Float[np.ndarray, " u"]
  excess: Float[np.ndarray, " u"]


def token_class_counts(
  token_ids: Int[np.ndarray, "*l"], classes: Int[np.ndarray, "*l"],
  vocab: int, n_classes: int,
) -> Int[np.ndarray, "v k"]:
  """Return how often each token id carries each class (int64)."""
  counts = np.zeros((vocab, n_classes), np.int64)
  np.add.at(counts, (np.asarray(token_ids).reshape(-1),
                     np.asarray(classes).reshape(-1)), 1)
  return counts


def class_given_token(counts: Int[np.ndarray, "v k"]
                      ) -> Float[np.ndarray, "v k"]:
  """Return each token's class mix from its counts (a row of zeros for a
  token never seen, which no harvested position holds)."""
  counts = np.asarray(counts, np.float64)
  total = counts.sum(axis=1, keepdims=True)
  return counts / np.where(total > 0, total, 1.0)


def batch_context_stats(
  activity: Float[Array, "*l u"], token_ids: Int[Array, "*l"],
  mix: Float[Array, "v k"],
) -> ContextStats:
  """Return one batch's context statistics (fp32 sums, int32 counts)."""
  u = activity.shape[-1]
  a = activity.reshape(-1, u).astype(jnp.float32)
  at = mix.astype(jnp.float32)[token_ids.reshape(-1)]
  return ContextStats(
    on=jnp.sum(a > 0, axis=0, dtype=jnp.int32),
    implied=jnp.einsum("pu,pk->uk", a, at,
                       precision="highest"))


def zero_context_stats(n_units: int, n_classes: int) -> ContextStats:
  """Return empty host totals: int64 counts, fp64 sums."""
  return ContextStats(np.zeros(n_units, np.int64),
                      np.zeros((n_units, n_classes)))


def add_context_stats(total: ContextStats, batch: ContextStats
                      ) -> ContextStats:
  """Return host totals with one more batch added, in the totals' dtypes."""
  return ContextStats(*(np.add(t, np.asarray(b), dtype=t.dtype)
                        for t, b in zip(total, batch)))


def context_purity(counts: Float[np.ndarray, "u k"],
                   implied: Float[np.ndarray, "u k"]) -> ContextPurity:
  """Return every unit's measured purity (from its class counts), its
  token-implied purity and the excess of the first over the second."""
  measured, _ = tag_metrics.purity(counts)
  from_tokens, _ = tag_metrics.purity(implied)
  return ContextPurity(measured, from_tokens, measured - from_tokens)


def unit_context_purity(
  activity: Float[np.ndarray, "p u"], token_ids: Int[np.ndarray, " p"],
  classes: Int[np.ndarray, " p"], n_classes: int,
) -> ContextPurity:
  """Return purity, token-implied purity and excess of any units'
  activities over positions that carry token ids and classes, the token
  mix counted over these same positions: the measure a harvest streams,
  for unit sets made elsewhere (a transcoder's latents)."""
  activity = np.asarray(activity, np.float64)
  token_ids = np.asarray(token_ids, np.int64)
  classes = np.asarray(classes, np.int64)
  counts = np.zeros((activity.shape[1], n_classes))
  np.add.at(counts.T, classes, activity)
  mix = class_given_token(token_class_counts(
    token_ids, classes, int(token_ids.max(initial=-1)) + 1, n_classes))
  return context_purity(counts, activity.T @ mix[token_ids])
