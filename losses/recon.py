"""Reconstruction under stochastic masks over a plan (SPEC §5.4, §5.5).

A plan is a tuple of entries `(live_sites, routing, n_draws)`; each draw is
one masked forward whose output is compared with the clean output, and the
term's loss is the mean over all forwards of the plan (I15). Keys derive as
`fold_in(fold_in(key, entry), draw)` then folded along the site's draw path
(`core.sites.draw_paths`: its canonical index, or `(kind, absolute layer)`
for layered targets), so a site's draw does not depend on which other sites
are live.
"""

import dataclasses
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Key

from decompax.core import masks as masks_lib
from decompax.core import sites as sites_lib
from decompax.core.site_forward import SiteMask
from decompax.core.sites import SiteSpec

Routing = Literal["all", "uniform_k"]
ROUTINGS = ("all", "uniform_k")


@dataclasses.dataclass(frozen=True)
class PlanEntry:
  """Sites live in each of `n_draws` masked forwards, and how they route."""

  live_sites: tuple[str, ...]
  routing: str = "all"  # one of ROUTINGS
  n_draws: int = 1

  def __post_init__(self):
    if self.routing not in ROUTINGS:
      raise ValueError(f"unknown routing {self.routing!r}; use one of {ROUTINGS}")
    if self.n_draws < 1:
      raise ValueError(f"n_draws must be >= 1, got {self.n_draws}")
    if not self.live_sites:
      raise ValueError("a plan entry needs at least one live site")


Plan = tuple[PlanEntry, ...]


def all_sites_plan(
  sites: tuple[SiteSpec, ...], routing: Routing = "all", n_draws: int = 1
) -> Plan:
  """Return one entry with every site live."""
  return (PlanEntry(tuple(s.name for s in sites), routing, n_draws),)


def per_site_plan(sites: tuple[SiteSpec, ...], n_draws: int = 1) -> Plan:
  """Return one route-all entry per site (the SPD "layerwise" loss)."""
  return tuple(PlanEntry((s.name,), "all", n_draws) for s in sites)


def subset_chunks_plan(
  sites: tuple[SiteSpec, ...], k: int, routing: Routing = "all",
  n_draws: int = 1,
) -> Plan:
  """Return entries of `k` consecutive sites in canonical order."""
  if k < 1:
    raise ValueError(f"subset chunk size must be >= 1, got {k}")
  names = [s.name for s in sites]
  return tuple(
    PlanEntry(tuple(names[i:i + k]), routing, n_draws)
    for i in range(0, len(names), k)
  )


def mse(
  masked: Float[Array, "..."], clean: Float[Array, "..."]
) -> Float[Array, ""]:
  """Return the mean over elements of `(masked − clean)²` (SPEC D_toy)."""
  diff = masked.astype(jnp.float32) - clean.astype(jnp.float32)
  return jnp.mean(jnp.square(diff))


def kl_clean_to_masked(
  masked_logits: Float[Array, "*l v"], clean_logits: Float[Array, "*l v"]
) -> Float[Array, ""]:
  """Return `mean_ℓ KL(softmax(clean) ‖ softmax(masked))` in fp32 (I14)."""
  log_p = jax.nn.log_softmax(clean_logits.astype(jnp.float32), axis=-1)
  log_q = jax.nn.log_softmax(masked_logits.astype(jnp.float32), axis=-1)
  kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
  return jnp.mean(kl)


def entry_routes(
  key: Key[Array, ""], entry: PlanEntry, lead_shape: tuple[int, ...]
) -> dict[str, Array] | None:
  """Return each live site's route for one forward, or None for route-all."""
  if entry.routing == "all":
    return None
  routes = masks_lib.uniform_k_routes(key, lead_shape, len(entry.live_sites))
  return {name: routes[..., i] for i, name in enumerate(entry.live_sites)}


def stochastic_site_masks(
  key: Key[Array, ""],
  entry: PlanEntry,
  ci_lower: dict[str, Float[Array, "*l c"]],
  draw_paths: dict[str, tuple[int, ...]],
  with_delta: bool,
  sampling: masks_lib.Sampling,
  routes: dict[str, Array] | None,
) -> dict[str, SiteMask]:
  """Return fresh stochastic masks for one forward of `entry`."""
  out = {}
  for name in entry.live_sites:
    ci = ci_lower[name]
    site_key = sites_lib.fold_path(key, draw_paths[name])
    source = masks_lib.stochastic_source(
      site_key, ci.shape[:-1], ci.shape[-1], with_delta, sampling
    )
    mask, delta = masks_lib.make_masks(ci, source)
    route = None if routes is None else routes[name]
    out[name] = SiteMask(mask, delta, route)
  return out


def stochastic_plan_mean(
  forward_loss: Callable[[dict[str, SiteMask]], Float[Array, ""]],
  ci_lower: dict[str, Float[Array, "*l c"]],
  sites: tuple[SiteSpec, ...],
  plan: Plan,
  draw_key: Key[Array, ""],
  route_key: Key[Array, ""],
  with_delta: bool,
  sampling: masks_lib.Sampling = "continuous",
) -> Float[Array, ""]:
  """Return the mean of `forward_loss` over the plan's stochastic forwards."""
  draw_paths = sites_lib.draw_paths(sites)
  lead_shape = next(iter(ci_lower.values())).shape[:-1]
  total = jnp.zeros((), jnp.float32)
  n_forwards = 0
  for e, entry in enumerate(plan):
    for d in range(entry.n_draws):
      fwd_key = jax.random.fold_in(jax.random.fold_in(draw_key, e), d)
      rte_key = jax.random.fold_in(jax.random.fold_in(route_key, e), d)
      routes = entry_routes(rte_key, entry, lead_shape)
      site_masks = stochastic_site_masks(
        fwd_key, entry, ci_lower, draw_paths, with_delta, sampling, routes
      )
      total = total + forward_loss(site_masks)
      n_forwards += 1
  return total / n_forwards


def stochastic_recon_loss(
  masked_forward: Callable[[dict[str, SiteMask]], Array],
  clean_output: Array,
  ci_lower: dict[str, Float[Array, "*l c"]],
  sites: tuple[SiteSpec, ...],
  plan: Plan,
  draw_key: Key[Array, ""],
  route_key: Key[Array, ""],
  divergence: Callable[[Array, Array], Float[Array, ""]],
  with_delta: bool,
  sampling: masks_lib.Sampling = "continuous",
) -> Float[Array, ""]:
  """Return the mean divergence from the clean output over the plan's draws."""
  return stochastic_plan_mean(
    lambda site_masks: divergence(masked_forward(site_masks), clean_output),
    ci_lower, sites, plan, draw_key, route_key, with_delta, sampling)


def custom_groups_plan(
  sites: tuple[SiteSpec, ...], groups: tuple[tuple[str, ...], ...],
  routing: Routing = "all", n_draws: int = 1,
) -> Plan:
  """Return one entry per named site group, sites in canonical order."""
  order = {s.name: i for i, s in enumerate(sites)}
  entries = []
  for group in groups:
    unknown = [name for name in group if name not in order]
    if unknown:
      raise ValueError(f"plan group names unknown site {unknown[0]!r}; sites "
                       f"are {', '.join(order)}")
    if len(set(group)) != len(group):
      raise ValueError(f"plan group {','.join(group)} lists a site twice")
    live = tuple(sorted(group, key=order.__getitem__))
    entries.append(PlanEntry(live, routing, n_draws))
  return tuple(entries)
