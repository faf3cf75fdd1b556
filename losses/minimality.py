"""Importance and frequency minimality (SPEC §5.2, §5.3).

Both read per-component frequencies `f_{s,c} = mean_ℓ ψ(c_{s,ℓ,c})` of the
*upper* CI over the whole (global) batch, summed before any nonlinearity so
that sharded sums agree with one-device sums (I11).
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from decompax.core import schedules

IMPORTANCE_EPS = 1e-12


@dataclasses.dataclass(frozen=True)
class SmoothL0:
  """The smooth-L0 penalty `ψ_γ(c) = c²/(c² + γ²)` (SPEC §5.2), in place of
  `(c + ε)^p`: near 1 for any CI well above `γ`, so it counts components
  rather than weighing their CI; annealing `γ` down sharpens the count.
  `normalized` scales by `1 + γ²`, making `ψ_γ(1) = 1` at every `γ`."""

  gamma: schedules.Coefficient
  normalized: bool = False

  def __post_init__(self):
    for value in schedules.extreme_values(self.gamma):
      if not value > 0:
        raise ValueError(f"smooth-L0 gamma must stay > 0, got {value}")


class FrequencyEma(NamedTuple):
  """The EMA form's state (`TrainState.term_states["frequency_minimality"]`).

  Field names are checkpoint paths: `ema/<site>`, `count`.
  """

  # Per site, the running firing frequency `[C]`.
  ema: dict[str, Float[Array, " c"]]
  # Observations folded in so far (`n` of SPEC §5.3).
  count: Int[Array, ""]


def component_frequencies(
  ci_upper: Float[Array, "*l c"], p: Float[Array, ""] | float,
  eps: float = IMPORTANCE_EPS,
) -> Float[Array, " c"]:
  """Return `mean_ℓ (c + ε)^p` per component, in fp32."""
  c = ci_upper.astype(jnp.float32)
  lead = c.shape[:-1]
  psi = jnp.power(c + eps, p)
  return jnp.sum(psi.reshape(-1, c.shape[-1]), axis=0) / math.prod(lead)


def smooth_l0_frequencies(
  ci_upper: Float[Array, "*l c"], gamma: Float[Array, ""] | float,
  normalized: bool = False,
) -> Float[Array, " c"]:
  """Return `mean_ℓ ψ_γ(c)` per component, in fp32 (no `ε`: ψ_γ(0) = 0
  has a finite gradient)."""
  c = ci_upper.astype(jnp.float32)
  square = jnp.square(c)
  g2 = jnp.square(jnp.asarray(gamma, jnp.float32))
  psi = square / (square + g2)
  if normalized:
    psi = psi * (1.0 + g2)
  lead = c.shape[:-1]
  return jnp.sum(psi.reshape(-1, c.shape[-1]), axis=0) / math.prod(lead)


def importance_minimality(
  frequencies: dict[str, Float[Array, " c"]],
  site_weights: Mapping[str, float] | None = None,
) -> Float[Array, ""]:
  """Return `Σ_s w_s Σ_c f_{s,c}`, `w_s` a site's weight in `site_weights`
  (1 for a site it does not name, and for every site without it)."""
  weights = site_weights or {}
  return sum(weights.get(site, 1.0) * jnp.sum(f)
             for site, f in frequencies.items())


def frequency_penalty(
  f: Float[Array, "*c"], reference_token_count: float
) -> Float[Array, "*c"]:
  """Return `Φ(f) = f·log2(1 + a'·f)` elementwise."""
  return f * jnp.log2(1.0 + reference_token_count * f)


def frequency_minimality(
  frequencies: dict[str, Float[Array, " c"]], reference_token_count: float
) -> Float[Array, ""]:
  """Return `Σ_s Σ_c Φ(f_{s,c})` with `a' = reference_token_count`."""
  return sum(
    jnp.sum(frequency_penalty(f, reference_token_count))
    for f in frequencies.values()
  )


def frequency_penalty_grad(
  f: Float[Array, "*c"], reference_token_count: float
) -> Float[Array, "*c"]:
  """Return `Φ'(f) = log2(1 + a'f) + a'f / ((1 + a'f)·ln 2)`."""
  af = reference_token_count * f
  return jnp.log2(1.0 + af) + af / ((1.0 + af) * math.log(2.0))


def ema_rates(halflife_steps: float) -> tuple[float, float]:
  """Return `(ld, α)`: the log decay per step and `1 − decay` (SPEC §5.3)."""
  if not 0.0 < halflife_steps <= 1e6:
    raise ValueError(f"ema_halflife_steps must lie in (0, 1e6], got "
                     f"{halflife_steps}")
  ld = -math.log(2.0) / halflife_steps
  return ld, -math.expm1(ld)


def ema_frequency_minimality(
  f: Float[Array, " c"], ema: Float[Array, " c"], count: Array,
  halflife_steps: float, reference_token_count: float,
) -> tuple[Float[Array, ""], Float[Array, " c"]]:
  """Return the EMA frequency penalty of one site and its updated EMA.

  The value is `ΣΦ(f̂)` of the bias-corrected EMA `f̂` (equal to `f` at the
  first observation, I13); the gradient is `Σ Φ'(f̂)·∂f/∂θ`.
  """
  ld, alpha = ema_rates(halflife_steps)
  f_sg = jax.lax.stop_gradient(f)
  new_ema = ema + alpha * (f_sg - ema)
  f_hat = new_ema / (-jnp.expm1(ld * (count.astype(jnp.float32) + 1.0)))
  slope = jax.lax.stop_gradient(frequency_penalty_grad(f_hat, reference_token_count))
  value = jnp.sum(frequency_penalty(f_hat, reference_token_count)
                  + slope * (f - f_sg))
  return value, new_ema
