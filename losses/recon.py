"""Reconstruction under stochastic masks over a plan (SPEC §5.4, §5.5).

A plan is a tuple of entries `(live_sites, routing, n_draws)`; each draw is
one masked forward whose output is compared with the clean output, and the
term's loss is the mean over all forwards of the plan (I15). `plan_mean` is
the one loop over a plan's forwards that every recon term (stochastic,
persistent, merged, fresh PGD) and the PGD eval probe share: draw `d` of
entry `e` sees each of its keys as `fold_in(fold_in(key, e), d)` (R2), and
masks fold that along the site's draw path (`core.sites.draw_paths`: its
canonical index, or `(kind, absolute layer)` for layered targets), so a
site's draw does not depend on which other sites are live.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Key

from decompax.core import masks as masks_lib
from decompax.core import sites as sites_lib
from decompax.core.masks import Routing, SiteMask
from decompax.core.sites import SiteSpec
from decompax.core.stable_softmax import log_softmax


@dataclasses.dataclass(frozen=True)
class PlanEntry:
  """Sites live in each of `n_draws` masked forwards, and how they route.

  `route_probability` is the `p` of `static_probability` routing (each
  position and live site routed independently with probability `p`); the
  other routings take none.
  """

  live_sites: tuple[str, ...]
  routing: str = "all"  # one of core.masks.ROUTINGS
  n_draws: int = 1
  route_probability: float | None = None

  def __post_init__(self):
    masks_lib.check_routing(self.routing, self.route_probability)
    if self.n_draws < 1:
      raise ValueError(f"n_draws must be >= 1, got {self.n_draws}")
    if not self.live_sites:
      raise ValueError("a plan entry needs at least one live site")


Plan = tuple[PlanEntry, ...]


def all_sites_plan(
  sites: tuple[SiteSpec, ...], routing: Routing = "all", n_draws: int = 1,
  route_probability: float | None = None,
) -> Plan:
  """Return one entry with every site live."""
  return (PlanEntry(tuple(s.name for s in sites), routing, n_draws,
                    route_probability),)


def per_site_plan(sites: tuple[SiteSpec, ...], n_draws: int = 1) -> Plan:
  """Return one route-all entry per site (the SPD "layerwise" loss)."""
  return tuple(PlanEntry((s.name,), "all", n_draws) for s in sites)


def subset_chunks_plan(
  sites: tuple[SiteSpec, ...], k: int, routing: Routing = "all",
  n_draws: int = 1, route_probability: float | None = None,
) -> Plan:
  """Return entries of `k` consecutive sites in canonical order."""
  if k < 1:
    raise ValueError(f"subset chunk size must be >= 1, got {k}")
  names = [s.name for s in sites]
  return tuple(
    PlanEntry(tuple(names[i:i + k]), routing, n_draws, route_probability)
    for i in range(0, len(names), k)
  )


def custom_groups_plan(
  sites: tuple[SiteSpec, ...], groups: tuple[tuple[str, ...], ...],
  routing: Routing = "all", n_draws: int = 1,
  route_probability: float | None = None,
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
    entries.append(PlanEntry(live, routing, n_draws, route_probability))
  return tuple(entries)


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
  log_p = log_softmax(clean_logits.astype(jnp.float32))
  log_q = log_softmax(masked_logits.astype(jnp.float32))
  kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
  return jnp.mean(kl)


def entry_routes(
  key: Key[Array, ""], entry: PlanEntry, lead_shape: tuple[int, ...]
) -> dict[str, Bool[Array, "*l"]] | None:
  """Return each live site's route for one forward, or None for route-all."""
  return masks_lib.site_routes(key, entry.routing, entry.live_sites,
                               lead_shape, entry.route_probability)


def forward_key(
  key: Key[Array, ""], entry_index: int, draw: int
) -> Key[Array, ""]:
  """Return the key of draw `draw` of entry `entry_index` (R2)."""
  return jax.random.fold_in(jax.random.fold_in(key, entry_index), draw)


# (entry, draw index, the plan keys folded for this forward) -> the scalar
# loss of that masked forward.
DrawLoss = Callable[[PlanEntry, int, tuple[Key[Array, ""], ...]],
                    Float[Array, ""]]


def plan_mean(
  draw_loss: DrawLoss,
  plan: Plan,
  keys: tuple[Key[Array, ""], ...],
  draws_differ: bool = True,
) -> Float[Array, ""]:
  """Return the mean of `draw_loss` over the plan's forwards (I15).

  Draw `d` of entry `e` gets `forward_key(k, e, d)` for each `k` of `keys`.
  With `draws_differ=False` (masks from sources shared by every draw) the
  draws of a route-all entry are one forward: it runs once as draw 0,
  weighted by `n_draws`.
  """
  total = jnp.zeros((), jnp.float32)
  count = 0
  for e, entry in enumerate(plan):
    distinct = draws_differ or entry.routing != "all"
    n_forwards = entry.n_draws if distinct else 1
    weight = entry.n_draws // n_forwards
    for d in range(n_forwards):
      loss = draw_loss(entry, d, tuple(forward_key(k, e, d) for k in keys))
      total = total + (loss if weight == 1 else weight * loss)
    count += entry.n_draws
  return total / count


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
  """Return the mean of `forward_loss` over the plan's stochastic forwards:
  fresh sources from `draw_key`, routes from `route_key`."""
  draw_paths = sites_lib.draw_paths(sites)
  lead_shape = next(iter(ci_lower.values())).shape[:-1]

  def draw_loss(entry, draw, keys):
    del draw
    fwd_key, rte_key = keys
    routes = entry_routes(rte_key, entry, lead_shape)
    return forward_loss(masks_lib.stochastic_site_masks(
      fwd_key, entry.live_sites, ci_lower, draw_paths, with_delta, sampling,
      routes))

  return plan_mean(draw_loss, plan, (draw_key, route_key))


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
