"""Loss terms as `LossTerm` records the step factory sums (SPEC §5, §6.1).

Each constructor fixes a term's configuration and returns its coefficient and
a pure function of the step context; the step multiplies by `coeff(step)`.
"""

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from decompax.core import masks as masks_lib
from decompax.core import schedules
from decompax.core.step_records import LossTerm, StepContext, simple_term
from decompax.losses import adversarial, faithfulness, hidden, minimality, recon

# What the minimality terms raise CI to: the L_p exponent `p` (a number or a
# schedule) or the smooth-L0 penalty (§5.2).
Sparsity = schedules.Coefficient | minimality.SmoothL0


def faithfulness_term(coeff: schedules.Coefficient,
                      relative: bool = False) -> LossTerm:
  """Return the per-kind faithfulness term (§5.1): the global mean squared
  delta, or with `relative` the mean over sites of `‖Δ‖²/‖W‖²` (§5.1)."""
  measure = (faithfulness.relative_faithfulness_per_kind if relative
             else faithfulness.faithfulness_per_kind)

  def fn(ctx: StepContext, key):
    del key
    w_stacks = ctx.constrain("faithfulness",
                             ctx.target.frozen_stacks(ctx.weights))
    return measure(w_stacks, ctx.constrain("faithfulness", ctx.components))

  return simple_term("faithfulness", coeff, fn)


def _frequencies(ctx: StepContext, p: Sparsity, eps: float):
  """Per site, `mean_ℓ ψ(upper)` with `ψ` the L_p power at `p`'s current
  value, or the smooth-L0 penalty at its current `γ`."""
  if isinstance(p, minimality.SmoothL0):
    gamma = schedules.schedule_value(p.gamma, ctx.step, ctx.total_steps)
    return {site: minimality.smooth_l0_frequencies(c, gamma, p.normalized)
            for site, c in ctx.ci.upper.items()}
  p_now = schedules.schedule_value(p, ctx.step, ctx.total_steps)
  return {
    site: minimality.component_frequencies(c, p_now, eps)
    for site, c in ctx.ci.upper.items()
  }


def _check_p(p: Sparsity) -> None:
  name = "p"
  if isinstance(p, minimality.SmoothL0):
    name, p = "smooth-L0 gamma", p.gamma
  if isinstance(p, schedules.Schedule) and p.warmup_pct:
    raise ValueError(f"the {name} anneal takes no warmup; set its "
                     "warmup_pct to 0")


def importance_minimality_term(
  coeff: schedules.Coefficient, p: Sparsity,
  eps: float = minimality.IMPORTANCE_EPS,
  name: str = "importance_minimality",
  site_weights: Mapping[str, float] | None = None,
) -> LossTerm:
  """Return `Σ_s w_s Σ_c mean_ℓ (upper + ε)^p` with `p` on its schedule, or
  the same over `ψ_γ(upper)` when `p` is a `SmoothL0` (§5.2); `w_s` is a
  site's entry in `site_weights`, 1 where it has none."""
  _check_p(p)

  def fn(ctx: StepContext, key):
    del key
    return minimality.importance_minimality(_frequencies(ctx, p, eps),
                                            site_weights)

  return simple_term(name, coeff, fn)


def frequency_minimality_term(
  coeff: schedules.Coefficient, p: Sparsity,
  reference_token_count: float, eps: float = minimality.IMPORTANCE_EPS,
) -> LossTerm:
  """Return `Σ_s Σ_c f·log2(1 + a'·f)` on the same `f` as imp-min (§5.3)."""
  _check_p(p)
  if reference_token_count <= 0:
    raise ValueError("reference_token_count must be positive")

  def fn(ctx: StepContext, key):
    del key
    return minimality.frequency_minimality(
      _frequencies(ctx, p, eps), reference_token_count
    )

  return simple_term("frequency_minimality", coeff, fn)


def stochastic_recon_term(
  name: str,
  coeff: schedules.Coefficient,
  plan: recon.Plan,
  with_delta: bool,
  sampling: masks_lib.Sampling = "continuous",
  rider: hidden.HiddenRider | None = None,
) -> LossTerm:
  """Return the mean loss over the plan's stochastic forwards: the output
  divergence, plus the hidden-activation rider when given (§5.9)."""

  def fn(ctx: StepContext, key, inputs):
    del inputs
    draw_key, route_key = masks_lib.split_pair(key)
    value = recon.stochastic_plan_mean(
      hidden.forward_loss(ctx, rider), ctx.ci.lower, ctx.target.sites, plan,
      draw_key, route_key, with_delta, sampling)
    return value, None

  return LossTerm(name, coeff, fn,
                  clean_taps=() if rider is None else rider.points)


def constant_recon_term(
  name: str, coeff: schedules.Coefficient, plan: recon.Plan,
) -> LossTerm:
  """Return the mean output divergence over the plan's forwards with every
  live mask at its lower CI (source 0, SPEC §5.4 `Constant(0)`): the
  non-target stream's deterministic alternative to stochastic sources."""

  def fn(ctx: StepContext, key, inputs):
    del inputs
    zero = {name: jnp.zeros_like(ci) for name, ci in ctx.ci.lower.items()}
    return adversarial.plan_loss(ctx, zero, plan, key), None

  return LossTerm(name, coeff, fn)


def unmasked_no_delta_term(
  name: str, coeff: schedules.Coefficient,
) -> LossTerm:
  """Return the output divergence of the forward with every mask 1 and the
  delta path off (`m ≡ 1`, `δ ≡ 0`, SPEC §6.6): the components alone must
  rebuild the model, whatever the stream pins."""

  def fn(ctx: StepContext, key):
    del key
    ones = {name: masks_lib.SiteMask(jnp.ones_like(ci))
            for name, ci in ctx.ci.lower.items()}
    unpinned = ctx._replace(delta_pin=False)
    return unpinned.output_divergence(unpinned.masked_forward(ones))

  return simple_term(name, coeff, fn)


def ema_frequency_minimality_term(
  coeff: schedules.Coefficient, p: Sparsity,
  reference_token_count: float, halflife_steps: float, sites: tuple,
  eps: float = minimality.IMPORTANCE_EPS,
) -> LossTerm:
  """Return frequency minimality on a running per-component firing EMA (§5.3).

  The EMA (per site `[C]`) and its observation count live in the train state.
  The term's reported value is the EMA penalty; the single-batch `ΣΦ(f)` is
  reported beside it as `frequency_minimality_batch`.
  """
  _check_p(p)
  minimality.ema_rates(halflife_steps)  # validates the half-life up front
  if reference_token_count <= 0:
    raise ValueError("reference_token_count must be positive")

  def init_state(key, lead_shape):
    del key, lead_shape
    return minimality.FrequencyEma(
      {s.name: jnp.zeros((s.c,), jnp.float32) for s in sites},
      jnp.zeros((), jnp.int32))

  def prepare(ctx, key, state):
    # The objective reads the EMA through the term's inputs; its gradient
    # with respect to them is never used.
    del ctx, key
    return state, jax.lax.stop_gradient(state)

  def stateful_fn(ctx: StepContext, key, state):
    del key
    freqs = _frequencies(ctx, p, eps)
    total = jnp.zeros((), jnp.float32)
    new_ema = {}
    for site, f in freqs.items():
      value, new_ema[site] = minimality.ema_frequency_minimality(
        f, state.ema[site], state.count, halflife_steps,
        reference_token_count)
      total = total + value
    batch = minimality.frequency_minimality(
      jax.lax.stop_gradient(freqs), reference_token_count)
    aux = {"state": minimality.FrequencyEma(new_ema, state.count + 1),
           "batch": batch}
    return total, aux

  def finish(ctx, key, state, inputs, grads, aux):
    del ctx, key, state, inputs, grads
    return aux["state"]

  def report(aux):
    return {"frequency_minimality_batch": aux["batch"]}

  return LossTerm("frequency_minimality", coeff, stateful_fn, init_state,
                  prepare, finish, report=report)
