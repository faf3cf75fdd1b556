"""Loss terms as `LossTerm` records the step factory sums (SPEC §5, §6.1).

Each constructor fixes a term's configuration and returns its coefficient and
a pure function of the step context; the step multiplies by `coeff(step)`.
"""

from decompax.core import masks as masks_lib
from decompax.core import schedules
from decompax.core.train_step import LossTerm, StepContext, simple_term
from decompax.losses import faithfulness, minimality, recon


def faithfulness_term(coeff: schedules.Coefficient) -> LossTerm:
  """Return the per-kind faithfulness term (§5.1)."""

  def fn(ctx: StepContext, key):
    del key
    w_stacks = ctx.target.frozen_stacks(ctx.weights)
    return faithfulness.faithfulness_per_kind(w_stacks, ctx.components)

  return simple_term("faithfulness", coeff, fn)


def _frequencies(ctx: StepContext, p: schedules.Coefficient, eps: float):
  p_now = schedules.schedule_value(p, ctx.step, ctx.total_steps)
  return {
    site: minimality.component_frequencies(c, p_now, eps)
    for site, c in ctx.ci.upper.items()
  }


def _check_p(p: schedules.Coefficient) -> None:
  if isinstance(p, schedules.Schedule) and p.warmup_pct:
    raise ValueError("the p-anneal takes no warmup; set its warmup_pct to 0")


def importance_minimality_term(
  coeff: schedules.Coefficient, p: schedules.Coefficient,
  eps: float = minimality.IMPORTANCE_EPS,
) -> LossTerm:
  """Return `Σ_s Σ_c mean_ℓ (upper + ε)^p` with `p` on its schedule (§5.2)."""
  _check_p(p)

  def fn(ctx: StepContext, key):
    del key
    return minimality.importance_minimality(_frequencies(ctx, p, eps))

  return simple_term("importance_minimality", coeff, fn)


def frequency_minimality_term(
  coeff: schedules.Coefficient, p: schedules.Coefficient,
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
) -> LossTerm:
  """Return the mean output divergence over the plan's stochastic forwards."""

  def fn(ctx: StepContext, key):
    draw_key, route_key = masks_lib.split_pair(key)
    return recon.stochastic_recon_loss(
      ctx.masked_forward, ctx.clean_output, ctx.ci.lower, ctx.target.sites,
      plan, draw_key, route_key, ctx.target.divergence, with_delta, sampling,
    )

  return simple_term(name, coeff, fn)
