"""Exact-erf GELU and its derivative as branch-free fp32 elementwise maps.

`gelu(z) = z·Φ(z)` with `Φ` the standard normal CDF, and
`gelu'(z) = Φ(z) + z·φ(z)` with `φ` its density. Both are built only from
operations XLA's CPU loop emitter vectorises (multiply-add, divide, clamp and
its own rational `erf`), so a fusion of many of them runs at a few Gelem/s.
`jax.nn.gelu(approximate=False)` instead lowers to `erfc`, which XLA expands
into three branches with an `exp` and two divides and which autodiff doubles:
about 0.2 Gelem/s. Accuracy against float64 over a dense grid of `z`:
`gelu` ≤ 3e-7·max(1, |z|), `gelu_grad` ≤ 2.5e-7 absolute, the same level as
autodiff of the `erfc` form (1.6e-7). `gelu_and_grad`, the pair from one
erf and one exp for accelerators, is within the same bounds.
"""

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

_SQRT_HALF = float(np.sqrt(0.5))
_INV_SQRT_2PI = float(1.0 / np.sqrt(2.0 * np.pi))

# gelu'(z) - 1/2 is odd, so gelu'(z) = 1/2 + z·P(z²)/Q(z²): one divide and
# 13 multiply-adds, half the cost of an erf plus an exp. Weighted
# least-squares rational fit on |z| ≤ 6 (float64 error 5e-9); past 6 the
# derivative is within 4e-8 of 0 or 1, so clamping z there costs < 1e-7.
_GRAD_CLAMP = 6.0
_GRAD_P = (
  0.7978845238685608, -0.01803741604089737, 0.013568994589149952,
  0.00028523377841338515, 3.202734296792187e-05, 1.121954824157001e-06,
  1.3002986243293435e-08, -2.8879698979467072e-11,
)
_GRAD_Q = (
  1.0, 0.3107263147830963, 0.045583050698041916, 0.004150252789258957,
  0.000258608692092821, 1.0812439541041385e-05, 3.63638321232429e-07,
)


def _horner(
  coeffs: tuple[float, ...], x: Float[Array, "*s"]
) -> Float[Array, "*s"]:
  acc = coeffs[-1]
  for c in coeffs[-2::-1]:
    acc = acc * x + c
  return acc


def gelu(z: Float[Array, "*s"]) -> Float[Array, "*s"]:
  """Return `z·Φ(z)` through `lax.erf`.

  XLA lowers `erf` to a clamped rational function that saturates to exactly
  ±1; a hand-written copy of that form measured no faster.
  """
  return 0.5 * z * (1.0 + lax.erf(z * _SQRT_HALF))


def gelu_grad(z: Float[Array, "*s"]) -> Float[Array, "*s"]:
  """Return `Φ(z) + z·φ(z)` from one rational function, no `erf` or `exp`."""
  z = jnp.clip(z, -_GRAD_CLAMP, _GRAD_CLAMP)
  u = z * z
  return 0.5 + z * (_horner(_GRAD_P, u) / _horner(_GRAD_Q, u))


def gelu_and_grad(
  z: Float[Array, "*s"]
) -> tuple[Float[Array, "*s"], Float[Array, "*s"]]:
  """Return `gelu(z)` and `gelu'(z)` from one erf and one exp.

  For a backward pass that needs both at every point on an accelerator,
  whose exp runs on its own transcendental unit beside the erf's
  multiply-adds; `gelu_grad`'s rational form suits XLA's CPU loops.
  """
  cdf = 0.5 * (1.0 + lax.erf(z * _SQRT_HALF))
  return z * cdf, cdf + z * (_INV_SQRT_2PI * jnp.exp(-0.5 * z * z))
