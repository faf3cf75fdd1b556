"""EMA frequency minimality (SPEC §5.3, I13)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.losses import minimality


def test_i13_first_observation_equals_batch_estimate_and_gradient():
  ci = jax.random.uniform(jax.random.key(0), (32, 5))
  a = 1024.0

  def ema_value(ci):
    f = minimality.component_frequencies(ci, 1.0)
    value, _ = minimality.ema_frequency_minimality(
      f, jnp.zeros(5), jnp.int32(0), 100.0, a)
    return value

  def plain(ci):
    f = minimality.component_frequencies(ci, 1.0)
    return jnp.sum(minimality.frequency_penalty(f, a))

  np.testing.assert_allclose(ema_value(ci), plain(ci), rtol=1e-5)
  np.testing.assert_allclose(jax.grad(ema_value)(ci), jax.grad(plain)(ci),
                             rtol=1e-4, atol=1e-9)


def test_ema_bias_correction_tracks_a_constant_rate():
  f = jnp.full((3,), 0.2)
  ema = jnp.zeros(3)
  for n in range(5):
    value, ema = minimality.ema_frequency_minimality(
      f, ema, jnp.int32(n), 10.0, 100.0)
    np.testing.assert_allclose(
      value, 3 * minimality.frequency_penalty(jnp.float32(0.2), 100.0),
      rtol=1e-5)


def test_penalty_gradient_formula():
  f = jnp.array([0.01, 0.3])
  auto = jax.vmap(jax.grad(lambda x: minimality.frequency_penalty(x, 500.0)))(f)
  np.testing.assert_allclose(minimality.frequency_penalty_grad(f, 500.0), auto,
                             rtol=1e-5)


def test_halflife_bounds():
  with pytest.raises(ValueError, match="halflife"):
    minimality.ema_rates(0.0)
