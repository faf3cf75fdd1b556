"""Factored activations: `project` and `dense` equal the formed activation's
product and values, and a dense activation passes through unchanged."""

import jax.numpy as jnp
import numpy as np

from decompax.core import factored

RNG = np.random.default_rng(0)
COEFS = tuple(jnp.asarray(RNG.standard_normal((3, n)), jnp.float32)
              for n in (2, 4))
BASES = tuple(jnp.asarray(RNG.standard_normal((n, 6)), jnp.float32)
              for n in (2, 4))
CONST = jnp.asarray(RNG.standard_normal(6), jnp.float32)
M = jnp.asarray(RNG.standard_normal((6, 5)), jnp.float32)


def _formed(const=None):
  out = sum(np.asarray(c, np.float64) @ np.asarray(b, np.float64)
            for c, b in zip(COEFS, BASES))
  return out if const is None else out + np.asarray(const)


def test_dense_forms_the_sum_of_the_terms_and_the_constant():
  for const in (None, CONST):
    x = factored.Factored(COEFS, BASES, const)
    np.testing.assert_allclose(factored.dense(x), _formed(const),
                               rtol=1e-5, atol=1e-5)


def test_project_is_the_formed_activation_times_the_matrix():
  for const in (None, CONST):
    x = factored.Factored(COEFS, BASES, const)
    np.testing.assert_allclose(factored.project(x, M),
                               _formed(const) @ np.asarray(M),
                               rtol=1e-4, atol=1e-4)


def test_a_dense_activation_passes_through():
  x = jnp.asarray(RNG.standard_normal((3, 6)), jnp.float32)
  assert factored.dense(x) is x
  np.testing.assert_array_equal(factored.project(x, M), x @ M)
