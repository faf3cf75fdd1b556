"""The divergences a decoder LM's target reports between its clean and
masked forwards: the output KL (whole, per position, and chunked over the
head so no `[b, t, vocab]` logits are kept), the attention patterns' KL of
blocks with a decomposed q or k, and a mixture of experts' router KL. All in
fp32 (I14).
"""

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from decompax.core import target
from decompax.core.sites import SiteSpec
from decompax.core.stable_softmax import log_softmax
from decompax.targets import (
  glu_attention, glu_block, glu_config, glu_norms, glu_sites,
  glu_weights)


def kl_clean_to_masked(
  masked_logits: Float[Array, "*l v"], clean_logits: Float[Array, "*l v"]
) -> Float[Array, ""]:
  """Return `mean_ℓ KL(softmax(clean) ‖ softmax(masked))` in fp32 (I14).

  The same function as `losses.recon.kl_clean_to_masked`, which targets may
  not import (WORKSPACE.md); a test holds the two equal.
  """
  return jnp.mean(position_kl(masked_logits, clean_logits))


def position_kl(
  masked_logits: Float[Array, "*l v"], clean_logits: Float[Array, "*l v"]
) -> Float[Array, "*l"]:
  """Return `KL(softmax(clean) ‖ softmax(masked))` at each position, in
  fp32: what `kl_clean_to_masked` averages and `chunked_head_kl` sums."""
  log_p = log_softmax(clean_logits.astype(jnp.float32))
  log_q = log_softmax(masked_logits.astype(jnp.float32))
  return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def _position_chunks(
  x: Float[Array, "*l d"], chunk: int
) -> Float[Array, "n chunk d"]:
  """Return `x`'s positions flattened and cut into `chunk`-long rows, the
  last padded with zeros."""
  flat = x.reshape(-1, x.shape[-1])
  pad = -flat.shape[0] % chunk
  return jnp.pad(flat, ((0, pad), (0, 0))).reshape(-1, chunk, x.shape[-1])


def chunked_head_kl(
  head: Float[Array, "vocab d"], masked_x: Float[Array, "*l d"],
  clean_x: Float[Array, "*l d"], chunk: int, cap: Optional[float] = None,
) -> Float[Array, ""]:
  """Return `kl_clean_to_masked` of the logits `x·headᵀ` (soft-capped by
  `cap`, the model's final soft-cap, where it has one) of both final
  hidden states, `chunk` positions at a time (I14): each chunk's logits,
  log-softmaxes and KL exist only inside one step of a `lax.map`, and its
  backward recomputes them (`jax.checkpoint`), so no `[positions, vocab]`
  array is ever whole. A last chunk shorter than `chunk` is padded and its
  padding left out of the sum; the mean divides by the true count."""
  n = math.prod(masked_x.shape[:-1])
  keep = (jnp.arange(-(-n // chunk) * chunk) < n).reshape(-1, chunk)

  @jax.checkpoint
  def chunk_sum(args):
    xm, xc, kept = args
    kl = position_kl(glu_norms.softcap(jnp.einsum("nd,vd->nv", xm, head), cap),
                     glu_norms.softcap(jnp.einsum("nd,vd->nv", xc, head), cap))
    return jnp.sum(jnp.where(kept, kl, 0.0))

  sums = jax.lax.map(chunk_sum, (_position_chunks(masked_x, chunk),
                                 _position_chunks(clean_x, chunk), keep))
  return jnp.sum(sums) / n


def attention_blocks(sites: tuple[SiteSpec, ...]) -> tuple[int, ...]:
  """Return the layers with a decomposed q_proj or k_proj, ascending: the
  blocks whose attention pattern the eval compares (SPEC §11)."""
  parsed = [glu_weights.parse_site(s.name) for s in sites]
  return tuple(sorted({p[0] for p in parsed
                       if p is not None and p[1] in ("q", "k")}))


def attention_taps(blocks: tuple[int, ...]) -> tuple[str, ...]:
  """Return the taps `attention_divergence` reads from each forward: the
  scored blocks' q_proj and k_proj outputs, which every forward computes
  anyway, so tapping them leaves its logits bit for bit (I29)."""
  return tuple(f"{glu_weights.site_name(b, r)}.out" for b in blocks
               for r in ("q", "k"))


def attention_divergence(
  config: glu_config.GluConfig, seg: glu_weights.Segments,
  blocks: tuple[int, ...],
) -> target.AttentionDivergence:
  """Return `(weights, masked taps, clean taps) -> {"layers.<b>": KL}`: per
  scored block the mean KL of its clean attention rows to the masked ones
  (`glu_attention.attention_kl`), queries and keys rebuilt from the tapped
  projections with the block's own QK-norm, RoPE and mask (a sliding
  window's), scored with the model's scale and soft-cap."""

  scoring = config if glu_attention.custom_scores(config) else None

  def heads(weights, taps, b, rope):
    q, k = (taps[f"{glu_weights.site_name(b, r)}.out"] for r in ("q", "k"))
    # Scored blocks lie in the span: a row of its norm stack, not a copy
    # of a weight stack (I41).
    row = b - seg.split
    norms = [None if n is None else n[row]
             for n in (weights.span.q_norm, weights.span.k_norm)]
    return glu_attention.query_key_heads(q, k, *norms, config, rope)

  def divergence(weights, masked_taps, clean_taps):
    out = {}
    for b in blocks:
      t = clean_taps[f"{glu_weights.site_name(b, 'q')}.out"].shape[1]
      # One layer's tables and mask serve both forwards' heads.
      rope, mask = glu_attention.layer_attention(config, t,
                                                 b in config.local_layers)
      out[f"layers.{b}"] = glu_attention.attention_kl(
        *heads(weights, clean_taps, b, rope),
        *heads(weights, masked_taps, b, rope), scoring, mask)
    return out

  return divergence


def router_layers(config: glu_config.GluConfig,
                  sites: tuple[SiteSpec, ...]) -> tuple[int, ...]:
  """Return the mixture-of-experts layers whose router logits masking
  `sites` can move, ascending: the layers the router eval scores (design
  §11). A layer's router reads its block's attention-updated stream, so
  its own expert sites never move it; () for a dense model."""
  if not config.moe:
    return ()
  reaches = glu_sites.masking_reaches(config, sites)
  return tuple(i for i in range(config.n_layers)
               if reaches(glu_weights.router_tap(i)))


def router_divergence(layers: tuple[int, ...]) -> target.RouterDivergence:
  """Return `(masked taps, clean taps) -> {"layers.<i>": KL}`: per scored
  layer the mean KL of its clean router distribution to the masked one
  over positions (`glu_block.router_kl`), from the tapped logits."""

  taps = {f"layers.{i}": glu_weights.router_tap(i) for i in layers}

  def divergence(masked_taps, clean_taps):
    return {label: glu_block.router_kl(clean_taps[tap], masked_taps[tap])
            for label, tap in taps.items()}

  return divergence


def table_entries(
  config: glu_config.GluConfig, seg: glu_weights.Segments,
  sites: tuple[SiteSpec, ...],
) -> dict[str, Any]:
  """Return the function table's attention and router entries: the taps
  each divergence reads and the divergences, of the blocks with a
  decomposed query or key and of a mixture of experts' routers."""
  blocks = attention_blocks(sites)
  routed = router_layers(config, sites)
  return {
    "attention_taps": attention_taps(blocks),
    "attention_divergence": attention_divergence(config, seg, blocks),
    "router_taps": tuple(glu_weights.router_tap(i) for i in routed),
    "router_divergence": (router_divergence(routed) if config.moe
                          else None)}
