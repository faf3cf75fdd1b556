"""Nonlinearity locality: components should write to few nonlinear units (SPEC §5.10).

A participating site partitions its output axis into `N` contiguous units
(MLP neurons, attention heads) of one unit kind, each counted with
multiplicity `μ`. For component `c` with write vector `U[c, :]`, the soft
count of units it spreads over is `μ·Σ_u f_u/(f_u + t/N)` with
`f_u = ‖w_u‖²/‖w‖²`. Weight space only: no CI enters (I43). Evals report
the soft count at `EVAL_THRESHOLD` and the participation ratio.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from decompax.core import schedules
from decompax.core.sites import Components, site_factors
from decompax.core.target import UnitSpec
from decompax.core.step_records import LossTerm, StepContext, simple_term

UNIT_KINDS = ("neuron", "attention_head")
# The soft count's threshold in evals, whatever the training schedule
# (SPEC §5.10): comparable across runs and steps.
EVAL_THRESHOLD = 4.0


def unit_fractions(u_row: Float[Array, " d_out"], n_units: int) -> Float[Array, " n"]:
  """Return each unit's share `‖w_u‖²/‖w‖²` of one write vector.

  The row is rescaled by its stop-gradient max first so tiny rows do not
  underflow; an exactly zero row gives all-zero shares with finite gradients.
  """
  scale = jax.lax.stop_gradient(jnp.max(jnp.abs(u_row)))
  w = u_row.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0)
  per_unit = jnp.sum(jnp.square(w.reshape(n_units, -1)), axis=-1)
  total = jnp.sum(per_unit)
  return per_unit / jnp.where(total > 0, total, 1.0)


def soft_unit_count(
  fractions: Float[Array, " n"], threshold: Float[Array, ""] | float,
  multiplicity: float,
) -> Float[Array, ""]:
  """Return `μ·Σ_u f_u / (f_u + t/N)` (I42)."""
  n = fractions.shape[-1]
  return multiplicity * jnp.sum(fractions / (fractions + threshold / n))


def participation_ratio(
  fractions: Float[Array, " n"], multiplicity: float
) -> Float[Array, ""]:
  """Return `μ·(Σ_u ‖w_u‖)²/Σ_u ‖w_u‖²`, the effective number of units a
  write vector spreads over (SPEC §5.10 eval), from its unit shares: with
  `f_u = ‖w_u‖²/‖w‖²` it is `μ·(Σ_u √f_u)²`; 0 for an all-zero row."""
  return multiplicity * jnp.square(jnp.sum(jnp.sqrt(fractions)))


def site_unit_fractions(
  u: Float[Array, "c d_out"], spec: UnitSpec
) -> Float[Array, "c n"]:
  """Return every component's unit shares of one site's write matrix."""
  return jax.vmap(lambda row: unit_fractions(row, spec.n_units))(u)


def site_soft_counts(
  u: Float[Array, "c d_out"], spec: UnitSpec,
  threshold: Float[Array, ""] | float,
) -> Float[Array, " c"]:
  """Return every component's soft unit count at `threshold`."""
  return jax.vmap(lambda f: soft_unit_count(f, threshold, spec.multiplicity))(
    site_unit_fractions(u, spec))


def site_participation_ratios(
  u: Float[Array, "c d_out"], spec: UnitSpec
) -> Float[Array, " c"]:
  """Return every component's participation ratio (`participation_ratio`)."""
  return jax.vmap(lambda f: participation_ratio(f, spec.multiplicity))(
    site_unit_fractions(u, spec))


def locality_loss(
  components: Components, sites: tuple, units: dict[str, UnitSpec],
  weights: dict[str, float], threshold: Float[Array, ""] | float,
) -> Float[Array, ""]:
  """Return `Σ_k w_k · mean soft count over the components of unit kind k`."""
  sums, counts = {}, {}
  for site in sites:
    spec = units.get(site.name)
    if spec is None or weights.get(spec.kind) is None:
      continue
    _, u = site_factors(components, site)
    site_counts = site_soft_counts(u, spec, threshold)
    sums[spec.kind] = sums.get(spec.kind, 0.0) + jnp.sum(site_counts)
    counts[spec.kind] = counts.get(spec.kind, 0) + site.c
  return sum(weights[k] * sums[k] / counts[k] for k in sums)


def validate_weights(
  units: dict[str, UnitSpec], weights: dict[str, float | None]
) -> None:
  """Raise unless weights name exactly the target's unit kinds, one trained."""
  present = sorted({spec.kind for spec in units.values()})
  if not present:
    raise ValueError("the target has no nonlinear units; drop the "
                     "nonlinearity locality term")
  if sorted(weights) != present:
    raise ValueError(f"nonlinearity unit weights must name exactly "
                     f"{', '.join(present)} (use none to exclude a kind), got "
                     f"{', '.join(sorted(weights)) or 'nothing'}")
  trained = [k for k, w in weights.items() if w is not None]
  if not trained:
    raise ValueError("nonlinearity locality excludes every unit kind")
  if any(weights[k] <= 0 for k in trained):
    raise ValueError("nonlinearity unit weights must be > 0 (or none)")


def nonlinearity_locality_term(
  coeff: schedules.Coefficient, threshold: schedules.Coefficient,
  units: dict[str, UnitSpec], weights: dict[str, float | None],
) -> LossTerm:
  """Return the locality term with a schedulable soft-count threshold."""
  validate_weights(units, weights)
  if any(t <= 0 for t in schedules.extreme_values(threshold)):
    raise ValueError("the nonlinearity threshold must stay > 0")

  def value(ctx: StepContext, key):
    del key
    t = schedules.schedule_value(threshold, ctx.step, ctx.total_steps)
    return locality_loss(ctx.components, ctx.target.sites, units, weights, t)

  return simple_term("nonlinearity_locality", coeff, value)
