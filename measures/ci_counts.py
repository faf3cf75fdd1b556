"""Counts of CI over one batch (SPEC §11): firing, histograms,
log-density bands and top positions.

Pure functions; the eval step sums them over its held-out batches and a
harvest over its stream (`component_stats`). `*l` is the batch's leading
shape (`(B,)` toys, `(B, T)` LMs). Counts are int32 per batch: one batch may
hold at most 2^31 (position, component) entries per site; callers sum
batches in int64.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

# Fixed histogram edges, so counts add exactly over any number of batches.
LOWER_EDGES = np.linspace(0.0, 1.0, 51)
PRE_EDGES = np.linspace(-4.0, 4.0, 81)
# Log-spaced CI bands over [1e-9, 1] (SPEC §11), plus an underflow column.
LOG_DENSITY_MIN = 1e-9
LOG_DENSITY_BINS = 18


def firing_counts(
  ci: Float[Array, "*l c"], threshold: float
) -> Int[Array, " c"]:
  """Return per component the number of positions with CI above threshold."""
  fired = (ci > threshold).reshape(-1, ci.shape[-1])
  return jnp.sum(fired, axis=0, dtype=jnp.int32)


def histogram_counts(
  x: Float[Array, "..."], edges: Float[np.ndarray, " e"]
) -> Int[Array, " n"]:
  """Return `[below, bin_1 … bin_{e−1}, above]` counts of all entries of x.

  Bins are `[edge_i, edge_{i+1})` except the last, which also holds its right
  edge (as in `numpy.histogram`); `n = len(edges) + 1`.
  """
  edges = jnp.asarray(edges, x.dtype)
  flat = x.reshape(-1)
  index = jnp.searchsorted(edges, flat, side="right")
  n_edges = edges.shape[0]
  index = jnp.where(flat == edges[-1], n_edges - 1, index)
  return jnp.zeros((n_edges + 1,), jnp.int32).at[index].add(1)


def log_density_counts(
  ci: Float[Array, "*l c"], n_bins: int = LOG_DENSITY_BINS,
  floor: float = LOG_DENSITY_MIN,
) -> Int[Array, "c n"]:
  """Return per component the count of positions in each log-spaced CI band.

  Column 0 counts CI `< floor`; columns `1..n_bins` split `[floor, 1]` into
  bands of equal width in `log10`, the last holding CI = 1.
  """
  c = ci.shape[-1]
  flat = ci.reshape(-1, c).astype(jnp.float32)
  span = -np.log10(floor)
  scaled = (jnp.log10(jnp.maximum(flat, floor)) + span) / span * n_bins
  band = 1 + jnp.clip(jnp.floor(scaled).astype(jnp.int32), 0, n_bins - 1)
  band = jnp.where(flat < floor, 0, band)
  # A compare and a sum per band, not a scatter of one count per position
  # and component: an accelerator's scatter adds its updates one by one.
  return jnp.stack([jnp.sum(band == b, axis=0, dtype=jnp.int32)
                    for b in range(n_bins + 1)], axis=1)


def top_positions(
  ci: Float[Array, "*l c"], k: int
) -> tuple[Float[Array, "c k"], Int[Array, "c k"]]:
  """Return per component its `k` largest CI values and their flat positions."""
  flat = ci.reshape(-1, ci.shape[-1]).T
  values, index = jax.lax.top_k(flat, min(k, flat.shape[-1]))
  return values, index.astype(jnp.int32)
