"""EMA frequency minimality (SPEC §5.3, I13)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.losses import minimality
from decompax.losses import loss_terms as terms


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


def _phi(f, a):
  return f * np.log2(1.0 + a * f)


def _phi_slope(f, a):
  # d/df [f·log2(1 + a·f)], by hand.
  return np.log2(1.0 + a * f) + a * f / ((1.0 + a * f) * np.log(2.0))


@pytest.mark.parametrize("n", [1, 4])
def test_i13_gradient_after_earlier_observations_uses_the_corrected_ema(n):
  """At n > 0 the bias-corrected EMA f̂ differs from the batch's f: the
  value is ΣΦ(f̂) and the gradient Σ Φ'(f̂)·∂f/∂θ, checked against a float64
  evaluation of SPEC §5.3 (f = mean (c + ε)², so ∂f/∂c = 2(c + ε)/|L|)."""
  a, halflife, p = 1024.0, 3.0, 2.0
  ci = jax.random.uniform(jax.random.key(1), (32, 5))
  # Earlier observations left an EMA far from this batch's frequencies.
  ema = jnp.array([0.9, 0.01, 0.4, 0.0, 0.2])

  def ema_value(ci):
    f = minimality.component_frequencies(ci, p)
    return minimality.ema_frequency_minimality(
      f, ema, jnp.int32(n), halflife, a)

  (value, new_ema), grad = jax.value_and_grad(ema_value, has_aux=True)(ci)
  c = np.asarray(ci, np.float64) + minimality.IMPORTANCE_EPS
  f = np.mean(c ** 2, axis=0)
  decay = 0.5 ** (1.0 / halflife)
  want_ema = decay * np.asarray(ema, np.float64) + (1.0 - decay) * f
  f_hat = want_ema / (1.0 - decay ** (n + 1))
  want_grad = _phi_slope(f_hat, a) * 2.0 * c / c.shape[0]
  np.testing.assert_allclose(new_ema, want_ema, rtol=1e-5)
  np.testing.assert_allclose(value, np.sum(_phi(f_hat, a)), rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4)
  # The check tells apart the slopes of nearby wrong formulas: the batch f
  # (the n = 0 answer), the uncorrected EMA, and a correction by n.
  for wrong in (f, want_ema, want_ema / (1.0 - decay ** n)):
    assert not np.allclose(grad, _phi_slope(wrong, a) * 2.0 * c / c.shape[0],
                           rtol=1e-2)


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


def test_the_ema_term_keeps_a_frequency_ema_per_site(chain):
  target, _ = chain
  term = terms.ema_frequency_minimality_term(1.0, 1.0, 64.0, 10.0,
                                             target.sites)
  state = term.init_state(jax.random.key(0), (8,))
  assert isinstance(state, minimality.FrequencyEma)
  assert {k: v.shape for k, v in state.ema.items()} == {
    s.name: (s.c,) for s in target.sites}
  assert int(state.count) == 0
