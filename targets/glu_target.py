"""Decomposition sites of a decoder LM and its engine function table.

Sites are any subset of `layers.{i}.self_attn.{q,k,v,o}_proj` and
`layers.{i}.mlp.{gate,up,down}_proj` (SPEC §9.2; no `gate` in a plain MLP,
design §9.4; in a mixture-of-experts model each expert's
`layers.{i}.mlp.experts.{e}.{gate,up,down}_proj` instead, §9.5), plus the
token embedding `embed_tokens` and the unembedding `lm_head`, each a kind
of its own run outside the scan (`end_fns`); a projection's bias stays
frozen, outside its factors (I52).
The decomposed span is `[split, tail)`, the first and one past the last
decomposed layer. A role's sites form one kind `<role>_proj` (rows
layer-ascending) when they share `C`; sites of one role with different `C`
form kinds `<role>_proj.c<C>`.

Masked forwards scan the span once with every kind that has a live site:
per span layer the kind carries factors, mask, delta and an `active` flag.
Layers where the kind has no live site, and unrouted positions, take the
frozen `x @ W` through `where` (SPEC §3.3: a non-live site MAY run as live
with route ≡ false), so any live set works with one uniform scan body. A
kind whose rows are exactly the span's layers is scanned in place; others
are gathered to span layout (a copy of the factors, only for such kinds).
Masked forwards that see the clean pass's `resid.{split}` start there, so
the frozen prefix is never recomputed (SPEC §3.5, exact: I27).
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from decompax.core import ci_transformer, site_forward, target
from decompax.core.masks import SiteMask
from decompax.core.sites import (
  EMBEDDING, Components, SiteSpec, validate_sites)
from decompax.core.stable_softmax import log_softmax
from decompax.targets import glu_config, glu_lm

CPerSite = Union[int, dict[str, int]]


def role_dims(config: glu_config.GluConfig, role: str) -> tuple[int, int]:
  """Return `(d_in, d_out)` of a role (SPEC §9.2)."""
  d, f = config.d_model, config.d_ff
  return {"q": (d, config.q_width), "k": (d, config.kv_width),
          "v": (d, config.kv_width), "o": (config.q_width, d),
          "gate": (d, f), "up": (d, f), "down": (f, d),
          "expert_gate": (d, f), "expert_up": (d, f),
          "expert_down": (f, d)}[role]


def all_site_names(config: glu_config.GluConfig) -> tuple[str, ...]:
  """Return every decomposable projection in canonical order: the sites a
  run without `--sites` decomposes."""
  names = []
  for i in range(config.n_layers):
    names += [glu_lm.site_name(i, r) for r in glu_lm.model_roles(config)
              if r not in glu_lm.EXPERT_ROLES]
    # A mixture of experts: expert by expert, gate, up, down each.
    names += [glu_lm.site_name(i, r, e) for e in range(config.n_experts)
              for r in glu_lm.EXPERT_ROLES]
  return tuple(names)


def selectable_site_names(config: glu_config.GluConfig) -> tuple[str, ...]:
  """Return every site `--sites` may name, in canonical order: the token
  embedding, the projections, the unembedding (design §9.2)."""
  return ((glu_lm.EMBED_SITE,) + all_site_names(config)
          + (glu_lm.HEAD_SITE,))


def is_end_site(name: str) -> bool:
  """Return whether a site is the token embedding or the unembedding."""
  return name in glu_lm.END_SITES


def _end_spec(config: glu_config.GluConfig, name: str, c: int) -> SiteSpec:
  """Return the embedding's or the head's spec: a kind of its own, one row,
  draws keyed past the projections' roles."""
  v, d = config.vocab_size, config.d_model
  if name == glu_lm.EMBED_SITE:
    return SiteSpec(name, name, 0, v, d, c, (len(glu_lm.ROLES), 0),
                    EMBEDDING)
  return SiteSpec(name, name, 0, d, v, c, (len(glu_lm.ROLES) + 1, 0))


def _order_key(config: glu_config.GluConfig, parsed: tuple) -> tuple:
  if parsed[1] == glu_lm.EMBED_SITE:
    return (-1, 0)
  if parsed[1] == glu_lm.HEAD_SITE:
    return (config.n_layers, 0)
  if parsed[1] in glu_lm.EXPERT_ROLES:
    return (parsed[0], len(glu_lm.ROLES) + 3 * parsed[2]
            + glu_lm.EXPERT_ROLES.index(parsed[1]))
  return (parsed[0], glu_lm.ROLES.index(parsed[1]))


def _draw_path(config: glu_config.GluConfig, parsed: tuple
               ) -> tuple[int, int]:
  """Return a projection's draw path: (role, absolute layer), an expert's
  (a role past the end sites', layer·n_experts + expert)."""
  if parsed[1] in glu_lm.EXPERT_ROLES:
    return (len(glu_lm.ROLES) + 2 + glu_lm.EXPERT_ROLES.index(parsed[1]),
            parsed[0] * config.n_experts + parsed[2])
  return (glu_lm.ROLES.index(parsed[1]), parsed[0])


def site_specs(
  config: glu_config.GluConfig, names: tuple[str, ...], c: CPerSite
) -> tuple[SiteSpec, ...]:
  """Return the named sites in canonical order (the embedding, then layer
  by layer q…down, then the head)."""
  parsed = {}
  roles = glu_lm.model_roles(config)
  for name in names:
    if is_end_site(name):
      parsed[name] = (None, name)
      continue
    p = glu_lm.parse_site(name)
    expert = glu_lm.site_expert(name)
    if (p is None or p[2] or p[0] >= config.n_layers
        or p[1] not in roles or (expert or 0) >= max(config.n_experts, 1)):
      mlp = ",".join(r for r in roles if r in ("gate", "up", "down"))
      mlp_sites = (f" and layers.<i>.mlp.{{{mlp}}}_proj" if mlp else
                   " and layers.<i>.mlp.experts.<e>.{gate,up,down}_proj "
                   f"for e < {config.n_experts}")
      raise ValueError(f"unknown site {name!r}; sites are layers.<i>.self_attn"
                       f".{{q,k,v,o}}_proj{mlp_sites} for i < "
                       f"{config.n_layers}, {glu_lm.EMBED_SITE} and "
                       f"{glu_lm.HEAD_SITE}")
    parsed[name] = (p[0], p[1], expert)
  if not parsed:
    raise ValueError("no sites to decompose")
  order = sorted(parsed, key=lambda n: _order_key(config, parsed[n]))
  cs = {n: c for n in order} if isinstance(c, int) else dict(c)
  missing = [n for n in order if n not in cs]
  extra = sorted(set(cs) - set(order))
  if missing or extra:
    raise ValueError(f"C per site must name exactly the sites; missing "
                     f"{missing}, unknown {extra}")
  by_role: dict[str, list[str]] = {}
  for n in order:
    if not is_end_site(n):
      by_role.setdefault(parsed[n][1], []).append(n)
  specs = {n: _end_spec(config, n, cs[n]) for n in order if is_end_site(n)}
  rows = {}
  for role, members in by_role.items():
    mixed = len({cs[n] for n in members}) > 1
    d_in, d_out = role_dims(config, role)
    for n in members:
      kind = f"{role}_proj.c{cs[n]}" if mixed else f"{role}_proj"
      rows[kind] = rows.get(kind, -1) + 1
      # Keyed by (kind, absolute layer): draws independent of the span.
      specs[n] = SiteSpec(n, kind, rows[kind], d_in, d_out, cs[n],
                          _draw_path(config, parsed[n]))
  out = tuple(specs[n] for n in order)
  validate_sites(out)
  return out


def span_segments(
  config: glu_config.GluConfig, sites: tuple[SiteSpec, ...]
) -> glu_lm.Segments:
  """Return the three-stack bounds around the decomposed layers.

  A decomposed embedding starts the span at layer 0 (no prefix: the
  residual stream is live from the start); the head adds no layer, and
  without a decomposed layer the span is empty where the layers would end
  (`[n, n)`, all frozen layers a prefix the head's forwards share)."""
  layers = [glu_lm.parse_site(s.name)[0] for s in sites
            if not is_end_site(s.name)]
  embed = any(s.name == glu_lm.EMBED_SITE for s in sites)
  if not layers:
    first = 0 if embed else config.n_layers
    return glu_lm.Segments(config.n_layers, first, first)
  return glu_lm.Segments(config.n_layers, 0 if embed else min(layers),
                         max(layers) + 1)


def _block_tap(config: glu_config.GluConfig) -> Callable[[SiteSpec], str]:
  def tap(site: SiteSpec) -> str:
    if site.name == glu_lm.HEAD_SITE:
      return f"resid.{config.n_layers}"
    if site.name == glu_lm.EMBED_SITE:
      raise ValueError(
        f"the transformer CI function reads residual taps and has no input "
        f"for the embedding sites ['{site.name}']; use an MLP CI function "
        f"(--ci_fn=component_mlp, vector_mlp, site_mlp or global_mlp)")
    parsed = glu_lm.parse_site(site.name)
    if parsed is None or parsed[2]:
      raise ValueError(f"site {site.name!r} is not layers.<i>.<module> or "
                       f"{glu_lm.HEAD_SITE}; the transformer CI chunks "
                       "language-model sites by block")
    return f"resid.{parsed[0]}"

  return tap


def ci_chunks(
  config: glu_config.GluConfig, sites: tuple[SiteSpec, ...]
) -> tuple[tuple[ci_transformer.Chunk, ...], tuple[tuple[str, int], ...]]:
  """Return the transformer CI's chunks over LM sites, one per decomposed
  block reading that block's residual `resid.<i>` (SPEC §4.3), and the
  width of each chunk's tap; the head's chunk reads the last residual
  `resid.<n_layers>` (before the final norm)."""
  chunks = ci_transformer.chunks_by_tap(tuple(sites), _block_tap(config))
  return chunks, tuple((c.input_taps[0], config.d_model) for c in chunks)


@dataclasses.dataclass(frozen=True)
class KindLayout:
  """A kind's role and the absolute layer of each of its rows (and, for an
  expert role, each row's expert)."""

  role: str
  layers: tuple[int, ...]
  names: tuple[str, ...]
  experts: tuple[int, ...] = ()
  n_experts: int = 0


def kind_layouts(sites: tuple[SiteSpec, ...], n_experts: int = 0
                 ) -> dict[str, KindLayout]:
  """Return each projection kind's layout, rows in order (the embedding's
  and the head's kinds run outside the scan, `end_fns`)."""
  members: dict[str, list[SiteSpec]] = {}
  for s in sites:
    if is_end_site(s.name):
      continue
    members.setdefault(s.kind, []).append(s)
  out = {}
  for kind, ss in members.items():
    ss = sorted(ss, key=lambda s: s.row)
    parsed = [glu_lm.parse_site(s.name) for s in ss]
    experts = tuple(glu_lm.site_expert(s.name) for s in ss)
    out[kind] = KindLayout(parsed[0][1], tuple(p[0] for p in parsed),
                           tuple(s.name for s in ss),
                           experts if experts[0] is not None else (),
                           n_experts if experts[0] is not None else 0)
  return out


class LiveKind(NamedTuple):
  """One kind's live inputs per span layer (scanned beside the weights)."""

  v: Float[Array, "layer d_in c"]
  u: Float[Array, "layer c d_out"]
  mask: Float[Array, "layer *l c"]
  delta: Optional[Float[Array, "layer *l"]]
  active: Optional[Bool[Array, "layer *l"]]


def _span_rows(layout: KindLayout, seg: glu_lm.Segments) -> list[int | None]:
  row_of = {layer: r for r, layer in enumerate(layout.layers)}
  return [row_of.get(layer) for layer in range(seg.split, seg.tail)]


def live_kinds(
  components: Components,
  site_masks: dict[str, SiteMask],
  layouts: dict[str, KindLayout],
  seg: glu_lm.Segments,
  dtype: Any,
) -> dict[str, LiveKind]:
  """Return the span-stacked live inputs of every kind with a live site."""
  out = {}
  for kind, layout in layouts.items():
    if layout.experts:
      live_kind = _live_expert_kind(components[kind], site_masks, layout,
                                    seg, dtype)
      if live_kind is not None:
        out[kind] = live_kind
      continue
    rows = _span_rows(layout, seg)
    live = [None if r is None else site_masks.get(layout.names[r])
            for r in rows]
    present = [m for m in live if m is not None]
    if not present:
      continue
    c = present[0].mask.shape[-1]
    lead = jnp.broadcast_shapes(*(m.mask.shape[:-1] for m in present))
    factors = components[kind]
    if layout.layers == tuple(range(seg.split, seg.tail)):
      v, u = factors.v, factors.u
    else:
      idx = np.array([0 if r is None else r for r in rows])
      v, u = factors.v[idx], factors.u[idx]
    mask = jnp.stack([
      jnp.zeros((*lead, c), dtype) if m is None
      else jnp.broadcast_to(m.mask, (*lead, c)).astype(dtype) for m in live])
    delta = None
    if any(m.delta is not None for m in present):
      delta = jnp.stack([
        jnp.zeros(lead, dtype) if m is None or m.delta is None
        else jnp.broadcast_to(m.delta, lead).astype(dtype) for m in live])
    active = None
    if len(present) < len(live) or any(m.route is not None for m in present):
      active = jnp.stack([
        jnp.zeros(lead, bool) if m is None
        else jnp.ones(lead, bool) if m.route is None
        else jnp.broadcast_to(m.route, lead) for m in live])
    out[kind] = LiveKind(v.astype(dtype), u.astype(dtype), mask, delta, active)
  return out


def _live_expert_kind(
  factors: Any, site_masks: dict[str, SiteMask], layout: KindLayout,
  seg: glu_lm.Segments, dtype: Any,
) -> Optional[LiveKind]:
  """Return an expert kind's live inputs stacked `[span layer, expert,
  ...]` (factors `[.., d_in, c]`, masks `[.., *l, c]`), each slot without
  a live site zero and inactive; None when none of its sites is live."""
  row_of = {(layer, e): r for r, (layer, e) in enumerate(
    zip(layout.layers, layout.experts))}
  rows = [[row_of.get((layer, e)) for e in range(layout.n_experts)]
          for layer in range(seg.split, seg.tail)]
  live = [[None if r is None else site_masks.get(layout.names[r])
           for r in layer] for layer in rows]
  present = [m for layer in live for m in layer if m is not None]
  if not present:
    return None
  c = present[0].mask.shape[-1]
  lead = jnp.broadcast_shapes(*(m.mask.shape[:-1] for m in present))
  idx = np.array([[0 if r is None else r for r in layer] for layer in rows])

  def stacked(value, empty):
    return jnp.stack([jnp.stack([empty if m is None else value(m)
                                 for m in layer]) for layer in live])

  mask = stacked(lambda m: jnp.broadcast_to(m.mask, (*lead, c)).astype(
    dtype), jnp.zeros((*lead, c), dtype))
  delta = None
  if any(m.delta is not None for m in present):
    delta = stacked(lambda m: jnp.zeros(lead, dtype) if m.delta is None
                    else jnp.broadcast_to(m.delta, lead).astype(dtype),
                    jnp.zeros(lead, dtype))
  active = stacked(lambda m: jnp.ones(lead, bool) if m.route is None
                   else jnp.broadcast_to(m.route, lead),
                   jnp.zeros(lead, bool))
  return LiveKind(factors.v[idx].astype(dtype), factors.u[idx].astype(dtype),
                  mask, delta, active)


def _expert_major(a: Optional[Array], n_lead: int) -> Optional[Array]:
  """Return an expert kind's per-layer mask, delta or flag `[expert, *l,
  ...]` laid out against `[b, expert, t, ...]` activations: the expert
  axis moved after the batch axis for `l = (b, t)`, a unit axis added for
  `l = ()` (one mask for every position)."""
  if a is None:
    return None
  if n_lead == 0:
    return jnp.expand_dims(a, 1)
  if n_lead == 2:
    return jnp.moveaxis(a, 0, 1)
  raise ValueError(f"expert masks need a leading shape (b, t) or (), got "
                   f"{n_lead} axes")


def _expert_site(x: Array, w: Array, live: LiveKind, y: Array) -> Array:
  """Return every expert's output `[b, expert, t, d_out]` of an expert
  kind's span layer: decomposed where its site is live and active, `y`
  (the frozen `x @ w_e`, or another kind's) elsewhere."""
  n_lead = live.mask.ndim - 2  # [expert, *l, c]
  mask, delta, active = (_expert_major(a, n_lead)
                         for a in (live.mask, live.delta, live.active))
  # `site_forward.decomposed_matmul`'s `(x·V ⊙ m)·U + δ·(x·W − x·V·U)`,
  # batched over the experts' `[expert, d_in, c]` factors.
  a = x @ live.v
  y_dec = (a * mask) @ live.u
  if delta is not None:
    y_dec = y_dec + delta[..., None] * (x @ w - a @ live.u)
  return jnp.where(active[..., None], y_dec, y)


def live_site_fn(layouts: dict[str, KindLayout]) -> glu_lm.SiteFn:
  """Return the span's site matmul: frozen `x @ w`, then each live kind of
  the role where it is active (SPEC §3.2)."""
  kinds_by_role: dict[str, list[str]] = {}
  for kind, layout in layouts.items():
    kinds_by_role.setdefault(layout.role, []).append(kind)

  def site(role, x, w, extra):
    y = x @ w
    for kind in kinds_by_role.get(role, ()):
      live = extra.get(kind)
      if live is None:
        continue
      if role in glu_lm.EXPERT_ROLES:
        y = _expert_site(x, w, live, y)
        continue
      y_dec = site_forward.decomposed_matmul(
        x, w, live.v, live.u, SiteMask(live.mask, live.delta))
      y = y_dec if live.active is None else jnp.where(
        live.active[..., None], y_dec, y)
    return y

  return site


def frozen_stacks(
  weights: glu_lm.GluWeights, layouts: dict[str, KindLayout],
  seg: glu_lm.Segments, ends: tuple[str, ...] = (),
) -> dict[str, Float[Array, "layer d_in d_out"]]:
  """Return each decomposed kind's frozen `W` stack `[n_k, d_in, d_out]`.

  A kind covering the span's layers in order is the stored span leaf
  itself; others gather their rows. The embedding's `W` is the table, the
  head's the transpose of the head (of the table when tied); `ends` names
  those of them that are sites.
  """
  out = {}
  if glu_lm.EMBED_SITE in ends:
    out[glu_lm.EMBED_SITE] = weights.embed[None]
  if glu_lm.HEAD_SITE in ends:
    out[glu_lm.HEAD_SITE] = glu_lm.head_matrix(weights).T[None]
  for kind, layout in layouts.items():
    stack = getattr(weights.span, layout.role)
    if layout.experts:
      out[kind] = stack[np.array([layer - seg.split
                                  for layer in layout.layers]),
                        np.array(layout.experts)]
    elif layout.layers == tuple(range(seg.split, seg.tail)):
      out[kind] = stack
    else:
      out[kind] = stack[np.array([layer - seg.split
                                  for layer in layout.layers])]
  return out


def nonlinear_units(
  config: glu_config.GluConfig, sites: tuple[SiteSpec, ...]
) -> dict[str, target.UnitSpec]:
  """Return the locality units (SPEC §5.10): gate/up neurons, q heads, k/v
  kv heads counted `n_heads/n_kv_heads` times; o and down have none."""
  out = {}
  for s in sites:
    if is_end_site(s.name):
      continue
    role = glu_lm.parse_site(s.name)[1]
    if role in ("gate", "up", "expert_gate", "expert_up"):
      out[s.name] = target.UnitSpec("neuron", config.d_ff)
    elif role == "q":
      out[s.name] = target.UnitSpec("attention_head", config.n_heads)
    elif role in ("k", "v"):
      out[s.name] = target.UnitSpec(
        "attention_head", config.n_kv_heads,
        config.n_heads / config.n_kv_heads)
  return out


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
    kl = position_kl(glu_lm.softcap(jnp.einsum("nd,vd->nv", xm, head), cap),
                     glu_lm.softcap(jnp.einsum("nd,vd->nv", xc, head), cap))
    return jnp.sum(jnp.where(kept, kl, 0.0))

  sums = jax.lax.map(chunk_sum, (_position_chunks(masked_x, chunk),
                                 _position_chunks(clean_x, chunk), keep))
  return jnp.sum(sums) / n


def split_head(
  spec: glu_lm.ForwardSpec, site: glu_lm.SiteFn, resume: Optional[str],
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
    raise ValueError(f"--output_chunk computes the frozen head's logits in "
                     f"chunks and cannot decompose {glu_lm.HEAD_SITE}; use "
                     f"--output_chunk=0 or leave {glu_lm.HEAD_SITE} out of "
                     f"--sites")

  def divergence(weights, masked_x, clean_x):
    return chunked_head_kl(glu_lm.head_matrix(weights), masked_x, clean_x,
                           chunk, spec.config.final_softcap)

  return target.SplitHead(
    *tapped_forwards(glu_lm.final_hidden, spec, site, resume, extras),
    divergence)


def tapped_forwards(
  run: Callable, spec: glu_lm.ForwardSpec, site: glu_lm.SiteFn,
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


def attention_blocks(sites: tuple[SiteSpec, ...]) -> tuple[int, ...]:
  """Return the layers with a decomposed q_proj or k_proj, ascending: the
  blocks whose attention pattern the eval compares (SPEC §11)."""
  parsed = [glu_lm.parse_site(s.name) for s in sites]
  return tuple(sorted({p[0] for p in parsed
                       if p is not None and p[1] in ("q", "k")}))


def attention_taps(blocks: tuple[int, ...]) -> tuple[str, ...]:
  """Return the taps `attention_divergence` reads from each forward: the
  scored blocks' q_proj and k_proj outputs, which every forward computes
  anyway, so tapping them leaves its logits bit for bit (I29)."""
  return tuple(f"{glu_lm.site_name(b, r)}.out" for b in blocks
               for r in ("q", "k"))


def attention_divergence(
  config: glu_config.GluConfig, seg: glu_lm.Segments,
  blocks: tuple[int, ...],
) -> target.AttentionDivergence:
  """Return `(weights, masked taps, clean taps) -> {"layers.<b>": KL}`: per
  scored block the mean KL of its clean attention rows to the masked ones
  (`glu_lm.attention_kl`), queries and keys rebuilt from the tapped
  projections with the block's own QK-norm, RoPE and mask (a sliding
  window's), scored with the model's scale and soft-cap."""

  scoring = config if glu_lm.custom_scores(config) else None

  def heads(weights, taps, b, rope):
    q, k = (taps[f"{glu_lm.site_name(b, r)}.out"] for r in ("q", "k"))
    # Scored blocks lie in the span: a row of its norm stack, not a copy
    # of a weight stack (I41).
    row = b - seg.split
    norms = [None if n is None else n[row]
             for n in (weights.span.q_norm, weights.span.k_norm)]
    return glu_lm.query_key_heads(q, k, *norms, config, rope)

  def divergence(weights, masked_taps, clean_taps):
    out = {}
    for b in blocks:
      t = clean_taps[f"{glu_lm.site_name(b, 'q')}.out"].shape[1]
      # One layer's tables and mask serve both forwards' heads.
      rope, mask = glu_lm.layer_attention(config, t, b in config.local_layers)
      out[f"layers.{b}"] = glu_lm.attention_kl(
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
  reaches = masking_reaches(config, sites)
  return tuple(i for i in range(config.n_layers)
               if reaches(glu_lm.router_tap(i)))


def router_divergence(layers: tuple[int, ...]) -> target.RouterDivergence:
  """Return `(masked taps, clean taps) -> {"layers.<i>": KL}`: per scored
  layer the mean KL of its clean router distribution to the masked one
  over positions (`glu_lm.router_kl`), from the tapped logits."""

  taps = {f"layers.{i}": glu_lm.router_tap(i) for i in layers}

  def divergence(masked_taps, clean_taps):
    return {label: glu_lm.router_kl(clean_taps[tap], masked_taps[tap])
            for label, tap in taps.items()}

  return divergence


def token_labels(tokens: Int[Array, "b t"]) -> Int[Array, "b t"]:
  """Return next-token labels, −1 at each sequence's last position."""
  pad = jnp.full((tokens.shape[0], 1), -1, tokens.dtype)
  return jnp.concatenate([tokens[:, 1:], pad], axis=1)


def start_key(seg: glu_lm.Segments) -> Optional[str]:
  """Return the tap a masked forward starts from, None without a prefix."""
  return f"resid.{seg.split}" if seg.split > 0 else None


# Within one block, the roles whose masking moves each tap (`parse_tap`'s
# stream): q, k and v read the block's normed input, the pattern reads q and
# k, o reads the attention output, the MLP the attention-updated stream.
_ATTENTION_ROLES = frozenset("qkvo")
_MOVED_BY: dict[str, frozenset] = {
  "q": frozenset(), "k": frozenset(), "v": frozenset(),
  "q.out": frozenset("q"), "k.out": frozenset("k"), "v.out": frozenset("v"),
  "attn": frozenset("qk"), "o": frozenset("qkv"), "o.out": _ATTENTION_ROLES,
  "gate": _ATTENTION_ROLES, "up": _ATTENTION_ROLES,
  "gate.out": _ATTENTION_ROLES | {"gate"}, "up.out": _ATTENTION_ROLES | {"up"},
  "down": _ATTENTION_ROLES | {"gate", "up"},
  "down.out": _ATTENTION_ROLES | {"gate", "up", "down"},
  # A mixture-of-experts block's input, router and output (its experts are
  # not sites).
  "moe": _ATTENTION_ROLES, "router": _ATTENTION_ROLES,
  "router.out": _ATTENTION_ROLES,
  "moe.out": _ATTENTION_ROLES | set(glu_lm.EXPERT_ROLES),
  # An expert's streams (`<stream>@<e>`), moved by the expert roles of its
  # block, whichever expert they belong to (a superset).
  "expert_gate.out": _ATTENTION_ROLES | {"expert_gate"},
  "expert_up.out": _ATTENTION_ROLES | {"expert_up"},
  "expert_down": _ATTENTION_ROLES | {"expert_gate", "expert_up"},
  "expert_down.out": _ATTENTION_ROLES | set(glu_lm.EXPERT_ROLES),
}
_MLP_STREAMS = ("gate", "up", "gate.out", "up.out", "down", "down.out",
                *glu_lm.MOE_STREAMS, "expert_gate.out", "expert_up.out",
                "expert_down", "expert_down.out")


def moved_by(config: glu_config.GluConfig) -> dict[str, frozenset]:
  """Return, per tap stream, the roles of its own block that move it: a
  parallel block's MLP reads the block input, which its attention does not
  touch."""
  if not config.parallel_residual:
    return _MOVED_BY
  return {s: (r - _ATTENTION_ROLES if s in _MLP_STREAMS else r)
          for s, r in _MOVED_BY.items()}


def masking_reaches(config: glu_config.GluConfig,
                    sites: tuple[SiteSpec, ...]):
  """Return `tap -> bool`: whether masking `sites` can move that tap (a
  later layer's anything; in the site's own layer, what reads it). The
  embedding lies below layer 0 and reaches every tap, the head none. Unknown
  taps raise `parse_tap`'s ValueError."""
  placed = [(-1, glu_lm.EMBED_SITE) if s.name == glu_lm.EMBED_SITE
            else glu_lm.parse_site(s.name)[:2] for s in sites
            if s.name != glu_lm.HEAD_SITE]
  moving = moved_by(config)
  ends = {glu_lm.EMBED_SITE: False,  # the token ids
          f"{glu_lm.EMBED_SITE}.out": any(l < 0 for l, _ in placed),
          glu_lm.HEAD_SITE: bool(placed),
          f"{glu_lm.HEAD_SITE}.out": bool(sites)}

  def reaches(tap: str) -> bool:
    if tap in ends:
      return ends[tap]
    stream, layer = glu_lm.parse_tap(tap, config.n_layers)
    if stream == "resid":
      return any(l < layer for l, _ in placed)
    moved = moving[stream.partition("@")[0]]
    return any(l < layer or (l == layer and role in moved)
               for l, role in placed)

  return reaches


def hidden_pass_points(config: glu_config.GluConfig,
                       sites: tuple[SiteSpec, ...]) -> tuple[str, ...]:
  """Return the MLP outputs from the first decomposed layer to the last:
  what a hidden pass reconstructs by default (from layer 0 with a
  decomposed embedding; none with the head alone). A mixture-of-experts
  MLP's output is its block's `layers.<i>.mlp.out`."""
  first = min((0 if s.name == glu_lm.EMBED_SITE else config.n_layers
               if s.name == glu_lm.HEAD_SITE
               else glu_lm.parse_site(s.name)[0]) for s in sites)
  return tuple(f"layers.{i}.mlp.out" if config.moe
               else f"{glu_lm.site_name(i, 'down')}.out"
               for i in range(first, config.n_layers))


def live_extras(
  sites: tuple[SiteSpec, ...], layouts: dict[str, KindLayout],
  seg: glu_lm.Segments, weights: glu_lm.GluWeights, components: Components,
  site_masks: dict[str, SiteMask],
) -> dict[str, LiveKind]:
  """Return what the span's scan carries beside its weights for a masked
  forward (`live_kinds`); ValueError for a mask naming no site."""
  names = {s.name for s in sites}
  unknown = sorted(set(site_masks) - names)
  if unknown:
    raise ValueError(f"unknown live sites {unknown}; sites are "
                     f"{sorted(names)}")
  return live_kinds(components, site_masks, layouts, seg,
                    weights.embed.dtype)


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
    if not is_end_site(s.name) or m is None:
      continue
    factors = components[s.kind]
    v, u = factors.v[s.row].astype(dtype), factors.u[s.row].astype(dtype)
    m = SiteMask(m.mask.astype(dtype),
                 None if m.delta is None else m.delta.astype(dtype), m.route)
    if s.name == glu_lm.EMBED_SITE:
      out["embed_fn"] = functools.partial(_live_embedding, v=v, u=u, m=m)
    else:
      out["head_fn"] = functools.partial(_live_head, v=v, u=u, m=m)
  return out


def _live_embedding(table, tokens, *, v, u, m):
  return site_forward.decomposed_embedding(tokens, table, v, u, m)


def _live_head(x, head, *, v, u, m):
  return site_forward.decomposed_matmul(x, head.T, v, u, m)


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
  seg = span_segments(config, sites)
  layouts = kind_layouts(sites, config.n_experts)
  spec = glu_lm.ForwardSpec(config, seg, attention, remat)
  glu_lm.attention_fn(attention)  # refuses an unknown name up front
  site = live_site_fn(layouts)
  resume = start_key(seg) if prefix_sharing else None
  blocks = attention_blocks(sites)
  routed = router_layers(config, sites)
  ends = tuple(s.name for s in sites if is_end_site(s.name))

  def extras(weights, components, site_masks):
    return (live_extras(sites, layouts, seg, weights, components,
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
    frozen_stacks=lambda w: frozen_stacks(w, layouts, seg, ends),
    divergence=kl_clean_to_masked,
    batch_lead_shape=lambda tokens: tuple(tokens.shape),
    nonlinear_units=nonlinear_units(config, sites),
    masked_forward_taps=masked_forward_taps,
    start_taps=() if resume is None else (resume,),
    token_labels=token_labels,
    attention_taps=attention_taps(blocks),
    attention_divergence=attention_divergence(config, seg, blocks),
    router_taps=tuple(glu_lm.router_tap(i) for i in routed),
    router_divergence=router_divergence(routed) if config.moe else None,
    hidden_pass_points=hidden_pass_points(config, sites),
    masking_reaches=masking_reaches(config, sites),
    split_head=split_head(spec, site, resume, extras, output_chunk,
                          glu_lm.HEAD_SITE in ends),
  )


def layer_array_shapes(
  config: glu_config.GluConfig,
) -> dict[str, tuple[int, ...]]:
  """Return the per-layer shape of every stacked weight array: matrices,
  norms and (of models with them) biases `<role>_bias`, `ln{1,2}_bias`
  and sandwich norms `post_{attn,mlp}_norm`."""
  roles = glu_lm.model_roles(config)
  shapes = {r: role_dims(config, r) for r in roles}
  shapes.update(ln1=(config.d_model,), ln2=(config.d_model,))
  if config.qk_norm:
    shapes.update(q_norm=(config.head_dim,), k_norm=(config.head_dim,))
  if config.bias:
    shapes.update({f"{r}_bias": role_dims(config, r)[1:] for r in roles})
  if config.norm == "layer":
    shapes.update(ln1_bias=(config.d_model,), ln2_bias=(config.d_model,))
  if config.sandwich:
    shapes.update(post_attn_norm=(config.d_model,),
                  post_mlp_norm=(config.d_model,))
  if config.moe:
    e, (d, f) = config.n_experts, (config.d_model, config.d_ff)
    shapes.update(router=(d, e), expert_gate=(e, d, f), expert_up=(e, d, f),
                  expert_down=(e, f, d))
  return shapes


# Whole-model arrays beside the layer stacks.
_MODEL_ARRAYS = ("embed", "norm", "head", "pos", "norm_bias")


def array_shapes(config: glu_config.GluConfig) -> dict[str, tuple[int, ...]]:
  """Return the shape of every array `weights_from_arrays` takes: `embed`,
  `norm`, `head` (untied models only), `pos` (learned positions only),
  `norm_bias` (LayerNorm only) and each per-layer array stacked
  `[n_layers, ...]`."""
  want = {"embed": (config.vocab_size, config.d_model),
          "norm": (config.d_model,)}
  if not config.tied:
    want["head"] = (config.vocab_size, config.d_model)
  if config.positions == "learned":
    want["pos"] = (config.max_position, config.d_model)
  if config.norm == "layer":
    want["norm_bias"] = (config.d_model,)
  for name, shape in layer_array_shapes(config).items():
    want[name] = (config.n_layers, *shape)
  return want


def weights_from_arrays(
  arrays: dict[str, np.ndarray | Array],
  config: glu_config.GluConfig,
  seg: glu_lm.Segments,
  dtype=jnp.float32,
) -> glu_lm.GluWeights:
  """Return device weights split into the three stacks of `seg`.

  `arrays` holds the arrays of `array_shapes`, per-layer ones in `x @ W`
  orientation: host arrays, or abstract ones under `jax.eval_shape` (the
  memory bench's).

  Raises:
    ValueError: a name or shape does not match `config`.
  """
  want = array_shapes(config)
  if set(arrays) != set(want):
    raise ValueError(f"weight arrays {sorted(arrays)} do not match the "
                     f"model's {sorted(want)}")
  for name, shape in want.items():
    if tuple(arrays[name].shape) != shape:
      raise ValueError(f"weight {name}: shape {tuple(arrays[name].shape)}, "
                       f"expected {shape}")
  stacks = glu_lm.split_stacks(
    glu_lm.layer_stack(**{n: arrays[n] for n in want
                          if n not in _MODEL_ARRAYS}), seg)

  def put(a):
    return jnp.asarray(a, dtype)

  return glu_lm.GluWeights(
    embed=put(arrays["embed"]),
    prefix=None if stacks[0] is None else jax.tree.map(put, stacks[0]),
    span=None if stacks[1] is None else jax.tree.map(put, stacks[1]),
    tail=None if stacks[2] is None else jax.tree.map(put, stacks[2]),
    norm=put(arrays["norm"]),
    head=None if config.tied else put(arrays["head"]),
    **{n: put(arrays[n]) for n in ("pos", "norm_bias") if n in want})


def weights_to_arrays(weights: glu_lm.GluWeights) -> dict[str, np.ndarray]:
  """Return host arrays in the `weights_from_arrays` layout."""
  stacks = [s for s in (weights.prefix, weights.span, weights.tail)
            if s is not None]
  out = {"embed": np.asarray(weights.embed), "norm": np.asarray(weights.norm)}
  for name in ("head", "pos", "norm_bias"):
    if getattr(weights, name) is not None:
      out[name] = np.asarray(getattr(weights, name))
  for name in glu_lm.LayerStack._fields:
    parts = [getattr(s, name) for s in stacks]
    if parts[0] is not None:
      out[name] = np.concatenate([np.asarray(p) for p in parts])
  return out
