"""What every component does over a stream of inputs: per-batch statistics
that add (or merge) across batches, for a harvest of a finished run.

Pure functions over one batch's lower CI `{site: [*l, C]}` (`*l` is `(B,)`
for toys, `(B, T)` for language models). Counts are int32 per batch, summed
by the caller in int64; the top-k contexts of a batch merge with the running
ones by CI (`merge_top`). Which component fires where, how strongly, and
with which others, needs only the CI; the ablation effect needs masked
forwards, one per component (`ablation_divergence`).
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from decompax.core import masks as masks_lib
from decompax.core.target import TargetFns
from decompax.measures import ci_counts

# Padding of token windows that run past a sequence's ends.
NO_TOKEN = -1


class BatchStats(NamedTuple):
  """One site's statistics of one batch."""

  fired: Int[Array, " c"]
  ci_sum: Float[Array, " c"]
  histogram: Int[Array, "c n"]
  coactive: Int[Array, "c c"]
  top_ci: Float[Array, "c k"]
  top_context: Array
  top_context_ci: Float[Array, "c k w"]


def coactivation_counts(ci: Float[Array, "*l c"], threshold: float
                        ) -> Int[Array, "c c"]:
  """Return how many positions fire each pair of components together (the
  diagonal: each component's own firing count)."""
  fired = (ci > threshold).reshape(-1, ci.shape[-1]).astype(jnp.float32)
  # Exact in fp32 while a batch holds under 2^24 positions.
  return jnp.round(fired.T @ fired).astype(jnp.int32)


def token_windows(
  tokens: Int[Array, "b t"], ci: Float[Array, "b t c"],
  flat_index: Int[Array, "c k"], before: int, after: int,
) -> tuple[Int[Array, "c k w"], Float[Array, "c k w"]]:
  """Return, per component and top position, the tokens from `before`
  positions before it to `after` after it, and that component's CI on each
  (`NO_TOKEN` and CI 0 past the sequence's ends).

  Two equal computations, one per platform: element and slice gathers are
  cheap on a CPU and the slowest part of a harvest on a TPU, where whole
  rows gathered and their windows selected by comparison take a seventh of
  the time (docs/performance.md, "The harvest beside a clean forward")."""
  gather = functools.partial(sliced_windows, before=before, after=after)
  select = functools.partial(selected_windows, before=before, after=after)
  return jax.lax.platform_dependent(tokens, ci, flat_index, cpu=gather,
                                    default=select)


def sliced_windows(
  tokens: Int[Array, "b t"], ci: Float[Array, "b t c"],
  flat_index: Int[Array, "c k"], before: int, after: int,
) -> tuple[Int[Array, "c k w"], Float[Array, "c k w"]]:
  """`token_windows` as one contiguous slice of a padded row per window."""
  t, w = tokens.shape[1], before + after + 1
  row, column = flat_index // t, flat_index % t
  padded_tokens = jnp.pad(tokens, ((0, 0), (before, after)),
                          constant_values=NO_TOKEN)
  planes = jnp.pad(jnp.moveaxis(ci, -1, 0), ((0, 0), (0, 0), (before, after)))

  def token_slice(r, col):
    return jax.lax.dynamic_slice(padded_tokens, (r, col), (1, w))[0]

  def ci_slice(plane, r, col):
    return jax.lax.dynamic_slice(plane, (r, col), (1, w))[0]

  window = jax.vmap(jax.vmap(token_slice))(row, column)
  window_ci = jax.vmap(jax.vmap(ci_slice, (None, 0, 0)))(planes, row, column)
  return window, window_ci


def selected_windows(
  tokens: Int[Array, "b t"], ci: Float[Array, "b t c"],
  flat_index: Int[Array, "c k"], before: int, after: int,
) -> tuple[Int[Array, "c k w"], Float[Array, "c k w"]]:
  """`token_windows` as each top position's whole row, gathered, with its
  window's positions picked out by comparison (sums of one term, exact)."""
  b, t = tokens.shape
  c = ci.shape[-1]
  row, column = flat_index // t, flat_index % t
  planes = jnp.moveaxis(ci, -1, 0).reshape(c * b, t)
  row_ci = planes[jnp.arange(c)[:, None] * b + row]            # [c, k, t]
  row_tokens = tokens[row]                                     # [c, k, t]
  at = column[..., None] + jnp.arange(-before, after + 1)      # [c, k, w]
  hit = at[..., None] == jnp.arange(t)                         # [c, k, w, t]
  window = jnp.sum(jnp.where(hit, row_tokens[:, :, None, :], 0), axis=-1)
  window_ci = jnp.sum(jnp.where(hit, row_ci[:, :, None, :], 0.0), axis=-1)
  inside = (at >= 0) & (at < t)
  return jnp.where(inside, window, NO_TOKEN), window_ci


def input_rows(
  inputs: Float[Array, "b n"], ci: Float[Array, "b c"],
  flat_index: Int[Array, "c k"],
) -> tuple[Float[Array, "c k n"], Float[Array, "c k 1"]]:
  """Return a toy's top inputs per component, and the CI on each."""
  component = jnp.arange(ci.shape[-1])[:, None]
  return inputs[flat_index], ci[flat_index, component][..., None]


def batch_stats(
  ci: Float[Array, "*l c"], inputs: Array, threshold: float, k: int,
  before: int = 0, after: int = 0,
) -> BatchStats:
  """Return one site's statistics of one batch. `inputs` are the batch's
  token ids `[B, T]` (contexts are token windows) or a toy's input rows
  `[B, n]` (contexts are the rows)."""
  ci = ci.astype(jnp.float32)
  c = ci.shape[-1]
  top_ci, flat_index = ci_counts.top_positions(ci, k)
  if ci.ndim == 3:
    context, context_ci = token_windows(inputs, ci, flat_index, before, after)
  else:
    context, context_ci = input_rows(inputs, ci, flat_index)
  return BatchStats(
    fired=ci_counts.firing_counts(ci, threshold),
    ci_sum=jnp.sum(ci.reshape(-1, c), axis=0),
    histogram=ci_counts.log_density_counts(ci),
    coactive=coactivation_counts(ci, threshold),
    top_ci=top_ci, top_context=context, top_context_ci=context_ci)


def merge_top(
  running: tuple[Array, Array, Array], batch: tuple[Array, Array, Array],
) -> tuple[Array, Array, Array]:
  """Return the `k` highest-CI contexts per component of two sets of
  `(top_ci [c, k], context [c, k, …], context_ci [c, k, w])`; ties keep the
  running ones first, so a harvest's result does not depend on where it
  resumed."""
  k = running[0].shape[1]
  values = jnp.concatenate([running[0], batch[0]], axis=1)
  _, order = jax.lax.top_k(values, k)

  def pick(r, b):
    both = jnp.concatenate([r, b], axis=1)
    index = order.reshape(order.shape + (1,) * (both.ndim - 2))
    return jnp.take_along_axis(both, index, axis=1)

  return tuple(pick(r, b) for r, b in zip(running, batch))


def add_stats(total: BatchStats, batch: BatchStats) -> BatchStats:
  """Return `total` with one more batch's statistics added (counts and sums
  add, top contexts merge)."""
  top = merge_top((total.top_ci, total.top_context, total.top_context_ci),
                  (batch.top_ci, batch.top_context, batch.top_context_ci))
  return BatchStats(total.fired + batch.fired, total.ci_sum + batch.ci_sum,
                    total.histogram + batch.histogram,
                    total.coactive + batch.coactive, *top)


def zero_stats(shape: BatchStats) -> BatchStats:
  """Return empty statistics shaped like `shape` (e.g. its `eval_shape`):
  zero counts, and top contexts that any real one displaces. Every array
  has its statistic's dtype, strongly typed, as a batch's own have: a
  weakly typed `-inf` fill would make a window that started empty another
  input type than one that has merged a batch, and a jitted accumulation
  compile twice per window."""
  zeros = lambda x: jnp.zeros(x.shape, x.dtype)
  return BatchStats(
    zeros(shape.fired), zeros(shape.ci_sum), zeros(shape.histogram),
    zeros(shape.coactive),
    jnp.full(shape.top_ci.shape, -jnp.inf, shape.top_ci.dtype),
    jnp.full(shape.top_context.shape, NO_TOKEN, shape.top_context.dtype),
    zeros(shape.top_context_ci))


def position_divergence(
  divergence: Callable, output: Float[Array, "..."], clean: Float[Array, "..."],
  lead: tuple[int, ...],
) -> Float[Array, "*l"]:
  """Return the target's divergence at every position of the lead shape
  (its `divergence` averages over positions; here each is its own)."""
  n = int(np.prod(lead))
  ones = (1,) * len(lead)
  flat_out = output.reshape(n, *ones, *output.shape[len(lead):])
  flat_clean = clean.reshape(n, *ones, *clean.shape[len(lead):])
  return jax.vmap(divergence)(flat_out, flat_clean).reshape(lead)


def ablation_divergence(
  target: TargetFns, weights, components, inputs, clean,
  lead: tuple[int, ...], site_of: Int[Array, " n"], index_of: Int[Array, " n"],
  chunk: int,
) -> Float[Array, "n *l"]:
  """Return, for each component `index_of[j]` of site `site_of[j]` (the
  site's place in `target.sites`), the divergence at each position from
  `clean` (the clean forward's output) when that component alone is
  ablated (mask 0, every other mask 1, delta path on: the unablated
  forward is the target).

  Components go through `lax.map` in batches of `chunk`, so memory stays
  that of `chunk` forwards however many components there are.
  """

  def one(pair):
    masks = masks_lib.one_ablated_site_masks(target.sites, *pair, lead)
    output = target.masked_forward(weights, components, inputs, masks)
    return position_divergence(target.divergence, output, clean, lead)

  return jax.lax.map(one, (site_of, index_of), batch_size=chunk)
