"""Adversarial reconstruction terms: persistent and fresh PGD (SPEC §5.6, §5.7).

Both build masks `ci + (1 − ci)·EFF(S)[..., :C]` from per-site sources `S`
that ascend the term's reconstruction loss. Persistent sources live in the
train state across steps; fresh ones are re-initialised every step. Ascents
always see stop-gradient components and CI (I21, I24).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Key

from decompax.core import adversary, schedules
from decompax.core.masks import make_masks, split_pair
from decompax.core.site_forward import SiteMask
from decompax.core.train_step import LossTerm, StepContext
from decompax.losses import recon

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


def source_masks(
  ci_lower: dict[str, Float[Array, "*l c"]],
  sources: dict[str, Float[Array, "..."]],
  live_sites: tuple[str, ...],
  routes: dict[str, Array] | None,
) -> dict[str, SiteMask]:
  """Return masks of the live sites from (already effective) sources."""
  out = {}
  for name in live_sites:
    ci = ci_lower[name]
    source = jnp.broadcast_to(
      sources[name], (*ci.shape[:-1], sources[name].shape[-1]))
    mask, delta = make_masks(ci, source)
    out[name] = SiteMask(mask, delta, None if routes is None else routes[name])
  return out


def plan_loss(
  ctx: StepContext,
  sources: dict[str, Array],
  plan: recon.Plan,
  route_key: Key[Array, ""],
  fixed_routes: tuple | None = None,
) -> Float[Array, ""]:
  """Return the mean output divergence over the plan's forwards."""
  lead = ctx.lead_shape()
  total, count = jnp.zeros((), jnp.float32), 0
  for e, entry in enumerate(plan):
    for d in range(entry.n_draws):
      if fixed_routes is not None:
        routes = fixed_routes[e]
      else:
        key = jax.random.fold_in(jax.random.fold_in(route_key, e), d)
        routes = recon.entry_routes(key, entry, lead)
      masks = source_masks(ctx.ci.lower, sources, entry.live_sites, routes)
      total = total + ctx.target.divergence(
        ctx.masked_forward(masks), ctx.clean_output)
      count += 1
  return total / count


def _all_sites_plan(ctx: StepContext) -> recon.Plan:
  return recon.all_sites_plan(ctx.target.sites, "all", 1)


def persistent_pgd_term(
  name: str,
  coeff: schedules.Coefficient,
  plan: recon.Plan,
  config: PersistentConfig,
  sites: tuple,
  with_delta: bool,
) -> LossTerm:
  """Return a recon term whose masks come from persistent adversarial sources.

  Per step: `n_warmup` ascents with every site live and routed (I21), then the
  term's loss on the sources; its input gradient, unscaled by the coefficient
  (I20), drives one final ascent after the backward (I17).
  """
  parametrization = config.source.parametrization

  def init_state(key, lead_shape):
    keys = jax.random.split(key, len(sites))
    states = {}
    for site, site_key in zip(sites, keys):
      shape = adversary.scope_shape(
        config.source.scope, lead_shape, site.c + int(with_delta))
      states[site.name] = adversary.init_source(site_key, shape, parametrization)
    return {"sources": states, "count": jnp.zeros((), jnp.int32)}

  def effective(states):
    return {k: adversary.effective(s.source, parametrization)
            for k, s in states.items()}

  def ascend_all(states, grads, count, lr):
    return {k: adversary.ascend(states[k], grads[k], count, lr, config.source)
            for k in states}

  def active(ctx):
    return ctx.step >= int(config.start_frac * ctx.total_steps)

  def prepare(ctx, key, state):
    del key
    lr = schedules.schedule_value(config.lr, ctx.step, ctx.total_steps)
    states, count = state["sources"], state["count"]
    warm_plan = _all_sites_plan(ctx)

    def adv_loss(raw):
      eff = {k: adversary.effective(v, parametrization) for k, v in raw.items()}
      return plan_loss(ctx, eff, warm_plan, jax.random.key(0))

    for _ in range(config.n_warmup):
      raw = {k: s.source for k, s in states.items()}
      grads = jax.grad(adv_loss)(raw)
      stepped = ascend_all(states, grads, count, lr)
      states = jax.tree.map(
        lambda new, old: jnp.where(active(ctx), new, old), stepped, states)
      count = count + active(ctx).astype(jnp.int32)
    raw = jax.lax.stop_gradient({k: s.source for k, s in states.items()})
    return {"sources": states, "count": count}, raw

  def fn(ctx, key, raw):
    _, route_key = split_pair(key)
    eff = {k: adversary.effective(v, parametrization) for k, v in raw.items()}
    value = plan_loss(ctx, eff, plan, route_key)
    return jnp.where(active(ctx), value, 0.0), None

  def finish(state, raw, grads, aux, ctx):
    del raw, aux
    lr = schedules.schedule_value(config.lr, ctx.step, ctx.total_steps)
    states, count = state["sources"], state["count"]
    stepped = ascend_all(states, grads, count, lr)
    on = active(ctx)
    states = jax.tree.map(lambda new, old: jnp.where(on, new, old),
                          stepped, states)
    return {"sources": states, "count": count + on.astype(jnp.int32)}

  return LossTerm(name, coeff, fn, init_state, prepare, finish,
                  coeff_on_model_side=True)


def fresh_pgd_term(
  name: str,
  coeff: schedules.Coefficient,
  plan: recon.Plan,
  config: FreshConfig,
  with_delta: bool,
) -> LossTerm:
  """Return a recon term whose masks come from per-step sign-PGD sources.

  Routing is drawn once per step and shared by every ascent and the loss
  forward; the sources enter the loss as stop-gradient values (I24).
  """

  def init_sources(ctx, key):
    lead = ctx.lead_shape()
    out = {}
    for i, site in enumerate(ctx.target.sites):
      shape = adversary.scope_shape(config.scope, lead,
                                    site.c + int(with_delta))
      if config.init == "random":
        out[site.name] = jax.random.uniform(jax.random.fold_in(key, i), shape)
      else:
        out[site.name] = jnp.full(shape, float(config.init == "ones"))
    return out

  def prepare(ctx, key, state):
    source_key, route_key = split_pair(key)
    lead = ctx.lead_shape()
    routes = tuple(
      recon.entry_routes(jax.random.fold_in(route_key, e), entry, lead)
      for e, entry in enumerate(plan))
    sources = init_sources(ctx, source_key)

    def loss(s):
      return plan_loss(ctx, s, plan, route_key, routes)

    for _ in range(config.n_steps):
      grads = jax.grad(loss)(sources)
      sources = {k: adversary.sign_pgd_step(sources[k], grads[k],
                                            config.step_size)
                 for k in sources}
    return state, (jax.lax.stop_gradient(sources), routes)

  def fn(ctx, key, inputs):
    del key
    sources, routes = inputs
    sources = jax.lax.stop_gradient(sources)
    return plan_loss(ctx, sources, plan, jax.random.key(0), routes), None

  return LossTerm(name, coeff, fn, prepare=prepare)
