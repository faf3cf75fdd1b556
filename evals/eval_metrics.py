"""Eval metrics of a decomposition on one batch (SPEC §5.11, §11).

Pure functions over one eval batch; the eval step (`eval_step`) maps them
over the held-out batches. `*l` is the batch's leading shape (`(B,)` toys,
`(B, T)` LMs). The CI counts the eval sums beside them are
`measures.ci_counts`'s, shared with a harvest.

The mask variants (`core.masks.VARIANTS`, built by
`core.masks.variant_site_masks`: CI-masked, unmasked, stochastic, rounded,
zero and random), each with every site live and routed, are compared with
the clean output through the target's divergence (KL for LMs, MSE for toys).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Key

from decompax.core import masks as masks_lib
from decompax.core.masks import SiteMask
from decompax.core.sites import SiteSpec
from decompax.core.stable_softmax import log_softmax


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
