"""Sparse-feature inputs shared by the toy targets (SPEC §10).

A batch is `x: [b, n]`: each of the `n` features is independently active with
probability `probability`, with a value drawn from `U[low, high]`, and is 0
otherwise (`at_least_zero_active`: a row may be all zero).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Key


def sample_sparse_features(
  key: Key[Array, ""],
  batch_size: int,
  n_features: int,
  probability: float,
  low: float,
  high: float,
) -> Float[Array, "b n"]:
  """Return a batch of sparse feature vectors (`at_least_zero_active`)."""
  active_key, value_key = jax.random.split(key)
  shape = (batch_size, n_features)
  active = jax.random.bernoulli(active_key, probability, shape)
  values = jax.random.uniform(value_key, shape, jnp.float32, low, high)
  return jnp.where(active, values, 0.0)


def feature_probe(n_features: int, value: float = 0.75) -> Float[Array, "n n"]:
  """Return the CI probe batch: row `i` is `value·e_i`."""
  return value * jnp.eye(n_features, dtype=jnp.float32)
