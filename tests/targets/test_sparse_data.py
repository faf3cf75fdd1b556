"""Tests for decompax.targets.sparse_data."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.targets import sparse_data


@pytest.mark.parametrize("low,high", [(0.0, 1.0), (-1.0, 1.0)])
def test_sample_sparse_features_support_and_rate(low, high):
  x = jax.jit(
    sparse_data.sample_sparse_features, static_argnums=(1, 2, 3, 4, 5)
  )(jax.random.key(0), 4096, 8, 0.25, low, high)
  assert x.shape == (4096, 8) and x.dtype == jnp.float32
  active = np.asarray(x != 0)
  assert abs(active.mean() - 0.25) < 0.01
  values = np.asarray(x)[active]
  assert values.min() >= low and values.max() <= high
  # Active values are uniform on [low, high]: mean and spread match.
  assert abs(values.mean() - (low + high) / 2) < 0.02 * (high - low)
  assert abs(values.std() - (high - low) / np.sqrt(12)) < 0.02 * (high - low)


def test_sample_sparse_features_deterministic_per_key():
  def sample(seed):
    return sparse_data.sample_sparse_features(
      jax.random.key(seed), 16, 4, 0.5, 0.0, 1.0
    )

  a, b, c = sample(3), sample(3), sample(4)
  assert jnp.array_equal(a, b)
  assert not jnp.array_equal(a, c)


def test_feature_probe_is_scaled_identity():
  probe = sparse_data.feature_probe(5)
  assert jnp.array_equal(probe, 0.75 * jnp.eye(5))
  assert jnp.array_equal(sparse_data.feature_probe(3, 2.0), 2.0 * jnp.eye(3))
