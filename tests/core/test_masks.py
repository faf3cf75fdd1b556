"""Masks, sources and routing (SPEC §5.4, I1, I16)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import masks


def test_i1_mask_interpolates_and_delta_is_raw():
  ci = jnp.array([[0.0, 0.5, 1.0]])
  source = jnp.array([[0.2, 0.4, 0.9, 0.7]])
  mask, delta = masks.make_masks(ci, source)
  np.testing.assert_allclose(mask, [[0.2, 0.7, 1.0]], rtol=1e-6)
  np.testing.assert_allclose(delta, [0.7])


def test_i1_no_delta_channel_means_no_delta():
  mask, delta = masks.make_masks(jnp.zeros((2, 3)), jnp.ones((2, 3)))
  assert delta is None
  np.testing.assert_array_equal(mask, jnp.ones((2, 3)))


def test_make_masks_rejects_wrong_channel_count():
  with pytest.raises(ValueError, match="channels"):
    masks.make_masks(jnp.zeros((2, 3)), jnp.zeros((2, 5)))


def test_stochastic_source_shapes_and_ranges():
  key = jax.random.key(0)
  s = masks.stochastic_source(key, (64, 2), 5, with_delta=True)
  assert s.shape == (64, 2, 6)
  assert float(s.min()) >= 0.0 and float(s.max()) <= 1.0
  b = masks.stochastic_source(key, (256,), 4, True, "binomial")
  assert set(np.unique(np.asarray(b[:, :4]))) == {0.0, 1.0}
  delta = np.asarray(b[:, 4])
  assert len(np.unique(delta)) > 100  # the delta channel stays continuous


def test_i16_uniform_k_routes_k_uniform_and_subsets_uniform():
  n, draws = 4, 40000
  routes = np.asarray(masks.uniform_k_routes(jax.random.key(1), (draws,), n))
  k = routes.sum(-1)
  assert k.min() == 1 and k.max() == n
  counts = np.bincount(k, minlength=n + 1)[1:]
  expected = draws / n
  chi2 = ((counts - expected) ** 2 / expected).sum()
  assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom
  # Given k = 1, each site is the routed one equally often.
  singles = routes[k == 1].argmax(-1)
  per_site = np.bincount(singles, minlength=n)
  exp1 = len(singles) / n
  assert ((per_site - exp1) ** 2 / exp1).sum() < 16.3
