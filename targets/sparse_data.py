"""Sparse-feature inputs shared by the toy targets (SPEC §10).

A batch is `x: [b, n]`: each of the `n` features is independently active with
probability `probability`, with a value drawn from `U[low, high]`, and is 0
otherwise (`at_least_zero_active`: a row may be all zero).
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Key

from decompax.core import rng


def sample_sparse_features(
  key: Key[Array, ""],
  batch_size: int,
  n_features: int,
  probability: float,
  low: float,
  high: float,
) -> Float[Array, "b n"]:
  """Return a batch of sparse feature vectors (`at_least_zero_active`)."""
  # One uniform draw serves both choices: given `u < ρ`, `u/ρ` is U[0, 1).
  # Halves the RNG work, which dominates toy-target training on CPU.
  u = rng.uniform(key, (batch_size, n_features))
  values = low + (high - low) * (u / probability)
  return jnp.where(u < probability, values, 0.0)


def feature_probe(n_features: int, value: float = 0.75) -> Float[Array, "n n"]:
  """Return the CI probe batch: row `i` is `value·e_i`."""
  return value * jnp.eye(n_features, dtype=jnp.float32)
