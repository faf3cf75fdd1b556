"""Nonlinearity locality: components should write to few nonlinear units (SPEC §5.10).

A participating site partitions its output axis into `N` contiguous units
(MLP neurons, attention heads) of one unit kind, each counted with
multiplicity `μ`. For component `c` with write vector `U[c, :]`, the soft
count of units it spreads over is `μ·Σ_u f_u/(f_u + t/N)` with
`f_u = ‖w_u‖²/‖w‖²`. Weight space only: no CI enters (I43).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from decompax.core import schedules
from decompax.core.sites import Components, site_factors
from decompax.core.target import UnitSpec
from decompax.core.train_step import LossTerm, StepContext, simple_term

UNIT_KINDS = ("neuron", "attention_head")


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
    fractions = jax.vmap(lambda row: unit_fractions(row, spec.n_units))(u)
    site_counts = jax.vmap(
      lambda f: soft_unit_count(f, threshold, spec.multiplicity))(fractions)
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
  if isinstance(threshold, schedules.Schedule):
    knots = (threshold.start, threshold.start * threshold.final_frac)
  else:
    knots = (threshold,)
  if any(t <= 0 for t in knots):
    raise ValueError("the nonlinearity threshold must stay > 0")

  def value(ctx: StepContext, key):
    del key
    t = schedules.schedule_value(threshold, ctx.step, ctx.total_steps)
    return locality_loss(ctx.components, ctx.target.sites, units, weights, t)

  return simple_term("nonlinearity_locality", coeff, value)
