"""Importance and frequency minimality (SPEC §5.2, §5.3, I11, I12)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.losses import minimality


def test_frequencies_are_batch_means_of_powered_ci():
  ci = jnp.array([[0.0, 1.0], [0.5, 1.0]])
  f = minimality.component_frequencies(ci, 2.0)
  np.testing.assert_allclose(f, [0.125, 1.0], rtol=1e-6)
  # ε sits inside the power, so p < 1 stays finite at c = 0.
  g = jax.grad(lambda c: minimality.component_frequencies(c, 0.5).sum())(ci)
  assert np.isfinite(np.asarray(g)).all()


def test_i11_frequencies_from_global_sums_match_shard_union():
  ci = jax.random.uniform(jax.random.key(0), (8, 3, 4))
  full = minimality.component_frequencies(ci, 1.0)
  shards = [minimality.component_frequencies(ci[i:i + 2], 1.0)
            for i in range(0, 8, 2)]
  np.testing.assert_allclose(full, np.mean(shards, axis=0), rtol=1e-6)
  # The Jensen trap: the penalty of the global f is not the shard mean.
  phi = minimality.frequency_minimality({"s": full}, 1e6)
  phi_shards = np.mean([minimality.frequency_minimality({"s": s}, 1e6)
                        for s in shards])
  assert float(phi) != pytest.approx(float(phi_shards), rel=1e-4)


def test_i12_frequency_term_equals_legacy_beta_form():
  ci = jax.random.uniform(jax.random.key(1), (16, 5)) ** 4
  f = {"s": minimality.component_frequencies(ci, 1.0)}
  imp, beta, bt = 3e-3, 0.5, 16.0
  new = imp * minimality.importance_minimality(f) + (
    imp * beta) * minimality.frequency_minimality(f, bt)
  legacy = imp * jnp.sum(f["s"] * (1 + beta * jnp.log2(1 + bt * f["s"])))
  np.testing.assert_allclose(new, legacy, rtol=1e-6)


def test_importance_sums_over_sites_and_components():
  f = {"a": jnp.array([0.1, 0.2]), "b": jnp.array([0.3])}
  assert float(minimality.importance_minimality(f)) == pytest.approx(0.6)
