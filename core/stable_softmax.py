"""The log-softmax every fp32 divergence and cross entropy over a vocabulary
takes.

`jax.nn.log_softmax` leaves its row maximum free to fuse with the
exponentials that follow it, and on a TPU the compiler then computes that
maximum as a sliding window the width of the row: brown_m's fp32 KL over a
vocabulary of 8,192 took 24.9 ms a forward and gradient, 26% of its
training step, where this one takes 1.9 (docs/performance.md, "The brown_m
step"). The maximum here is computed on its own, behind an optimization
barrier. The values are the same function's, equal to rounding: 1.6e-8 at
most on a TPU at brown_m's head; on a CPU bitwise at the bench's shapes,
and within 1e-7 relative in a targeted run's eval cross entropy, where the
compiler fuses the two forms' sums differently.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def log_softmax(x: Float[Array, "*l v"], axis: int = -1
                ) -> Float[Array, "*l v"]:
  """Return `x − logsumexp(x)` along `axis`, shifted by the row maximum
  (held out of the gradient) for stability, as `jax.nn.log_softmax` is."""
  row_max = jax.lax.optimization_barrier(jnp.max(x, axis, keepdims=True))
  shifted = x - jax.lax.stop_gradient(row_max)
  return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis, keepdims=True))
