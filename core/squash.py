"""Causal-importance squashings (SPEC §4.1).

Both map CI pre-activations `x` elementwise. `lower` feeds every mask, `upper`
feeds importance minimality only; `lower == clamp(upper, 0, 1)` pointwise.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

LEAK = 0.01


class CIOutput(NamedTuple):
  """Per-site CI pre-activations and both squashings, each `[*L, C_s]`."""

  pre: dict[str, Float[Array, "..."]]
  lower: dict[str, Float[Array, "..."]]
  upper: dict[str, Float[Array, "..."]]


@jax.custom_vjp
def lower_leaky_hard(x: Float[Array, "*s"]) -> Float[Array, "*s"]:
  """Return `clamp(x, 0, 1)`; the backward leaks below 0 only for g < 0."""
  return jnp.clip(x, 0.0, 1.0)


def _lower_fwd(x):
  return jnp.clip(x, 0.0, 1.0), x


def _lower_bwd(x, g):
  # A mask may pull CI up from the floor (g < 0 raises x under descent) but
  # sparsity pressure (g > 0) cannot push it further below 0. x == 0 belongs to
  # the floor branch and x == 1 to the linear branch, hence `<=` twice.
  below = jnp.where(g < 0, LEAK * g, jnp.zeros_like(g))
  inside = jnp.where(x <= 1.0, g, jnp.zeros_like(g))
  return (jnp.where(x <= 0.0, below, inside),)


lower_leaky_hard.defvjp(_lower_fwd, _lower_bwd)


def upper_leaky_hard(x: Float[Array, "*s"]) -> Float[Array, "*s"]:
  """Return `clamp(x, 0, 1)` below 1 and `1 + LEAK·(x − 1)` above it."""
  return jnp.where(x > 1.0, 1.0 + LEAK * (x - 1.0), jnp.clip(x, 0.0, 1.0))


def squash(pre: dict[str, Float[Array, "..."]]) -> CIOutput:
  """Return both squashings of every site's CI pre-activations."""
  return CIOutput(
    pre=pre,
    lower={site: lower_leaky_hard(x) for site, x in pre.items()},
    upper={site: upper_leaky_hard(x) for site, x in pre.items()},
  )
