"""Activations handed over in factored form: `Σ_k coefs[k] @ bases[k] + const`.

A target whose stream is much wider than what writes into it (the residual
MLP: a 1000-wide residual written by 100 features and 50-wide layers) can
give a tap without forming it. A reader that contracts the tap with a
matrix `M` then takes `coef @ (basis @ M)`: the wide contraction runs
between weights, once, instead of between batch rows, and so does its
gradient. Readers that need the values themselves call `dense`.
"""

from typing import Any, NamedTuple, Optional

from jaxtyping import Array, Float, Int


class Factored(NamedTuple):
  """The activation `Σ_k coefs[k] @ bases[k] + const`, never formed."""

  coefs: tuple[Float[Array, "..."], ...]
  bases: tuple[Float[Array, "_n d"], ...]
  const: Optional[Float[Array, " d"]] = None


# What a target may hand over as a tap: an embedding site's input tap is its
# token ids (SPEC §3.7).
Activation = Float[Array, "..."] | Int[Array, "..."] | Factored


def project(x: Any, m: Float[Array, "d d_out"]) -> Float[Array, "*b d_out"]:
  """Return `x @ m` for a dense or factored `x`.

  Factored, the terms are summed in their fixed order (a zero coefficient
  adds an exact ±0), so equal factors give bit-equal results.
  """
  if not isinstance(x, Factored):
    return x @ m
  out = None
  for coef, basis in zip(x.coefs, x.bases):
    term = coef @ (basis @ m)
    out = term if out is None else out + term
  if x.const is not None:
    out = out + x.const @ m
  return out


def dense(x: Any) -> Float[Array, "*b d"]:
  """Return the values of a dense or factored activation."""
  if not isinstance(x, Factored):
    return x
  out = None
  for coef, basis in zip(x.coefs, x.bases):
    term = coef @ basis
    out = term if out is None else out + term
  if x.const is not None:
    out = out + x.const
  return out

