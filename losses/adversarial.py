"""Adversarial reconstruction terms: persistent and fresh PGD (SPEC §5.6, §5.7).

Both build masks `ci + (1 − ci)·EFF(S)[..., :C]` from per-site sources `S`
that ascend the term's reconstruction loss. Persistent sources live in the
train state across steps; fresh ones are re-initialised every step. Ascents
always see stop-gradient components and CI (I21, I24).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

from decompax.core import adversary, schedules
from decompax.core import masks as masks_lib
from decompax.core import sites as sites_lib
from decompax.core.masks import split_pair
from decompax.core.step_records import LossTerm, StepContext
from decompax.losses import hidden, recon

FRESH_INITS = ("random", "ones", "zeroes")


@dataclasses.dataclass(frozen=True)
class PersistentConfig:
  """A persistent PGD adversary feeding one recon term."""

  source: adversary.SourceConfig
  lr: schedules.Schedule
  n_warmup: int = 0
  objective: str = "e2e"
  start_frac: float = 0.0

  def __post_init__(self):
    if self.lr.fn_type != "constant":
      raise ValueError("a persistent source LR may warm up but not decay; use "
                       f"a constant schedule, not {self.lr.fn_type}")
    if self.n_warmup < 0:
      raise ValueError(f"n_warmup must be >= 0, got {self.n_warmup}")
    if self.objective not in ("e2e", "term"):
      raise ValueError(f"unknown adversary objective {self.objective!r}; use "
                       "e2e|term")
    if not 0.0 <= self.start_frac < 1.0:
      raise ValueError(f"start_frac must lie in [0, 1), got {self.start_frac}")


class PersistentSources(NamedTuple):
  """A persistent adversary's state (`TrainState.term_states[term]`).

  Field names are checkpoint paths: `sources/<site>/{source,m,v}`, `count`.
  """

  sources: dict[str, adversary.SourceState]
  # Ascents taken so far (warmup and final); the Adam step count.
  count: Int[Array, ""]


@dataclasses.dataclass(frozen=True)
class FreshConfig:
  """A fresh PGD adversary, re-initialised each step."""

  init: str = "random"
  scope: str = "c"
  n_steps: int = 1
  step_size: float = 0.1

  def __post_init__(self):
    if self.init not in FRESH_INITS:
      raise ValueError(f"unknown fresh PGD init {self.init!r}; use one of "
                       f"{FRESH_INITS}")
    if self.scope not in ("c", "bc", "bsc"):
      raise ValueError(f"fresh PGD scope must be c, bc or bsc, got {self.scope}")
    if self.n_steps < 0:
      raise ValueError(f"fresh PGD n_steps must be >= 0, got {self.n_steps}")


def plan_loss(
  ctx: StepContext,
  sources: dict[str, Array],
  plan: recon.Plan,
  route_key: Key[Array, ""],
  forward_loss: hidden.ForwardLoss | None = None,
) -> Float[Array, ""]:
  """Return the mean forward loss (default: output divergence) over the
  plan's forwards with masks from `sources`.

  The draws of an entry share the sources, so route-all draws are one
  forward: it runs once, weighted by `n_draws` (`recon.plan_mean`).
  """
  forward_loss = forward_loss or hidden.forward_loss(ctx, None)
  lead = ctx.lead_shape()

  def draw_loss(entry, draw, keys):
    del draw
    routes = recon.entry_routes(keys[0], entry, lead)
    return forward_loss(masks_lib.source_site_masks(
      ctx.ci.lower, sources, entry.live_sites, routes))

  return recon.plan_mean(draw_loss, plan, (route_key,), draws_differ=False)


def merged_plan_loss(
  ctx: StepContext,
  sources: dict[str, Array],
  plan: recon.Plan,
  key: Key[Array, ""],
  adv_fraction: Float[Array, ""],
  with_delta: bool,
  sampling: str,
  forward_loss: hidden.ForwardLoss,
) -> Float[Array, ""]:
  """Return the mean forward loss where each batch row is adversarial with
  probability `adv_fraction` (persistent sources, routed everywhere) and
  stochastic otherwise (fresh sources, the entry's routing) (SPEC §5.8).

  Each forward splits its key into `(assign, draw, route)` keys.
  """
  lead = ctx.lead_shape()
  draw_paths = sites_lib.draw_paths(ctx.target.sites)

  def draw_loss(entry, draw, keys):
    del draw
    assign_key, draw_key, route_key = jax.random.split(keys[0], 3)
    assign = masks_lib.row_assignment(assign_key, adv_fraction, lead)
    routes = recon.entry_routes(route_key, entry, lead)
    return forward_loss(masks_lib.merged_site_masks(
      draw_key, entry.live_sites, ctx.ci.lower, draw_paths, sources, assign,
      with_delta, sampling, routes))

  return recon.plan_mean(draw_loss, plan, (key,))


def check_bundles(bundles: dict[str, str]) -> None:
  """Refuse a source bundle that feeds more than one term (I22).

  Args:
    bundles: `{term name: bundle name}` of every persistent term.
  """
  seen: dict[str, str] = {}
  for term, bundle in bundles.items():
    if bundle in seen:
      raise ValueError(
        f"source bundle {bundle!r} feeds two terms ({seen[bundle]} and "
        f"{term}); a bundle feeds exactly one term, so name another bundle")
    seen[bundle] = term


def _all_sites_plan(ctx: StepContext) -> recon.Plan:
  return recon.all_sites_plan(ctx.target.sites, "all", 1)


@dataclasses.dataclass(frozen=True)
class Merged:
  """Settings of the merged stochastic/persistent term (SPEC §5.8)."""

  adv_fraction: schedules.Coefficient
  sampling: str = "continuous"


@dataclasses.dataclass(frozen=True)
class PersistentTerm:
  """The static settings a persistent-PGD term's hooks read: the recon
  plan it scores, its adversary, the sites and delta slot its sources
  cover, its hidden rider and the merged setting (None: every row
  adversarial)."""

  plan: recon.Plan
  config: PersistentConfig
  sites: tuple
  with_delta: bool
  rider: hidden.HiddenRider | None = None
  merged: Merged | None = None

  @property
  def ascent_rider(self) -> hidden.HiddenRider | None:
    """The rider ascents maximize too: the term's under the `term`
    objective, none under `e2e` (I23)."""
    return self.rider if self.config.objective == "term" else None


def persistent_init(term: PersistentTerm, key: Key[Array, ""],
                    lead_shape: tuple[int, ...]) -> PersistentSources:
  """Return fresh sources per site and a zero ascent count."""
  # Keyed by site name: `--sites` subsets leave the other sites' starts.
  source = term.config.source
  states = {}
  for site in term.sites:
    shape = adversary.scope_shape(
      source.scope, lead_shape, site.c + int(term.with_delta))
    states[site.name] = adversary.init_source(
      adversary.site_key(key, site.name), shape, source.parametrization)
  return PersistentSources(states, jnp.zeros((), jnp.int32))


def _effective(term: PersistentTerm, raw: dict[str, Array]
               ) -> dict[str, Array]:
  return {k: adversary.effective(v, term.config.source.parametrization)
          for k, v in raw.items()}


def _ascend_all(term: PersistentTerm, states, grads, count, lr):
  return {k: adversary.ascend(states[k], grads[k], count, lr,
                              term.config.source)
          for k in states}


def persistent_active(term: PersistentTerm, ctx: StepContext
                      ) -> Bool[Array, ""]:
  """Return whether the adversary runs at this step (`start_frac`)."""
  return ctx.step >= int(term.config.start_frac * ctx.total_steps)


def persistent_loss(term: PersistentTerm, ctx: StepContext,
                    raw: dict[str, Array], key: Key[Array, ""],
                    rider: hidden.HiddenRider | None) -> Float[Array, ""]:
  """Return the term's loss with masks from the raw sources `raw`."""
  forward = hidden.forward_loss(ctx, rider)
  if term.merged is None:
    return plan_loss(ctx, _effective(term, raw), term.plan, key,
                     forward_loss=forward)
  fraction = schedules.schedule_value(term.merged.adv_fraction, ctx.step,
                                      ctx.total_steps)
  return merged_plan_loss(ctx, _effective(term, raw), term.plan, key,
                          fraction, term.with_delta, term.merged.sampling,
                          forward)


def persistent_prepare(
  term: PersistentTerm, ctx: StepContext, key: Key[Array, ""],
  state: PersistentSources,
) -> tuple[PersistentSources, dict[str, Array]]:
  """Return the state after `n_warmup` ascents, every site live and routed
  (I21), and its stop-gradient raw sources: the term's inputs."""
  del key
  lr = schedules.schedule_value(term.config.lr, ctx.step, ctx.total_steps)
  states, count = state.sources, state.count
  warm_plan = _all_sites_plan(ctx)
  warm_loss = hidden.forward_loss(ctx, term.ascent_rider)

  def adv_loss(raw):
    return plan_loss(ctx, _effective(term, raw), warm_plan,
                     jax.random.key(0), forward_loss=warm_loss)

  active = persistent_active(term, ctx)
  for _ in range(term.config.n_warmup):
    raw = {k: s.source for k, s in states.items()}
    grads = jax.grad(adv_loss)(raw)
    stepped = _ascend_all(term, states, grads, count, lr)
    states = jax.tree.map(
      lambda new, old: jnp.where(active, new, old), stepped, states)
    count = count + active.astype(jnp.int32)
  raw = jax.lax.stop_gradient({k: s.source for k, s in states.items()})
  return PersistentSources(states, count), raw


def persistent_value(term: PersistentTerm, ctx: StepContext,
                     key: Key[Array, ""], raw: dict[str, Array]
                     ) -> tuple[Float[Array, ""], None]:
  """Return the term's value (0 before `start_frac`)."""
  _, loss_key = split_pair(key)
  value = persistent_loss(term, ctx, raw, loss_key, term.rider)
  return jnp.where(persistent_active(term, ctx), value, 0.0), None


def persistent_finish(
  term: PersistentTerm, ctx: StepContext, key: Key[Array, ""],
  state: PersistentSources, raw: dict[str, Array],
  grads: dict[str, Array], aux: None,
) -> PersistentSources:
  """Return the state after the final ascent along the term's input
  gradient (I17), retaken without the rider under `e2e` (I23)."""
  del aux
  if term.rider is not None and term.ascent_rider is None:
    # The main loss's own draws; `ctx` holds the pre-update parameters and
    # stop-gradient CI.
    _, loss_key = split_pair(key)
    grads = jax.grad(
      lambda r: persistent_loss(term, ctx, r, loss_key, None))(raw)
  lr = schedules.schedule_value(term.config.lr, ctx.step, ctx.total_steps)
  stepped = _ascend_all(term, state.sources, grads, state.count, lr)
  on = persistent_active(term, ctx)
  states = jax.tree.map(lambda new, old: jnp.where(on, new, old),
                        stepped, state.sources)
  return PersistentSources(states, state.count + on.astype(jnp.int32))


def persistent_pgd_term(
  name: str,
  coeff: schedules.Coefficient,
  plan: recon.Plan,
  config: PersistentConfig,
  sites: tuple,
  with_delta: bool,
  rider: hidden.HiddenRider | None = None,
  merged: Merged | None = None,
) -> LossTerm:
  """Return a recon term whose masks come from persistent adversarial sources.

  Per step: `n_warmup` ascents with every site live and routed (I21), then the
  term's loss on the sources; its input gradient, unscaled by the coefficient
  (I20), drives one final ascent after the backward (I17). Under the `e2e`
  objective ascents maximize the output divergence alone: with a rider the
  final gradient is retaken without it, on the same draws (I23). With
  `merged`, rows mix persistent and fresh stochastic sources (§5.8).
  """
  term = PersistentTerm(plan, config, sites, with_delta, rider, merged)
  return LossTerm(name, coeff, functools.partial(persistent_value, term),
                  functools.partial(persistent_init, term),
                  functools.partial(persistent_prepare, term),
                  functools.partial(persistent_finish, term),
                  coeff_on_model_side=True,
                  clean_taps=() if rider is None else rider.points)


def fresh_draws(plan: recon.Plan, config: FreshConfig) -> int:
  """Return how many source sets the fresh term ascends per step.

  Draws of one entry differ only through a random init or random routing;
  otherwise every draw is the same forward, so the term makes one.
  """
  random = config.init == "random" or any(e.routing != "all" for e in plan)
  return max(e.n_draws for e in plan) if random else 1


def fresh_plan_loss(
  ctx: StepContext,
  sources: tuple[dict[str, Array], ...],
  plan: recon.Plan,
  route_key: Key[Array, ""],
) -> Float[Array, ""]:
  """Return the mean output divergence over the plan's forwards: draw `d`
  of entry `e` uses `sources[d]` and routes from `route_key`. With one
  source set, route-all draws are one forward (`recon.plan_mean`)."""
  forward_loss = hidden.forward_loss(ctx, None)
  lead = ctx.lead_shape()

  def draw_loss(entry, draw, keys):
    routes = recon.entry_routes(keys[0], entry, lead)
    return forward_loss(masks_lib.source_site_masks(
      ctx.ci.lower, sources[draw], entry.live_sites, routes))

  return recon.plan_mean(draw_loss, plan, (route_key,),
                         draws_differ=len(sources) > 1)


def fresh_pgd_term(
  name: str,
  coeff: schedules.Coefficient,
  plan: recon.Plan,
  config: FreshConfig,
  with_delta: bool,
) -> LossTerm:
  """Return a recon term whose masks come from per-step sign-PGD sources.

  Each of the `fresh_draws` draws has its own sources (site `s` of draw `d`
  starts from `fold_path(fold_in(source_key, d), draw_paths[s])`), ascended
  jointly. Routes are a pure function of the step's `route_key`, so every
  ascent and the loss forward see the one routing draw of the step (I24).
  The sources enter the loss as stop-gradient values (I24).
  """
  n_sets = fresh_draws(plan, config)

  def init_sources(ctx, key):
    lead = ctx.lead_shape()
    paths = sites_lib.draw_paths(ctx.target.sites)
    out = {}
    for site in ctx.target.sites:
      shape = adversary.scope_shape(config.scope, lead,
                                    site.c + int(with_delta))
      if config.init == "random":
        out[site.name] = jax.random.uniform(
          sites_lib.fold_path(key, paths[site.name]), shape)
      else:
        out[site.name] = jnp.full(shape, float(config.init == "ones"))
    return out

  def prepare(ctx, key, state):
    source_key, route_key = split_pair(key)
    sources = tuple(init_sources(ctx, jax.random.fold_in(source_key, d))
                    for d in range(n_sets))

    def loss(s):
      return fresh_plan_loss(ctx, s, plan, route_key)

    for _ in range(config.n_steps):
      grads = jax.grad(loss)(sources)
      sources = jax.tree.map(
        lambda s, g: adversary.sign_pgd_step(s, g, config.step_size),
        sources, grads)
    return state, jax.lax.stop_gradient(sources)

  def fn(ctx, key, sources):
    _, route_key = split_pair(key)
    sources = jax.lax.stop_gradient(sources)
    return fresh_plan_loss(ctx, sources, plan, route_key), None

  return LossTerm(name, coeff, fn, prepare=prepare)


def probe_sources(
  sites: tuple[sites_lib.SiteSpec, ...],
  lead: tuple[int, ...],
  key: Key[Array, ""],
  divergence: Callable[[dict[str, Array]], Float[Array, ""]],
  n_steps: int | Array,
  step_size: float,
) -> dict[str, Array]:
  """Return the eval probe's sources (SPEC §5.7) after `n_steps` sign-PGD
  ascents of `divergence(sources)`, stop-gradient: `U[0,1]` at scope `c`
  (one `[C]` vector per site, shared by every position, no delta channel;
  site `s` draws from `fold_path(key, draw_paths[s])`), each ascent
  `clip(S + step_size·sign(∂D/∂S), 0, 1)`."""
  paths = sites_lib.draw_paths(sites)
  sources = {
    s.name: jax.random.uniform(sites_lib.fold_path(key, paths[s.name]),
                               adversary.scope_shape("c", lead, s.c))
    for s in sites}

  def ascend(_, s):
    grads = jax.grad(divergence)(s)
    return {k: adversary.sign_pgd_step(s[k], grads[k], step_size) for k in s}

  # A loop, not an unrolled chain: compile time stays that of one ascent.
  return jax.lax.stop_gradient(
    jax.lax.fori_loop(0, n_steps, ascend, sources))


def pgd_probe(
  ctx: StepContext,
  key: Key[Array, ""],
  n_steps: int,
  step_size: float,
) -> Float[Array, ""]:
  """Return the output divergence at fresh sign-PGD sources (SPEC §5.7 eval
  probe, `probe_sources`): every site live and routed, against
  stop-gradient components and CI.
  """
  frozen = ctx._replace(components=jax.lax.stop_gradient(ctx.components),
                        ci=jax.lax.stop_gradient(ctx.ci))
  plan = recon.all_sites_plan(ctx.target.sites)

  def divergence(s):
    return plan_loss(frozen, s, plan, key)

  return divergence(probe_sources(ctx.target.sites, ctx.lead_shape(), key,
                                  divergence, n_steps, step_size))
