"""Eval metrics of a decomposition on one batch (SPEC §5.9, §5.11, §11).

Pure functions over one eval batch; the eval step (`eval_step`) maps them
over the held-out batches. `*l` is the batch's leading shape (`(B,)` toys,
`(B, T)` LMs). Counts are int32 per batch: one batch may hold at most 2^31
(position, component) entries per site; callers sum batches in int64.

The mask variants (`core.masks.VARIANTS`, built by
`core.masks.variant_site_masks`: CI-masked, unmasked, stochastic, rounded,
zero and random), each with every site live and routed, are compared with
the clean output through the target's divergence (KL for LMs, MSE for toys).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Key

from decompax.core import masks as masks_lib
from decompax.core.masks import SiteMask
from decompax.core.sites import SiteSpec
from decompax.core.stable_softmax import log_softmax

# Fixed histogram edges, so counts add exactly over any number of batches.
LOWER_EDGES = np.linspace(0.0, 1.0, 51)
PRE_EDGES = np.linspace(-4.0, 4.0, 81)
# Log-spaced CI bands over [1e-9, 1] (SPEC §11), plus an underflow column.
LOG_DENSITY_MIN = 1e-9
LOG_DENSITY_BINS = 18


def variant_forwards(
  forward: Callable[[str, dict[str, SiteMask]], Any],
  key: Key[Array, ""],
  ci_lower: dict[str, Float[Array, "*l c"]],
  sites: tuple[SiteSpec, ...],
  with_delta: bool,
  rounding_threshold: float,
) -> dict[str, Any]:
  """Return `forward(variant, masks)` under every mask variant, each drawn
  on its own key, so a caller that also wants activations of some variants
  takes them from the very forwards whose outputs it scores."""
  return {
    variant: forward(variant, masks_lib.variant_site_masks(
      variant, jax.random.fold_in(key, v), ci_lower, sites, with_delta,
      rounding_threshold))
    for v, variant in enumerate(masks_lib.VARIANTS)
  }


def variant_outputs(
  masked_forward: Callable[[dict[str, SiteMask]], Array],
  key: Key[Array, ""],
  ci_lower: dict[str, Float[Array, "*l c"]],
  sites: tuple[SiteSpec, ...],
  with_delta: bool,
  rounding_threshold: float,
) -> dict[str, Float[Array, "..."]]:
  """Return the target's output under every mask variant."""
  return variant_forwards(lambda _, masks: masked_forward(masks), key,
                          ci_lower, sites, with_delta, rounding_threshold)


def cross_entropy(
  logits: Float[Array, "*l v"], labels: Int[Array, "*l"]
) -> Float[Array, ""]:
  """Return the mean next-token cross entropy over labels `>= 0` (fp32).

  A negative label marks a position without a target (a sequence's last).
  """
  log_q = log_softmax(logits.astype(jnp.float32))
  valid = labels >= 0
  picked = jnp.take_along_axis(
    log_q, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
  count = jnp.maximum(jnp.sum(valid), 1)
  return -jnp.sum(jnp.where(valid, picked, 0.0)) / count


def ce_metrics(
  outputs: dict[str, Float[Array, "*l v"]],
  clean_logits: Float[Array, "*l v"],
  labels: Int[Array, "*l"],
) -> dict[str, Float[Array, ""]]:
  """Return CE of the clean model and, per variant, its CE difference.

  `ce_diff/<v> = CE(v) − CE(clean)`; `ce_unrecovered/<v>` divides that by
  the zero-ablation difference `CE(zero) − CE(clean)` (0: as good as clean,
  1: as bad as ablating every decomposed matrix).
  """
  clean = cross_entropy(clean_logits, labels)
  zero_gap = cross_entropy(outputs["zero"], labels) - clean
  out = {"ce/clean": clean}
  for variant, logits in outputs.items():
    diff = cross_entropy(logits, labels) - clean
    out[f"ce_diff/{variant}"] = diff
    out[f"ce_unrecovered/{variant}"] = diff / jnp.where(
      zero_gap == 0, 1.0, zero_gap)
  return out


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
