"""How a masked forward scans a decoder's live sites: kinds, their layouts
over the span, and the site function that runs a live layer.

A role's sites form one kind `<role>_proj` (rows layer-ascending) when they
share `C`; sites of one role with different `C` form kinds
`<role>_proj.c<C>`. Masked forwards scan the span once with every kind that
has a live site: per span layer the kind carries factors, mask, delta and
an `active` flag. Layers where the kind has no live site, and unrouted
positions, take the frozen `x @ W` through `where` (SPEC §3.3: a non-live
site MAY run as live with route ≡ false), so any live set works with one
uniform scan body. A kind whose rows are exactly the span's layers is
scanned in place; others are gathered to span layout (a copy of the
factors, only for such kinds).
"""

import dataclasses
from typing import Any, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from decompax.core import site_forward
from decompax.core.masks import SiteMask
from decompax.core.sites import Components, SiteSpec
from decompax.targets import glu_block, glu_lm, glu_sites, glu_weights


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
    if glu_sites.is_end_site(s.name):
      continue
    members.setdefault(s.kind, []).append(s)
  out = {}
  for kind, ss in members.items():
    ss = sorted(ss, key=lambda s: s.row)
    parsed = [glu_weights.parse_site(s.name) for s in ss]
    experts = tuple(glu_weights.site_expert(s.name) for s in ss)
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


def _span_rows(layout: KindLayout,
               seg: glu_weights.Segments) -> list[int | None]:
  row_of = {layer: r for r, layer in enumerate(layout.layers)}
  return [row_of.get(layer) for layer in range(seg.split, seg.tail)]


def live_kinds(
  components: Components,
  site_masks: dict[str, SiteMask],
  layouts: dict[str, KindLayout],
  seg: glu_weights.Segments,
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
  seg: glu_weights.Segments, dtype: Any,
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


def live_site_fn(layouts: dict[str, KindLayout]) -> glu_block.SiteFn:
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
      if role in glu_weights.EXPERT_ROLES:
        y = _expert_site(x, w, live, y)
        continue
      y_dec = site_forward.decomposed_matmul(
        x, w, live.v, live.u, SiteMask(live.mask, live.delta))
      y = y_dec if live.active is None else jnp.where(
        live.active[..., None], y_dec, y)
    return y

  return site


def frozen_stacks(
  weights: glu_weights.GluWeights, layouts: dict[str, KindLayout],
  seg: glu_weights.Segments, ends: tuple[str, ...] = (),
) -> dict[str, Float[Array, "layer d_in d_out"]]:
  """Return each decomposed kind's frozen `W` stack `[n_k, d_in, d_out]`.

  A kind covering the span's layers in order is the stored span leaf
  itself; others gather their rows. The embedding's `W` is the table, the
  head's the transpose of the head (of the table when tied); `ends` names
  those of them that are sites.
  """
  out = {}
  if glu_weights.EMBED_SITE in ends:
    out[glu_weights.EMBED_SITE] = weights.embed[None]
  if glu_weights.HEAD_SITE in ends:
    out[glu_weights.HEAD_SITE] = glu_lm.head_matrix(weights).T[None]
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


def live_extras(
  sites: tuple[SiteSpec, ...], layouts: dict[str, KindLayout],
  seg: glu_weights.Segments, weights: glu_weights.GluWeights,
  components: Components, site_masks: dict[str, SiteMask],
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
