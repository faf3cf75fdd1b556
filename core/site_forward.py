"""One site's decomposed matmul (SPEC §3.2) and embedding (SPEC §3.7).

`x: [*L, d_in]`, or token ids `t: [*L]` for an embedding; the `SiteMask` it
consumes (`core.masks`) holds masks, delta masks and routes that share the
leading shape `*L` (or broadcast over size-1 axes of it).

An embedding is `x @ W` for the one-hot `x = onehot(t)`, and every function
here computes it as that product would, with the one-hot never formed: the
frozen output is the row `W[t]`, a component's activation the entry
`V[t, c]`, both gathered (I53).
"""

from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from decompax.core import factored
from decompax.core.masks import SiteMask
from decompax.core.sites import SiteSpec, is_embedding


def decomposed_matmul(
  x: Float[Array, "*l d_in"],
  w: Float[Array, "d_in d_out"],
  v: Float[Array, "d_in c"],
  u: Float[Array, "c d_out"],
  site_mask: SiteMask,
) -> Float[Array, "*l d_out"]:
  """Return `(x·V ⊙ m)·U + δ·(x·W − x·V·U)`, or `x·W` where unrouted."""
  return _masked_pieces(x @ v, lambda: x @ w, u, site_mask)


def _masked_pieces(
  a: Float[Array, "*l c"],
  frozen: Callable[[], Float[Array, "*l d_out"]],
  u: Float[Array, "c d_out"],
  site_mask: SiteMask,
) -> Float[Array, "*l d_out"]:
  """Return `(a ⊙ m)·U + δ·(frozen − a·U)`, or `frozen` where unrouted,
  from the component activations `a` and the frozen output, which is only
  formed when the delta or the route needs it."""
  y = (a * site_mask.mask) @ u
  if site_mask.delta is not None:
    # The delta path is the frozen output less a·U, formed without the
    # [d_in, d_out] delta; its a·U term is deliberately unmasked.
    y = y + site_mask.delta[..., None] * (frozen() - a @ u)
  if site_mask.route is not None:
    y = jnp.where(site_mask.route[..., None], y, frozen())
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


def rows(
  table: Float[Array, "vocab d"], tokens: Int[Array, "*l"]
) -> Float[Array, "*l d"]:
  """Return `table[t]` for every token id, NaN rows for ids outside
  `[0, vocab)`.

  Inside a traced step an id cannot be refused, and a gather would clamp it
  to a valid row silently; a NaN row reaches the outputs and the losses,
  which the step's finiteness record stops on (I46). Concrete ids, as an
  eager call gets them, are checked (`check_token_ids`).
  """
  vocab = table.shape[0]
  check_token_ids(tokens, vocab, "token ids")
  # Negative ids would wrap numpy-style: send them out of range too.
  index = jnp.where(tokens < 0, vocab, tokens)
  return jnp.take(table, index, axis=0, mode="fill", fill_value=jnp.nan)


def check_token_ids(tokens: Any, vocab: int, where: str) -> None:
  """Raise ValueError unless every concrete id lies in `[0, vocab)`.

  Traced ids pass unchecked (their values do not exist yet; `rows` turns a
  bad one into NaN). `where` names the input in the message.
  """
  if isinstance(tokens, jax.core.Tracer):
    return
  ids = np.asarray(tokens)
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{where}: token ids must be integers, got {ids.dtype}")
  if ids.size and (ids.min() < 0 or ids.max() >= vocab):
    bad = ids[(ids < 0) | (ids >= vocab)]
    raise ValueError(f"{where}: token id {int(bad.flat[0])} is outside the "
                     f"vocabulary [0, {vocab}); give ids below {vocab}")


def component_acts(
  site: SiteSpec, x: Any, v: Float[Array, "d_in c"]
) -> Float[Array, "*l c"]:
  """Return the site's component activations: `x @ V` (a factored `x`
  projected without being formed), or the rows `V[t]` of an embedding."""
  if is_embedding(site):
    return rows(v, x)
  return factored.project(x, v)


def decomposed_embedding(
  tokens: Int[Array, "*l"],
  w: Float[Array, "vocab d_out"],
  v: Float[Array, "vocab c"],
  u: Float[Array, "c d_out"],
  site_mask: SiteMask,
) -> Float[Array, "*l d_out"]:
  """Return `(V[t] ⊙ m)·U + δ·(W[t] − V[t]·U)`, or `W[t]` where unrouted:
  `decomposed_matmul` of `onehot(t)`, with rows gathered: the delta
  component's row is `W[t] − V[t]·U`, never the whole `Δ`."""
  return _masked_pieces(rows(v, tokens), lambda: rows(w, tokens), u,
                        site_mask)


def site_embedding(
  tokens: Int[Array, "*l"],
  w: Float[Array, "vocab d_out"],
  v: Float[Array, "vocab c"],
  u: Float[Array, "c d_out"],
  site_mask: Optional[SiteMask],
) -> Float[Array, "*l d_out"]:
  """Return the frozen rows `W[t]` for a non-live site, else the decomposed
  embedding."""
  if site_mask is None:
    return rows(w, tokens)
  return decomposed_embedding(tokens, w, v, u, site_mask)
