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
from jaxtyping import Array, Float, Key


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
