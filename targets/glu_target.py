"""A decoder LM's engine function table (`target_fns`): its clean and
masked forwards with taps, the live end sites' functions, and the labels.

The sites are `glu_sites`', the live scan `glu_kinds`', the divergences
`glu_divergence`'s and the checkpoint's arrays `glu_arrays`'; the forward
itself is `glu_lm`'s. The token embedding and the unembedding, when
decomposed, run as kinds of their own outside the scan (`end_fns`).
Masked forwards that see the clean pass's `resid.{split}` start there, so
the frozen prefix is never recomputed (SPEC §3.5, exact: I27).
"""

import functools
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from decompax.core import site_forward, target
from decompax.core.masks import SiteMask
from decompax.core.sites import Components, SiteSpec, validate_sites
from decompax.targets import (
  glu_attention, glu_block, glu_config, glu_divergence, glu_kinds, glu_lm,
  glu_sites, glu_weights)


def tapped_forwards(
  run: Callable, spec: glu_lm.ForwardSpec, site: glu_block.SiteFn,
  resume: Optional[str], extras: Callable,
) -> tuple[target.CleanForward, target.MaskedForwardTaps]:
  """Return the clean and the masked forward with taps that `run`
  (`glu_lm.forward`, or `glu_lm.final_hidden` to stop before the head)
  computes; a masked forward starts at the clean pass's `resume` tap where
  there is one (prefix sharing). `extras` gives the span's scanned inputs
  and the live end sites' functions (`end_fns`)."""

  def clean_forward(weights, tokens, wanted):
    weights = jax.lax.stop_gradient(weights)
    return run(weights, tokens, tuple(wanted), spec)

  def masked_forward_taps(weights, components, tokens, site_masks,
                          clean_taps, wanted):
    if resume is None:
      tokens = rerun_prefix(tokens, site_masks)
    start = None if resume is None else clean_taps.get(resume)
    span_extra, ends = extras(weights, components, site_masks)
    return run(weights, tokens, tuple(wanted), spec, site, span_extra,
               start, **ends)

  return clean_forward, masked_forward_taps


def rerun_prefix(tokens: Int[Array, "*lead t"],
                 site_masks: dict) -> Int[Array, "*lead t"]:
  """Return `tokens` as a value the compiler cannot prove equal across
  masked forwards: tied to each forward's masks by an optimization barrier,
  so that every forward without prefix sharing really reruns the frozen
  prefix. Without it a compiler may merge the reruns, identical
  computations of identical operands, into one (XLA's TPU compiler does so
  even with its CSE pass disabled), and the cost sharing saves would not be
  measured."""
  return jax.lax.optimization_barrier((tokens, site_masks))[0]


def token_labels(tokens: Int[Array, "b t"]) -> Int[Array, "b t"]:
  """Return next-token labels, −1 at each sequence's last position."""
  pad = jnp.full((tokens.shape[0], 1), -1, tokens.dtype)
  return jnp.concatenate([tokens[:, 1:], pad], axis=1)


def start_key(seg: glu_weights.Segments) -> Optional[str]:
  """Return the tap a masked forward starts from, None without a prefix."""
  return f"resid.{seg.split}" if seg.split > 0 else None


def end_fns(
  sites: tuple[SiteSpec, ...], components: Components,
  site_masks: dict[str, SiteMask], dtype: Any,
) -> dict[str, Callable]:
  """Return `glu_lm.forward`'s live `embed_fn` and `head_fn` for the end
  sites that are live in `site_masks` (design §3.7): the embedding's rows
  `E[t]` and the head's `x·headᵀ` decomposed, factors and masks cast to the
  forward's dtype as the span's are."""
  out = {}
  for s in sites:
    m = site_masks.get(s.name)
    if not glu_sites.is_end_site(s.name) or m is None:
      continue
    factors = components[s.kind]
    v, u = factors.v[s.row].astype(dtype), factors.u[s.row].astype(dtype)
    m = SiteMask(m.mask.astype(dtype),
                 None if m.delta is None else m.delta.astype(dtype), m.route)
    if s.name == glu_weights.EMBED_SITE:
      out["embed_fn"] = functools.partial(_live_embedding, v=v, u=u, m=m)
    else:
      out["head_fn"] = functools.partial(_live_head, v=v, u=u, m=m)
  return out


def _live_embedding(table, tokens, *, v, u, m):
  return site_forward.decomposed_embedding(tokens, table, v, u, m)


def _live_head(x, head, *, v, u, m):
  return site_forward.decomposed_matmul(x, head.T, v, u, m)


def split_head(
  spec: glu_lm.ForwardSpec, site: glu_block.SiteFn, resume: Optional[str],
  extras: Callable, chunk: int, head_site: bool = False,
) -> Optional[target.SplitHead]:
  """Return the train step's forwards to the final hidden state and the
  head's KL over chunks of `chunk` positions (`chunked_head_kl`); None for
  `chunk` 0 (whole logits), ValueError for a negative one or for chunks of
  a decomposed head (`head_site`), which the chunked KL reads frozen."""
  if chunk < 0:
    raise ValueError(f"output_chunk must be >= 0 (0: whole logits), got "
                     f"{chunk}")
  if chunk == 0:
    return None
  if head_site:
    head = glu_weights.HEAD_SITE
    raise ValueError(f"--output_chunk computes the frozen head's logits in "
                     f"chunks and cannot decompose {head}; use "
                     f"--output_chunk=0 or leave {head} out of --sites")

  def divergence(weights, masked_x, clean_x):
    return glu_divergence.chunked_head_kl(
      glu_lm.head_matrix(weights), masked_x, clean_x, chunk,
      spec.config.final_softcap)

  return target.SplitHead(
    *tapped_forwards(glu_lm.final_hidden, spec, site, resume, extras),
    divergence)


def target_fns(
  config: glu_config.GluConfig,
  sites: tuple[SiteSpec, ...],
  attention: str = "reference",
  remat: bool = True,
  prefix_sharing: bool = True,
  output_chunk: int = 0,
) -> target.TargetFns:
  """Return the engine's function table for decomposing `sites`.

  With `prefix_sharing` off, masked forwards ignore the clean pass's
  boundary and rerun the frozen prefix from the tokens (SPEC §3.5 D5: equal
  up to reassociation); it exists to measure what sharing saves.
  `output_chunk` > 0: the step's KL over head chunks (`split_head`).
  """

  validate_sites(sites)
  seg = glu_sites.span_segments(config, sites)
  layouts = glu_kinds.kind_layouts(sites, config.n_experts)
  spec = glu_lm.ForwardSpec(config, seg, attention, remat)
  glu_attention.attention_fn(attention)  # refuses an unknown name up front
  site = glu_kinds.live_site_fn(layouts)
  resume = start_key(seg) if prefix_sharing else None
  ends = tuple(s.name for s in sites if glu_sites.is_end_site(s.name))

  def extras(weights, components, site_masks):
    return (glu_kinds.live_extras(sites, layouts, seg, weights, components,
                                  site_masks),
            end_fns(sites, components, site_masks, weights.embed.dtype))

  clean_forward, masked_forward_taps = tapped_forwards(
    glu_lm.forward, spec, site, resume, extras)

  def masked_forward(weights, components, tokens, site_masks):
    span_extra, ends = extras(weights, components, site_masks)
    return glu_lm.forward(weights, tokens, (), spec, site, span_extra,
                          **ends)[0]

  return target.TargetFns(
    sites=sites,
    clean_forward=clean_forward,
    masked_forward=masked_forward,
    frozen_stacks=lambda w: glu_kinds.frozen_stacks(w, layouts, seg, ends),
    divergence=glu_divergence.kl_clean_to_masked,
    batch_lead_shape=lambda tokens: tuple(tokens.shape),
    nonlinear_units=glu_sites.nonlinear_units(config, sites),
    masked_forward_taps=masked_forward_taps,
    start_taps=() if resume is None else (resume,),
    token_labels=token_labels,
    **glu_divergence.table_entries(config, seg, sites),
    hidden_pass_points=glu_sites.hidden_pass_points(config, sites),
    masking_reaches=glu_sites.masking_reaches(config, sites),
    split_head=split_head(spec, site, resume, extras, output_chunk,
                          glu_weights.HEAD_SITE in ends),
  )
