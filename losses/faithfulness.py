"""Faithfulness: the components must sum to the frozen weights (SPEC §5.1).

`L = Σ_s ‖W_s − V_s·U_s‖²_F / Σ_s d_in·d_out`, fp32 throughout (I10). The
per-kind form stacks same-shaped sites on a `layer` axis and forms each
kind's deltas with one batched matmul; its value equals the per-site form up
to summation order and its deltas and gradients are identical (I9).

The relative form (SPEC §5.1) is `mean_s ‖Δ_s‖²_F / ‖W_s‖²_F`: each site
counts equally whatever its size and scale, where the global mean lets the
largest matrices dominate.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from decompax.core.sites import Components


def weight_delta(
  w: Float[Array, "*n d_in d_out"],
  v: Float[Array, "*n d_in c"],
  u: Float[Array, "*n c d_out"],
) -> Float[Array, "*n d_in d_out"]:
  """Return `W − V·U` in fp32 (batched over any leading axes)."""
  w = w.astype(jnp.float32)
  return w - jnp.einsum("...ic,...co->...io", v, u)


def faithfulness_per_site(
  w: dict[str, Float[Array, "d_in d_out"]],
  v: dict[str, Float[Array, "d_in c"]],
  u: dict[str, Float[Array, "c d_out"]],
) -> Float[Array, ""]:
  """Return the global mean squared delta, one matmul per site (reference)."""
  total = sum(jnp.sum(jnp.square(weight_delta(w[s], v[s], u[s]))) for s in w)
  count = sum(w[s].size for s in w)
  return total / count


def faithfulness_per_kind(
  w_stacks: dict[str, Float[Array, "layer d_in d_out"]], components: Components
) -> Float[Array, ""]:
  """Return the global mean squared delta, one batched matmul per kind.

  Only the kinds in `components` count, so `w_stacks` may hold the target's
  every kind. Rematerialised: the `[layer, d_in, d_out]` deltas are
  recomputed in the backward rather than stored between the two passes.
  """

  @jax.checkpoint
  def sum_sq(w, v, u):
    return jnp.sum(jnp.square(weight_delta(w, v, u)))

  total = sum(
    sum_sq(w_stacks[k], components[k].v, components[k].u) for k in components
  )
  count = sum(w_stacks[k].size for k in components)
  return total / count


def relative_faithfulness_per_kind(
  w_stacks: dict[str, Float[Array, "layer d_in d_out"]], components: Components
) -> Float[Array, ""]:
  """Return `mean_s ‖W_s − V_s·U_s‖² / ‖W_s‖²` over every site of the kinds
  in `components`, one batched matmul per kind (rematerialised as above)."""

  @jax.checkpoint
  def ratios(w, v, u):
    delta_sq = jnp.sum(jnp.square(weight_delta(w, v, u)), axis=(-2, -1))
    return delta_sq / jnp.sum(jnp.square(w.astype(jnp.float32)), axis=(-2, -1))

  per_kind = [ratios(w_stacks[k], components[k].v, components[k].u)
              for k in components]
  return sum(jnp.sum(r) for r in per_kind) / sum(r.size for r in per_kind)
