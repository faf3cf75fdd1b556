"""Mask sources, masks and routing: the one home of every mask (SPEC §5.4,
invariant I1).

A *source* has `C + 1` channels when the delta component is on (the last one
is the delta channel) and `C` otherwise. `*l` is the leading shape of the
activation the mask multiplies. A live site's masks for one forward form a
`SiteMask`; the constructors below return `{live site: SiteMask}`. Site `s`
draws from `fold_path(key, draw_paths[s])` (`core.sites`), so its draw does
not depend on which other sites are live.
"""

from typing import Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Key

from decompax.core import rng
from decompax.core import sites as sites_lib
from decompax.core.sites import SiteSpec

Sampling = Literal["continuous", "binomial"]
Routing = Literal["all", "uniform_k", "static_probability"]
ROUTINGS = ("all", "uniform_k", "static_probability")
# Whole-model mask variants of the evals (SPEC §5.11; `variant_site_masks`).
VARIANTS = ("ci_masked", "unmasked", "stochastic", "rounded", "zero", "random")


class SiteMask(NamedTuple):
  """What one live site consumes in a masked forward.

  `delta = None` means no delta path; `route = None` routes every position.
  """

  mask: Float[Array, "..."]
  delta: Optional[Float[Array, "..."]] = None
  route: Optional[Bool[Array, "..."]] = None


def make_masks(
  ci_lower: Float[Array, "*l c"], source: Float[Array, "*l s"]
) -> tuple[Float[Array, "*l c"], Optional[Float[Array, "*l"]]]:
  """Return `(ci + (1 − ci)·source[..., :C], source[..., C] or None)`.

  The delta channel is taken raw: it has no CI to interpolate from.
  """
  c = ci_lower.shape[-1]
  if source.shape[-1] not in (c, c + 1):
    raise ValueError(f"source has {source.shape[-1]} channels; want {c} or {c+1}")
  source = source.astype(ci_lower.dtype)
  mask = ci_lower + (1.0 - ci_lower) * source[..., :c]
  delta = source[..., c] if source.shape[-1] == c + 1 else None
  return mask, delta


def stochastic_source(
  key: Key[Array, ""],
  lead_shape: tuple[int, ...],
  c: int,
  with_delta: bool,
  sampling: Sampling = "continuous",
) -> Float[Array, "..."]:
  """Draw a fresh source: `U[0,1]`, or `{0,1}` w.p. ½ for `binomial`.

  Under `binomial` the delta channel stays `U[0,1]`.
  """
  shape = (*lead_shape, c + int(with_delta))
  uniform = rng.uniform(key, shape)
  if sampling == "continuous":
    return uniform
  if sampling != "binomial":
    raise ValueError(f"unknown sampling {sampling!r}; use continuous|binomial")
  bits = rng.bernoulli(jax.random.fold_in(key, 1), 0.5, (*lead_shape, c))
  components = bits.astype(jnp.float32)
  if not with_delta:
    return components
  return jnp.concatenate([components, uniform[..., c:]], axis=-1)


def stochastic_sources(
  key: Key[Array, ""],
  live_sites: tuple[str, ...],
  ci_lower: dict[str, Float[Array, "*l c"]],
  draw_paths: dict[str, tuple[int, ...]],
  with_delta: bool,
  sampling: Sampling = "continuous",
) -> dict[str, Float[Array, "*l s"]]:
  """Return a fresh stochastic source per live site, at its CI's shape."""
  out = {}
  for name in live_sites:
    ci = ci_lower[name]
    out[name] = stochastic_source(
      sites_lib.fold_path(key, draw_paths[name]), ci.shape[:-1], ci.shape[-1],
      with_delta, sampling)
  return out


def source_site_masks(
  ci_lower: dict[str, Float[Array, "*l c"]],
  sources: dict[str, Float[Array, "..."]],
  live_sites: tuple[str, ...],
  routes: dict[str, Bool[Array, "*l"]] | None,
) -> dict[str, SiteMask]:
  """Return the live sites' masks from (already effective) sources, each
  broadcast over the positions its scope shares (SPEC §5.6)."""
  out = {}
  for name in live_sites:
    ci = ci_lower[name]
    source = jnp.broadcast_to(
      sources[name], (*ci.shape[:-1], sources[name].shape[-1]))
    mask, delta = make_masks(ci, source)
    out[name] = SiteMask(mask, delta, None if routes is None else routes[name])
  return out


def stochastic_site_masks(
  key: Key[Array, ""],
  live_sites: tuple[str, ...],
  ci_lower: dict[str, Float[Array, "*l c"]],
  draw_paths: dict[str, tuple[int, ...]],
  with_delta: bool,
  sampling: Sampling,
  routes: dict[str, Bool[Array, "*l"]] | None,
) -> dict[str, SiteMask]:
  """Return fresh stochastic masks of the live sites for one forward."""
  sources = stochastic_sources(key, live_sites, ci_lower, draw_paths,
                               with_delta, sampling)
  return source_site_masks(ci_lower, sources, live_sites, routes)


def row_assignment(
  key: Key[Array, ""], fraction: float | Float[Array, ""],
  lead_shape: tuple[int, ...],
) -> Bool[Array, "..."]:
  """Return which batch rows are adversarial (SPEC §5.8): Bernoulli(fraction)
  per row, shaped `(B, 1, …)` to broadcast over the row's positions."""
  assign = rng.bernoulli(key, fraction, lead_shape[:1])
  return assign.reshape(lead_shape[:1] + (1,) * (len(lead_shape) - 1))


def merged_site_masks(
  key: Key[Array, ""],
  live_sites: tuple[str, ...],
  ci_lower: dict[str, Float[Array, "*l c"]],
  draw_paths: dict[str, tuple[int, ...]],
  sources: dict[str, Float[Array, "..."]],
  assign: Bool[Array, "..."],
  with_delta: bool,
  sampling: Sampling,
  routes: dict[str, Bool[Array, "*l"]] | None,
) -> dict[str, SiteMask]:
  """Return masks whose assigned rows use the persistent `sources`, routed
  everywhere, and whose other rows use fresh stochastic sources drawn from
  `key` with `routes` (SPEC §5.8)."""
  fresh = stochastic_sources(key, live_sites, ci_lower, draw_paths,
                             with_delta, sampling)
  mixed = {
    name: jnp.where(assign[..., None],
                    jnp.broadcast_to(sources[name], f.shape), f)
    for name, f in fresh.items()}
  if routes is not None:
    routes = {name: routes[name] | assign for name in live_sites}
  return source_site_masks(ci_lower, mixed, live_sites, routes)


def variant_site_masks(
  variant: str,
  key: Key[Array, ""],
  ci_lower: dict[str, Float[Array, "*l c"]],
  sites: tuple[SiteSpec, ...],
  with_delta: bool,
  rounding_threshold: float,
) -> dict[str, SiteMask]:
  """Return every site's mask under one eval variant, all routed (§5.11):

    ci_masked   m = ci                         (SPEC §5.4 Constant(0))
    unmasked    m = 1                          (Constant(1))
    stochastic  m = ci + (1 − ci)·U[0,1]       (the training draw; δ if on)
    rounded     m = [ci > rounding_threshold]
    zero        m = 0                          (zero ablation of every site)
    random      m = U[0,1]                     (CI ignored)
  """
  names = tuple(s.name for s in sites)
  paths = sites_lib.draw_paths(sites)
  if variant == "stochastic":
    return stochastic_site_masks(key, names, ci_lower, paths, with_delta,
                                 "continuous", None)
  if variant == "random":
    sources = stochastic_sources(key, names, ci_lower, paths, False)
    return {name: SiteMask(sources[name].astype(ci_lower[name].dtype))
            for name in names}
  constant = {
    "ci_masked": lambda ci: ci,
    "unmasked": jnp.ones_like,
    "rounded": lambda ci: (ci > rounding_threshold).astype(ci.dtype),
    "zero": jnp.zeros_like,
  }
  if variant not in constant:
    raise ValueError(f"unknown mask variant {variant!r}; use one of "
                     f"{VARIANTS}")
  return {name: SiteMask(constant[variant](ci_lower[name])) for name in names}


def component_site_masks(
  sites: tuple[SiteSpec, ...], keep: dict[str, Float[Array, " c"]],
  lead: tuple[int, ...],
) -> dict[str, SiteMask]:
  """Return every site's masks at `keep[site]` per component (1 kept, 0
  ablated), the same at every position, with the delta path on: the
  forward keeping everything is the target's."""
  return {site.name: SiteMask(
    jnp.broadcast_to(keep[site.name].astype(jnp.float32), (*lead, site.c)),
    jnp.ones(lead, jnp.float32)) for site in sites}


def one_ablated_site_masks(
  sites: tuple[SiteSpec, ...], site_index: Array, component: Array,
  lead: tuple[int, ...],
) -> dict[str, SiteMask]:
  """Return every site's masks with component `component` of site
  `sites[site_index]` alone at 0, every other mask 1, the delta path on
  (so the forward with nothing ablated is the target). Traceable in
  `site_index` and `component`, for a `lax.map` over components."""
  keep = {site.name: 1.0 - jnp.where(
    site_index == i, jax.nn.one_hot(component, site.c), 0.0)
    for i, site in enumerate(sites)}
  return component_site_masks(sites, keep, lead)


def uniform_k_routes(
  key: Key[Array, ""], lead_shape: tuple[int, ...], n_sites: int
) -> Bool[Array, "*l n"]:
  """Route a uniform `k ~ U{1..n}` subset of `n` live sites per position.

  The subset is the `k` sites with the smallest i.i.d. uniform ranks, so every
  `k`-subset is equally likely given `k`.
  """
  k_key, rank_key = jax.random.split(key)
  k = rng.randint(k_key, (*lead_shape, 1), 1, n_sites + 1)
  scores = rng.uniform(rank_key, (*lead_shape, n_sites))
  ranks = jnp.argsort(jnp.argsort(scores, axis=-1), axis=-1)
  return ranks < k


def static_probability_routes(
  key: Key[Array, ""], lead_shape: tuple[int, ...], n_sites: int, p: float
) -> Bool[Array, "*l n"]:
  """Route each (position, site) independently with probability `p`."""
  return rng.bernoulli(key, p, (*lead_shape, n_sites))


def check_routing(routing: str, route_probability: float | None) -> None:
  """Refuse an unknown routing, or a route probability it does not take
  (only `static_probability` does, in `(0, 1]`)."""
  if routing not in ROUTINGS:
    raise ValueError(f"unknown routing {routing!r}; use one of {ROUTINGS}")
  if routing != "static_probability":
    if route_probability is not None:
      raise ValueError(f"routing {routing!r} takes no route probability; "
                       "only static_probability does")
    return
  if route_probability is None or not 0.0 < route_probability <= 1.0:
    raise ValueError("static_probability routing needs a route probability "
                     f"in (0, 1], got {route_probability}")


def site_routes(
  key: Key[Array, ""],
  routing: Routing,
  live_sites: tuple[str, ...],
  lead_shape: tuple[int, ...],
  route_probability: float | None = None,
) -> dict[str, Bool[Array, "*l"]] | None:
  """Return each live site's route for one forward, or None for route-all."""
  check_routing(routing, route_probability)
  n = len(live_sites)
  if routing == "all":
    return None
  if routing == "uniform_k":
    routes = uniform_k_routes(key, lead_shape, n)
  else:
    routes = static_probability_routes(key, lead_shape, n, route_probability)
  return {name: routes[..., i] for i, name in enumerate(live_sites)}


def split_pair(key: Key[Array, ""]) -> tuple[Key[Array, ""], Key[Array, ""]]:
  """Return a term's `(draw_key, route_key)` (SPEC §6.1)."""
  draw_key, route_key = jax.random.split(key)
  return draw_key, route_key
