"""The transcoder's pure parts against direct computation: TopK keeps
exactly k, the loss is the formula's, and a planted k-sparse dictionary is
recovered by training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decompax.analysis import transcoder as tc


def _random(seed, *shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape),
                     jnp.float32)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_exactly_the_k_largest(k):
  pre = jnp.abs(_random(0, 5, 4, 7)) + 0.1  # all positive: k survive
  kept = np.asarray(tc.top_k(pre, k))
  assert ((kept > 0).sum(axis=-1) == k).all()
  threshold = np.sort(np.asarray(pre), axis=-1)[..., -k][..., None]
  np.testing.assert_array_equal(
    kept, np.where(np.asarray(pre) >= threshold, np.asarray(pre), 0.0))


def test_top_k_keeps_only_positive_parts():
  pre = jnp.asarray([[3.0, -1.0, -2.0, 0.5], [-1.0, -2.0, -3.0, -4.0]])
  np.testing.assert_array_equal(
    np.asarray(tc.top_k(pre, 2)), [[3.0, 0, 0, 0.5], [0, 0, 0, 0]])


def test_encode_decode_and_loss_match_the_formulas():
  params = tc.Transcoder(_random(1, 4, 6), _random(2, 6), _random(3, 6, 5),
                         _random(4, 5))
  x, y = _random(5, 9, 4), _random(6, 9, 5)
  p = [np.asarray(a, np.float64) for a in params]
  pre = np.asarray(x, np.float64) @ p[0] + p[1]
  keep = pre >= np.sort(pre, axis=-1)[:, -2][:, None]
  z = np.where(keep, np.maximum(pre, 0), 0)
  y_hat = z @ p[2] + p[3]
  np.testing.assert_allclose(tc.encode(params, x, 2), z, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(tc.apply(params, x, 2), y_hat, rtol=1e-5,
                             atol=1e-5)
  error = np.mean(np.sum((y_hat - np.asarray(y)) ** 2, axis=-1))
  penalty = np.mean(np.sum(z * np.linalg.norm(p[2], axis=1), axis=-1))
  np.testing.assert_allclose(tc.loss(params, x, y, 2, 0.3),
                             error + 0.3 * penalty, rtol=1e-5)
  assert float(tc.latent_l0(tc.encode(params, x, 2))) == keep.sum(1).mean()


def _planted(seed, n=4, d_in=8, d_out=5, k=2, p=256):
  """Return a k-sparse dictionary's exact transcoder and its `(x, y)`:
  codes `s` of exactly k positive entries, `x = s·A` with A's rows
  orthonormal, `y = s·D`."""
  rng = np.random.default_rng(seed)
  a = np.linalg.qr(rng.normal(size=(d_in, n)))[0].T  # [n, d_in]
  d = rng.normal(size=(n, d_out))
  s = np.zeros((p, n))
  for row in s:
    row[rng.choice(n, k, replace=False)] = rng.uniform(0.5, 1.5, k)
  exact = tc.Transcoder(jnp.asarray(a.T, jnp.float32), jnp.zeros(n),
                        jnp.asarray(d, jnp.float32), jnp.zeros(d_out))
  return exact, jnp.asarray(s @ a, jnp.float32), jnp.asarray(s @ d,
                                                             jnp.float32)


def test_a_planted_dictionary_is_exact_and_recovered_by_training():
  exact, x, y = _planted(0)
  assert float(tc.loss(exact, x, y, 2)) < 1e-10
  steps = 600
  optimizer = optax.adam(optax.cosine_decay_schedule(3e-2, steps))
  update = tc.make_update(optimizer, {0: 2})
  init_key, data_key = jax.random.split(jax.random.key(0))
  start = tc.init(init_key, 8, 8, 5)
  start = tc.scaled_to(tc.data_encoder(start, data_key, x), x, y, 2)
  params = {0: start}

  def body(carry, _):
    params, state = carry
    params, state, _ = update(params, state, {0: (x, y)})
    return (params, state), None

  (params, _), _ = jax.jit(lambda c: jax.lax.scan(body, c, None, steps))(
    (params, optimizer.init(params)))
  fit = tc.fit_sums(tc.apply(params[0], x, 2), y)
  assert tc.fvu(fit) < 0.05, tc.fvu(fit)
  assert tc.fvu(tc.fit_sums(tc.apply(start, x, 2), y)) > 0.5


def test_data_encoder_columns_are_unit_inputs():
  x = _random(10, 6, 4)
  params = tc.data_encoder(tc.init(jax.random.key(0), 4, 5, 3),
                           jax.random.key(1), x)
  columns = np.asarray(params.w_enc).T
  unit = np.asarray(x) / np.linalg.norm(np.asarray(x), axis=1,
                                        keepdims=True)
  np.testing.assert_allclose(np.linalg.norm(columns, axis=1), 1, rtol=1e-5)
  matches = np.abs(columns @ unit.T - 1) < 1e-5
  assert matches.any(axis=1).all() and len(set(matches.argmax(1))) == 5


def test_fvu_is_zero_for_an_exact_prediction_and_one_for_the_mean():
  y = _random(7, 20, 3)
  assert tc.fvu(tc.fit_sums(y, y)) == 0.0
  mean = jnp.broadcast_to(jnp.mean(y, axis=0), y.shape)
  np.testing.assert_allclose(tc.fvu(tc.fit_sums(mean, y)), 1.0, rtol=1e-5)


def test_scaled_to_matches_the_target_spread_and_mean():
  params = tc.init(jax.random.key(0), 4, 10, 3)
  x, y = _random(8, 50, 4), 1e-3 * _random(9, 50, 3) + 2.0
  scaled = tc.scaled_to(params, x, y, 3)
  pred = tc.apply(scaled, x, 3)
  np.testing.assert_allclose(jnp.sum(jnp.var(pred, axis=0)),
                             jnp.sum(jnp.var(y, axis=0)), rtol=1e-4)
  np.testing.assert_allclose(scaled.b_dec, jnp.mean(y, axis=0), rtol=1e-6)
