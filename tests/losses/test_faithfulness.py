"""Faithfulness (SPEC §5.1, I9, I10)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core.sites import Factors
from decompax.losses import faithfulness


def _stacks(key, n=3, d_in=5, d_out=4, c=6):
  kw, kv, ku = jax.random.split(key, 3)
  w = jax.random.normal(kw, (n, d_in, d_out))
  return w, Factors(jax.random.normal(kv, (n, d_in, c)),
                    jax.random.normal(ku, (n, c, d_out)))


def _per_site_args(w_stacks, comps):
  w, v, u = {}, {}, {}
  for kind, stack in w_stacks.items():
    for r in range(stack.shape[0]):
      name = f"{kind}.{r}"
      w[name], v[name], u[name] = stack[r], comps[kind].v[r], comps[kind].u[r]
  return w, v, u


def test_exact_decomposition_has_zero_loss():
  w = jax.random.normal(jax.random.key(0), (1, 4, 3))
  comps = {"k": Factors(w, jnp.eye(3)[None])}
  assert float(faithfulness.faithfulness_per_kind({"k": w}, comps)) == 0.0


def test_value_is_global_entry_mean():
  w = {"a": jnp.ones((2, 2)), "b": jnp.zeros((1, 4))}
  v = {"a": jnp.zeros((2, 1)), "b": jnp.zeros((1, 1))}
  u = {"a": jnp.zeros((1, 2)), "b": jnp.ones((1, 4))}
  # Σ‖Δ‖² = 4 + 0 over 8 entries.
  assert float(faithfulness.faithfulness_per_site(w, v, u)) == pytest.approx(0.5)


def test_i9_per_kind_equals_per_site_and_deltas_grads_bitwise():
  wa, fa = _stacks(jax.random.key(1))
  wb, fb = _stacks(jax.random.key(2), n=1, d_in=4, d_out=5, c=6)
  w_stacks, comps = {"a": wa, "b": wb}, {"a": fa, "b": fb}
  per_kind = faithfulness.faithfulness_per_kind(w_stacks, comps)
  per_site = faithfulness.faithfulness_per_site(*_per_site_args(w_stacks, comps))
  np.testing.assert_allclose(per_kind, per_site, rtol=1e-6)
  # Deltas: the batched matmul gives each row exactly its own matmul.
  batched = faithfulness.weight_delta(wa, fa.v, fa.u)
  for r in range(3):
    np.testing.assert_array_equal(
      batched[r], faithfulness.weight_delta(wa[r], fa.v[r], fa.u[r]))
  g_kind = jax.grad(lambda c: faithfulness.faithfulness_per_kind(w_stacks, c))(
    comps)

  def per_site_of(c):
    return faithfulness.faithfulness_per_site(*_per_site_args(w_stacks, c))

  g_site = jax.grad(per_site_of)(comps)
  for kind in comps:
    np.testing.assert_array_equal(g_kind[kind].v, g_site[kind].v)
    np.testing.assert_array_equal(g_kind[kind].u, g_site[kind].u)


def test_i9_gradient_matches_closed_form():
  w, f = _stacks(jax.random.key(3), n=1)
  n = w.size
  g = jax.grad(lambda c: faithfulness.faithfulness_per_kind({"k": w}, c))(
    {"k": f})["k"]
  delta = w[0] - f.v[0] @ f.u[0]
  np.testing.assert_allclose(g.v[0], -(2 / n) * delta @ f.u[0].T, rtol=1e-5)
  np.testing.assert_allclose(g.u[0], -(2 / n) * f.v[0].T @ delta, rtol=1e-5)


def test_i10_fp32_deltas_from_low_precision_weights():
  w = jax.random.normal(jax.random.key(4), (1, 4, 3)).astype(jnp.bfloat16)
  f = Factors(jnp.zeros((1, 4, 2)), jnp.zeros((1, 2, 3)))
  assert faithfulness.weight_delta(w, f.v, f.u).dtype == jnp.float32
  loss = faithfulness.faithfulness_per_kind({"k": w}, {"k": f})
  assert loss.dtype == jnp.float32


def test_only_decomposed_kinds_count():
  w, f = _stacks(jax.random.key(5), n=1)
  other = jnp.ones((2, 3, 3))
  alone = faithfulness.faithfulness_per_kind({"k": w}, {"k": f})
  with_extra = faithfulness.faithfulness_per_kind({"k": w, "x": other}, {"k": f})
  assert float(with_extra) == float(alone)


def test_relative_form_weighs_every_site_equally():
  # Two kinds of very different scale and size: the relative form is the
  # plain mean of each site's ‖Δ‖²/‖W‖², computed here site by site.
  w_a, comps_a = _stacks(jax.random.key(3), n=2, d_in=6, d_out=5, c=4)
  w_b, comps_b = _stacks(jax.random.key(4), n=1, d_in=2, d_out=3, c=4)
  w_stacks = {"a": 100.0 * w_a, "b": w_b}
  comps = {"a": comps_a, "b": comps_b}
  w, v, u = _per_site_args(w_stacks, comps)
  expected = np.mean([
    np.sum(np.square(np.asarray(w[s] - v[s] @ u[s])))
    / np.sum(np.square(np.asarray(w[s]))) for s in w])
  got = faithfulness.relative_faithfulness_per_kind(w_stacks, comps)
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  # The global form is dominated by the large kind; the relative one is not.
  global_form = faithfulness.faithfulness_per_kind(w_stacks, comps)
  assert float(global_form) > 100 * float(got)


def test_relative_form_is_zero_when_exact_and_scale_free():
  w = jax.random.normal(jax.random.key(0), (2, 4, 3))
  exact = {"k": Factors(w, jnp.broadcast_to(jnp.eye(3), (2, 3, 3)))}
  assert float(faithfulness.relative_faithfulness_per_kind(
    {"k": w}, exact)) == 0.0
  w_stacks, comps = _stacks(jax.random.key(5))
  scaled = {"k": Factors(3.0 * comps.v, comps.u)}
  np.testing.assert_allclose(
    faithfulness.relative_faithfulness_per_kind({"k": 3.0 * w_stacks},
                                                scaled),
    faithfulness.relative_faithfulness_per_kind({"k": w_stacks},
                                                {"k": comps}), rtol=1e-5)
