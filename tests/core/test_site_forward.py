"""Decomposed site matmul (SPEC §3.2, I2, I3)."""

import jax
import jax.numpy as jnp
import numpy as np

from decompax.core import sites as sites_lib
from decompax.core.masks import SiteMask
from decompax.core.site_forward import decomposed_matmul, site_matmul


def _exact_factors(w):
  # V = W, U = I: an exact rank-d_out decomposition with C = d_out.
  return w, jnp.eye(w.shape[1])


def test_i3_all_ones_mask_delta_route_reproduce_frozen():
  x = jax.random.normal(jax.random.key(0), (7, 4))
  w = jax.random.normal(jax.random.key(1), (4, 3))
  v = jax.random.normal(jax.random.key(2), (4, 6))
  u = jax.random.normal(jax.random.key(3), (6, 3))
  ones = SiteMask(jnp.ones((7, 6)), jnp.ones((7,)), jnp.ones((7,), bool))
  np.testing.assert_allclose(decomposed_matmul(x, w, v, u, ones), x @ w,
                             rtol=1e-5, atol=1e-5)


def test_zero_mask_with_delta_one_is_the_delta_path():
  x = jax.random.normal(jax.random.key(0), (5, 4))
  w = jax.random.normal(jax.random.key(1), (4, 3))
  v, u = jnp.ones((4, 2)), jnp.ones((2, 3))
  out = decomposed_matmul(x, w, v, u, SiteMask(jnp.zeros((5, 2)), jnp.ones(5)))
  np.testing.assert_allclose(out, x @ (w - v @ u), rtol=1e-5, atol=1e-5)


def test_exact_factors_without_delta_reproduce_frozen():
  x = jax.random.normal(jax.random.key(0), (5, 4))
  w = jax.random.normal(jax.random.key(1), (4, 3))
  v, u = _exact_factors(w)
  out = decomposed_matmul(x, w, v, u, SiteMask(jnp.ones((5, 3))))
  np.testing.assert_allclose(out, x @ w, rtol=1e-6, atol=1e-6)


def test_i2_unrouted_positions_and_non_live_sites_are_frozen_bitwise():
  x = jax.random.normal(jax.random.key(0), (6, 4))
  w = jax.random.normal(jax.random.key(1), (4, 3))
  v, u = jnp.ones((4, 2)), jnp.ones((2, 3))
  route = jnp.array([True, False] * 3)
  out = decomposed_matmul(x, w, v, u, SiteMask(jnp.zeros((6, 2)), None, route))
  np.testing.assert_array_equal(out[1::2], (x @ w)[1::2])
  np.testing.assert_array_equal(site_matmul(x, w, v, u, None), x @ w)
  grad = jax.grad(lambda v: jnp.sum(site_matmul(x, w, v, u, None)))(v)
  np.testing.assert_array_equal(grad, jnp.zeros_like(v))


def test_mask_broadcasts_over_size_one_axes():
  x = jax.random.normal(jax.random.key(0), (2, 3, 4))
  w = jax.random.normal(jax.random.key(1), (4, 3))
  v, u = jnp.ones((4, 2)), jnp.ones((2, 3))
  m = jnp.array([[[0.5, 1.0]]])
  out = decomposed_matmul(x, w, v, u, SiteMask(m))
  np.testing.assert_allclose(out, ((x @ v) * m) @ u, rtol=1e-6)


def test_init_components_scales_and_keys_per_site():
  sites = (sites_lib.SiteSpec("a", "k", 0, 64, 32, 128),
           sites_lib.SiteSpec("b", "k", 1, 64, 32, 128))
  comps = sites_lib.init_components(jax.random.key(0), sites)
  assert comps["k"].v.shape == (2, 64, 128) and comps["k"].u.shape == (2, 128, 32)
  assert comps["k"].v.dtype == jnp.float32
  np.testing.assert_allclose(jnp.std(comps["k"].v), 1 / 8, rtol=0.05)
  np.testing.assert_allclose(jnp.std(comps["k"].u), 1 / np.sqrt(128), rtol=0.05)
  assert not np.allclose(comps["k"].v[0], comps["k"].v[1])
  only_a = sites_lib.init_components(jax.random.key(0), sites[:1])
  np.testing.assert_array_equal(only_a["k"].v[0], comps["k"].v[0])


def test_validate_sites_refuses_bad_specs():
  import pytest
  with pytest.raises(ValueError, match="positive"):
    sites_lib.validate_sites((sites_lib.SiteSpec("a", "k", 0, 2, 2, 0),))
  with pytest.raises(ValueError, match="share"):
    sites_lib.validate_sites((sites_lib.SiteSpec("a", "k", 0, 2, 2, 3),
                              sites_lib.SiteSpec("b", "k", 1, 2, 4, 3)))
  with pytest.raises(ValueError, match="duplicate"):
    sites_lib.validate_sites((sites_lib.SiteSpec("a", "k", 0, 2, 2, 3),
                              sites_lib.SiteSpec("a", "j", 0, 2, 2, 3)))
  with pytest.raises(ValueError, match="every site has a draw_path"):
    sites_lib.validate_sites((sites_lib.SiteSpec("a", "k", 0, 2, 2, 3, (1,)),
                              sites_lib.SiteSpec("b", "j", 0, 2, 2, 3)))
  with pytest.raises(ValueError, match="unique"):
    sites_lib.validate_sites((
      sites_lib.SiteSpec("a", "k", 0, 2, 2, 3, (0, 1)),
      sites_lib.SiteSpec("b", "j", 0, 2, 2, 3, (0, 1))))


def test_draw_paths_default_to_canonical_indices():
  plain = (sites_lib.SiteSpec("a", "k", 0, 2, 2, 3),
           sites_lib.SiteSpec("b", "j", 0, 2, 2, 3))
  assert sites_lib.draw_paths(plain) == {"a": (0,), "b": (1,)}
  key = jax.random.key(3)
  np.testing.assert_array_equal(
    jax.random.key_data(sites_lib.fold_path(key, (4, 2))),
    jax.random.key_data(jax.random.fold_in(jax.random.fold_in(key, 4), 2)))


def test_projected_init_is_unit_norm_scaled_by_overlap():
  sites = (sites_lib.SiteSpec("a", "k", 0, 4, 3, 6),)
  w = {"k": jax.random.normal(jax.random.key(1), (1, 4, 3))}
  comps = sites_lib.init_components_projected(jax.random.key(0), sites, w)
  v, u = comps["k"].v[0], comps["k"].u[0]
  np.testing.assert_allclose(jnp.linalg.norm(v, axis=0), jnp.ones(6), rtol=1e-5)
  unit_u = u / jnp.linalg.norm(u, axis=1, keepdims=True)
  overlap = jnp.einsum("ic,io,co->c", v, w["k"][0], unit_u)
  np.testing.assert_allclose(jnp.linalg.norm(u, axis=1), jnp.abs(overlap),
                             rtol=1e-5)
