"""Squashing forwards and custom backward (SPEC §4.1, I5, I6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import squash

POINTS = [-0.5, 0.0, 0.5, 1.0, 1.5]


def _expected_lower_grad(x, g):
  if x <= 0:
    return 0.01 * g if g < 0 else 0.0
  return g if x <= 1 else 0.0


@pytest.mark.parametrize("g", [-1.0, 1.0])
@pytest.mark.parametrize("x", POINTS)
def test_i5_lower_vjp_matches_spec(x, g):
  value, vjp = jax.vjp(squash.lower_leaky_hard, jnp.float32(x))
  (grad,) = vjp(jnp.float32(g))
  assert value == np.clip(x, 0, 1)
  assert grad == pytest.approx(_expected_lower_grad(x, g), abs=0)


def test_i5_lower_forward_is_clamp():
  x = jnp.linspace(-2.0, 2.0, 41)
  np.testing.assert_array_equal(squash.lower_leaky_hard(x), jnp.clip(x, 0, 1))


@pytest.mark.parametrize("x,grad", [(-0.5, 0.0), (0.5, 1.0), (1.5, 0.01)])
def test_i6_upper_plain_autodiff(x, grad):
  assert jax.grad(squash.upper_leaky_hard)(jnp.float32(x)) == pytest.approx(grad)


def test_i6_upper_values_and_lower_is_clamped_upper():
  x = jnp.array([-0.5, 0.0, 0.5, 1.0, 1.5, 3.0])
  upper = squash.upper_leaky_hard(x)
  np.testing.assert_allclose(upper, [0.0, 0.0, 0.5, 1.0, 1.005, 1.02], rtol=1e-6)
  np.testing.assert_array_equal(
    squash.lower_leaky_hard(x), jnp.clip(upper, 0.0, 1.0)
  )


def test_squash_keeps_pre_and_sites():
  pre = {"a": jnp.array([[-1.0, 2.0]]), "b": jnp.array([[0.25]])}
  out = squash.squash(pre)
  assert out.pre is pre
  assert set(out.lower) == set(out.upper) == {"a", "b"}
  np.testing.assert_array_equal(out.lower["a"], [[0.0, 1.0]])
