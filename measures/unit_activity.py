"""The activity of a model's own units at each position, the baselines a
decomposition's components are measured against (`tag_profile`).

Every activity is non-negative, one value per position and unit, as a
component's CI is:
- **GLU neuron** `i` of an MLP: the positive part of `act(gate_i)·up_i`,
  the value the down projection reads (SPEC §9.1). Its sign carries no
  meaning of its own (the down projection could flip it), so the negative
  side is not a second unit; the positive part is the neuron's firing.
- **Plain MLP neuron** `i` (no gate, GPT-2's and Pythia's): the positive
  part of `act(up_i)`, again what the down projection reads.
- **Gate alone**: the positive part of `act(gate_i)` (gated MLPs only).
- **Rotated neurons** (a floor): the same hidden vector (`act(gate)·up`,
  or `act(up)`) in a random orthonormal basis of the neurons' space,
  positive part. A unit of this basis mixes every neuron, so it has no
  reason to be selective; a method that does no better than the rotation
  finds nothing the basis did not.
- **Attention head** `h`: the norm of what the head writes into the
  residual stream, `‖z_h·W_O[h]‖₂`, with `z_h` the head's attention output
  at the position (`o_proj`'s input, split by head) and `W_O[h]` its rows
  of `o_proj`. Unlike `‖z_h‖`, it counts only what reaches the residual.
"""

from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Key


def mlp_hidden(
  up: Float[Array, "*l f"], gate: Optional[Float[Array, "*l f"]] = None,
  act: Callable[[Array], Array] = jax.nn.silu,
) -> Float[Array, "*l f"]:
  """Return the vector the down projection reads (fp32): `act(gate)·up`
  for a gated MLP, `act(up)` for a plain one (`gate` None)."""
  up = up.astype(jnp.float32)
  if gate is None:
    return act(up)
  return act(gate.astype(jnp.float32)) * up


def neuron_activity(hidden: Float[Array, "*l f"]) -> Float[Array, "*l f"]:
  """Return each neuron's firing: the positive part of its hidden value."""
  return jnp.maximum(hidden, 0.0)


def gate_activity(
  gate: Float[Array, "*l f"], act: Callable[[Array], Array] = jax.nn.silu,
) -> Float[Array, "*l f"]:
  """Return the positive part of `act(gate)` (fp32)."""
  return neuron_activity(act(gate.astype(jnp.float32)))


def random_rotation(key: Key[Array, ""], n: int) -> Float[Array, "n n"]:
  """Return an orthogonal `[n, n]` matrix drawn uniformly (Haar) from `key`:
  the Q of a Gaussian matrix's QR, its columns' signs fixed by R's
  diagonal so the draw does not depend on the QR's sign convention."""
  q, r = jnp.linalg.qr(jax.random.normal(key, (n, n), jnp.float32))
  return q * jnp.where(jnp.diagonal(r) < 0, -1.0, 1.0)


def rotated_activity(
  hidden: Float[Array, "*l f"], rotation: Float[Array, "f f"],
) -> Float[Array, "*l f"]:
  """Return the positive part of the hidden vector in the basis of the
  rotation's columns."""
  return neuron_activity(hidden @ rotation)


def head_activity(
  o_in: Float[Array, "*l q"], w_o: Float[Array, "q d"], n_heads: int,
) -> Float[Array, "*l h"]:
  """Return the norm of each head's write into the residual stream.

  Through each head's Gram matrix `W_O[h]·W_O[h]ᵀ` (`[head_dim]²`), so no
  `[*l, heads, d]` tensor of per-head writes is formed.
  """
  head_dim = o_in.shape[-1] // n_heads
  z = o_in.astype(jnp.float32).reshape(*o_in.shape[:-1], n_heads, head_dim)
  w = w_o.astype(jnp.float32).reshape(n_heads, head_dim, -1)
  gram = jnp.einsum("hie,hje->hij", w, w)
  squared = jnp.einsum("...hi,hij,...hj->...h", z, gram, z)
  return jnp.sqrt(jnp.maximum(squared, 0.0))


def firing_density(ci: Float[Array, "*l c"]) -> Float[Array, " c"]:
  """Return each component's firing density: its share of positions with
  CI above zero."""
  c = ci.shape[-1]
  return jnp.mean(ci.reshape(-1, c) > 0, axis=0, dtype=jnp.float32)


def median_alive_density(ci: Float[Array, "*l c"]) -> Float[Array, ""]:
  """Return the median firing density of the components that fire at all
  (NaN when none does): the share of positions a density-matched neuron
  keeps."""
  density = firing_density(ci)
  return jnp.nanmedian(jnp.where(density > 0, density, jnp.nan))


def mean_l0(ci: Float[Array, "*l c"]) -> Float[Array, ""]:
  """Return the mean over positions of how many components have CI above
  zero."""
  c = ci.shape[-1]
  return jnp.mean(jnp.sum(ci.reshape(-1, c) > 0, axis=1, dtype=jnp.float32))


def top_share_thresholds(
  activity: Float[Array, "*l f"], share: Float[Array, ""],
) -> Float[Array, " f"]:
  """Return per unit the threshold that `activity > threshold` passes at
  `m = round(share·P)` of the `P` positions: the (m+1)-th largest value
  (−1, which passes every position, for `m = P`; NaN `share` passes none).
  Ties at the threshold pass none of the tied positions."""
  f = activity.shape[-1]
  ordered = jnp.sort(activity.reshape(-1, f).astype(jnp.float32), axis=0)
  p = ordered.shape[0]
  m = jnp.round(jnp.nan_to_num(share, nan=0.0) * p).astype(jnp.int32)
  at = jnp.clip(p - 1 - m, 0, p - 1)
  threshold = jnp.where(m >= p, -1.0, ordered[at])
  return jnp.where(jnp.isnan(share), jnp.inf, threshold)


def density_matched_activity(
  activity: Float[Array, "*l f"], threshold: Float[Array, " f"],
) -> Float[Array, "*l f"]:
  """Return each unit's activity where it exceeds its threshold, 0
  elsewhere (`top_share_thresholds`: each unit kept at its top positions)."""
  return jnp.where(activity > threshold, activity, 0.0)


def top_k_activity(
  activity: Float[Array, "*l f"], k: Int[Array, ""],
) -> Float[Array, "*l f"]:
  """Return, at each position, the activity of its `k` most active units,
  0 for the others (`k` ≤ 0 keeps none; units tied with the k-th are
  kept too, which for non-negative activity adds only units at 0 or at
  an exact tie)."""
  f = activity.shape[-1]
  ordered = jnp.sort(activity, axis=-1)
  kth = jnp.take(ordered, jnp.clip(f - k, 0, f - 1), axis=-1)[..., None]
  return jnp.where((k > 0) & (activity >= kth), activity, 0.0)
