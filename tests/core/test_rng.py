"""The counter-based generator: distribution, independence, invariance."""

import jax
import numpy as np

from decompax.core import rng


def test_uniform_moments_and_histogram():
  u = np.asarray(rng.uniform(jax.random.key(0), (1000, 1000)))
  assert u.min() >= 0.0 and u.max() < 1.0
  np.testing.assert_allclose(u.mean(), 0.5, atol=2e-3)
  np.testing.assert_allclose(u.var(), 1 / 12, atol=2e-3)
  counts, _ = np.histogram(u, bins=100, range=(0, 1))
  expected = u.size / 100
  chi2 = ((counts - expected) ** 2 / expected).sum()
  assert chi2 < 160  # p ≈ 1e-4 for 99 degrees of freedom


def test_neighbours_along_every_axis_and_keys_are_uncorrelated():
  u = np.asarray(rng.uniform(jax.random.key(1), (64, 64, 64))) - 0.5
  for axis in range(3):
    a = np.moveaxis(u, axis, 0)
    corr = np.mean(a[1:] * a[:-1]) / np.mean(a * a)
    assert abs(corr) < 0.01, (axis, corr)
  # Transposed indices are not mirrored.
  assert abs(np.corrcoef(u[:, :, 0].ravel(), u[:, :, 0].T.ravel())[0, 1]) < 0.02
  other = np.asarray(rng.uniform(jax.random.fold_in(jax.random.key(1), 1),
                                 (64, 64, 64))) - 0.5
  assert abs(np.corrcoef(u.ravel(), other.ravel())[0, 1]) < 0.01


def test_values_depend_only_on_key_and_global_index():
  key = jax.random.key(3)
  full = rng.uniform(key, (8, 6))
  again = jax.jit(lambda k: rng.uniform(k, (8, 6)))(key)
  np.testing.assert_array_equal(full, again)
  sharding = jax.sharding.NamedSharding(
    jax.make_mesh((4,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,)),
    jax.sharding.PartitionSpec("batch"))
  sharded = jax.jit(lambda k: rng.uniform(k, (8, 6)), out_shardings=sharding)(key)
  np.testing.assert_array_equal(full, sharded)


def test_bernoulli_and_randint():
  b = np.asarray(rng.bernoulli(jax.random.key(4), 0.25, (100_000,)))
  np.testing.assert_allclose(b.mean(), 0.25, atol=5e-3)
  r = np.asarray(rng.randint(jax.random.key(5), (60_000,), 1, 4))
  assert set(np.unique(r)) == {1, 2, 3}
  np.testing.assert_allclose(np.bincount(r)[1:] / r.size, [1 / 3] * 3, atol=0.01)
