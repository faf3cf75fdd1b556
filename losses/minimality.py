"""Importance and frequency minimality (SPEC §5.2, §5.3).

Both read per-component frequencies `f_{s,c} = mean_ℓ ψ(c_{s,ℓ,c})` of the
*upper* CI over the whole (global) batch, summed before any nonlinearity so
that sharded sums agree with one-device sums (I11).
"""

import math

import jax.numpy as jnp
from jaxtyping import Array, Float

IMPORTANCE_EPS = 1e-12


def component_frequencies(
  ci_upper: Float[Array, "*l c"], p: Float[Array, ""] | float,
  eps: float = IMPORTANCE_EPS,
) -> Float[Array, " c"]:
  """Return `mean_ℓ (c + ε)^p` per component, in fp32."""
  c = ci_upper.astype(jnp.float32)
  lead = c.shape[:-1]
  psi = jnp.power(c + eps, p)
  return jnp.sum(psi.reshape(-1, c.shape[-1]), axis=0) / math.prod(lead)


def importance_minimality(
  frequencies: dict[str, Float[Array, " c"]]
) -> Float[Array, ""]:
  """Return `Σ_s Σ_c f_{s,c}`."""
  return sum(jnp.sum(f) for f in frequencies.values())


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
