"""Hidden-activation reconstruction (SPEC §5.9).

A recon term may carry a rider that adds, per masked forward,
`coeff · mean_points(Σ(masked − clean)² / Σ clean²)` over named activations
(taps such as `<site>.out`). The rider never stands alone: it rides on the
draws of the term it belongs to. The eval metrics of the slow tier use the
unnormalised per-site sums instead (`site_squared_errors`).
"""

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from jaxtyping import Array, Float

from decompax.core import factored
from decompax.core.masks import SiteMask
from decompax.core.step_records import StepContext

# {live site: SiteMask} -> the scalar loss of one masked forward.
ForwardLoss = Callable[[dict[str, SiteMask]], Float[Array, ""]]


@dataclasses.dataclass(frozen=True)
class HiddenRider:
  """Match the masked forward's activations at `points` to the clean ones."""

  coeff: float
  points: tuple[str, ...]

  def __post_init__(self):
    if not self.points:
      raise ValueError("a hidden-activation rider needs at least one point")
    if self.coeff < 0:
      raise ValueError(f"hidden-activation coeff must be >= 0, got {self.coeff}")


def _fp32(x: factored.Activation) -> Float[Array, "..."]:
  return factored.dense(x).astype(jnp.float32)


def relative_error(
  masked: dict[str, factored.Activation],
  clean: dict[str, factored.Activation],
  points: tuple[str, ...],
) -> Float[Array, ""]:
  """Return `mean_points Σ(masked − clean)² / Σ clean²` in fp32."""
  total = jnp.zeros((), jnp.float32)
  for point in points:
    m, c = _fp32(masked[point]), _fp32(clean[point])
    total = total + jnp.sum(jnp.square(m - c)) / jnp.sum(jnp.square(c))
  return total / len(points)


def site_squared_errors(
  masked: dict[str, factored.Activation],
  clean: dict[str, factored.Activation],
  points: tuple[str, ...],
) -> dict[str, tuple[Float[Array, ""], int]]:
  """Return per point `(Σ(masked − clean)², numel)` for exact accumulation."""
  out = {}
  for point in points:
    diff = _fp32(masked[point]) - _fp32(clean[point])
    out[point] = (jnp.sum(jnp.square(diff)), diff.size)
  return out


def forward_loss(ctx: StepContext, rider: HiddenRider | None) -> ForwardLoss:
  """Return one forward's loss: output divergence, plus the rider if any;
  in a hidden pass (`ctx.hidden_points`) the relative error of those points
  alone, rider or not."""
  if ctx.hidden_points:
    points = ctx.hidden_points

    def hidden_only(site_masks):
      _, taps = ctx.masked_forward_with_taps(site_masks, points)
      return relative_error(taps, ctx.clean_taps, points)

    return hidden_only

  def output_only(site_masks):
    return ctx.output_divergence(ctx.masked_forward(site_masks))

  if rider is None:
    return output_only

  def with_rider(site_masks):
    out, taps = ctx.masked_forward_with_taps(site_masks, rider.points)
    value = ctx.output_divergence(out)
    return value + rider.coeff * relative_error(taps, ctx.clean_taps,
                                                rider.points)

  return with_rider
