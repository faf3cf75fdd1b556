"""Mask sources, masks and routing (SPEC §5.4, invariant I1).

A *source* has `C + 1` channels when the delta component is on (the last one
is the delta channel) and `C` otherwise. `*l` is the leading shape of the
activation the mask multiplies.
"""

from typing import Literal, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Key

from decompax.core import rng

Sampling = Literal["continuous", "binomial"]


def make_masks(
  ci_lower: Float[Array, "*l c"], source: Float[Array, "*l s"]
) -> tuple[Float[Array, "*l c"], Optional[Float[Array, "*l"]]]:
  """Return `(ci + (1 − ci)·source[..., :C], source[..., C] or None)`.

  The delta channel is taken raw: it has no CI to interpolate from.
  """
  c = ci_lower.shape[-1]
  if source.shape[-1] not in (c, c + 1):
    raise ValueError(f"source has {source.shape[-1]} channels; want {c} or {c+1}")
  source = source.astype(ci_lower.dtype)
  mask = ci_lower + (1.0 - ci_lower) * source[..., :c]
  delta = source[..., c] if source.shape[-1] == c + 1 else None
  return mask, delta


def stochastic_source(
  key: Key[Array, ""],
  lead_shape: tuple[int, ...],
  c: int,
  with_delta: bool,
  sampling: Sampling = "continuous",
) -> Float[Array, "..."]:
  """Draw a fresh source: `U[0,1]`, or `{0,1}` w.p. ½ for `binomial`.

  Under `binomial` the delta channel stays `U[0,1]`.
  """
  shape = (*lead_shape, c + int(with_delta))
  uniform = rng.uniform(key, shape)
  if sampling == "continuous":
    return uniform
  if sampling != "binomial":
    raise ValueError(f"unknown sampling {sampling!r}; use continuous|binomial")
  bits = rng.bernoulli(jax.random.fold_in(key, 1), 0.5, (*lead_shape, c))
  components = bits.astype(jnp.float32)
  if not with_delta:
    return components
  return jnp.concatenate([components, uniform[..., c:]], axis=-1)


def uniform_k_routes(
  key: Key[Array, ""], lead_shape: tuple[int, ...], n_sites: int
) -> Bool[Array, "*l n"]:
  """Route a uniform `k ~ U{1..n}` subset of `n` live sites per position.

  The subset is the `k` sites with the smallest i.i.d. uniform ranks, so every
  `k`-subset is equally likely given `k`.
  """
  k_key, rank_key = jax.random.split(key)
  k = rng.randint(k_key, (*lead_shape, 1), 1, n_sites + 1)
  scores = rng.uniform(rank_key, (*lead_shape, n_sites))
  ranks = jnp.argsort(jnp.argsort(scores, axis=-1), axis=-1)
  return ranks < k


def static_probability_routes(
  key: Key[Array, ""], lead_shape: tuple[int, ...], n_sites: int, p: float
) -> Bool[Array, "*l n"]:
  """Route each (position, site) independently with probability `p`."""
  return rng.bernoulli(key, p, (*lead_shape, n_sites))


def split_pair(key: Key[Array, ""]) -> tuple[Key[Array, ""], Key[Array, ""]]:
  """Return a term's `(draw_key, route_key)` (SPEC §6.1)."""
  draw_key, route_key = jax.random.split(key)
  return draw_key, route_key
