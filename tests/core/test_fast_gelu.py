"""The branch-free exact GELU and its derivative against float64 (the
bounds the module states) and against autodiff of `jax.nn.gelu`."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from decompax.core import fast_gelu

Z = np.linspace(-12.0, 12.0, 2001)


def _reference(z):
  cdf = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in z])
  pdf = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
  return z * cdf, cdf + z * pdf


def test_gelu_and_its_gradient_are_within_the_stated_bounds():
  value, grad = _reference(Z)
  z = jnp.asarray(Z, jnp.float32)
  assert np.all(np.abs(np.asarray(fast_gelu.gelu(z)) - value)
                <= 3e-7 * np.maximum(1, np.abs(Z)) + 1e-7)
  assert np.max(np.abs(np.asarray(fast_gelu.gelu_grad(z)) - grad)) <= 2.5e-7
  pair = fast_gelu.gelu_and_grad(z)
  assert np.all(np.abs(np.asarray(pair[0]) - value)
                <= 3e-7 * np.maximum(1, np.abs(Z)) + 1e-7)
  assert np.max(np.abs(np.asarray(pair[1]) - grad)) <= 2.5e-7


def test_the_gradient_is_autodiffs_of_the_exact_gelu():
  z = jnp.asarray(Z[::10], jnp.float32)
  autodiff = jax.jit(jax.vmap(jax.grad(
    lambda v: jax.nn.gelu(v, approximate=False))))
  np.testing.assert_allclose(fast_gelu.gelu_grad(z), autodiff(z), atol=5e-7)
