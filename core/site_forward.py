"""One site's decomposed matmul (SPEC §3.2).

`x: [*L, d_in]`; the `SiteMask` it consumes (`core.masks`) holds masks,
delta masks and routes that share the leading shape `*L` (or broadcast over
size-1 axes of it).
"""

from typing import Optional

import jax.numpy as jnp
from jaxtyping import Array, Float

from decompax.core.masks import SiteMask


def decomposed_matmul(
  x: Float[Array, "*l d_in"],
  w: Float[Array, "d_in d_out"],
  v: Float[Array, "d_in c"],
  u: Float[Array, "c d_out"],
  site_mask: SiteMask,
) -> Float[Array, "*l d_out"]:
  """Return `(x·V ⊙ m)·U + δ·(x·W − x·V·U)`, or `x·W` where unrouted."""
  a = x @ v
  y = (a * site_mask.mask) @ u
  if site_mask.delta is not None:
    # The delta path is x·(W − VU) formed without the [d_in, d_out] delta;
    # its a·U term is deliberately unmasked.
    y = y + site_mask.delta[..., None] * (x @ w - a @ u)
  if site_mask.route is not None:
    y = jnp.where(site_mask.route[..., None], y, x @ w)
  return y


def site_matmul(
  x: Float[Array, "*l d_in"],
  w: Float[Array, "d_in d_out"],
  v: Float[Array, "d_in c"],
  u: Float[Array, "c d_out"],
  site_mask: Optional[SiteMask],
) -> Float[Array, "*l d_out"]:
  """Return the frozen `x·W` for a non-live site, else the decomposed path."""
  if site_mask is None:
    return x @ w
  return decomposed_matmul(x, w, v, u, site_mask)
