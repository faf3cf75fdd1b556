"""Masks, sources and routing (SPEC §5.4, §5.8, §5.11, I1, I16)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import masks
from decompax.core import sites as sites_lib
from decompax.core.sites import SiteSpec

SITES = (SiteSpec("a", "a", 0, 3, 3, 4), SiteSpec("b", "b", 0, 3, 2, 2))


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


def _ci(shape_a=(5, 4), shape_b=(5, 2)):
  keys = jax.random.split(jax.random.key(0), 2)
  return {"a": jax.random.uniform(keys[0], shape_a),
          "b": jax.random.uniform(keys[1], shape_b)}


def test_site_draws_do_not_depend_on_other_live_sites():
  ci = {"a": jnp.zeros((5, 3)), "b": jnp.zeros((5, 3))}
  paths = {"a": (0,), "b": (1,)}
  key = jax.random.key(7)
  both = masks.stochastic_site_masks(key, ("a", "b"), ci, paths, True,
                                     "continuous", None)
  alone = masks.stochastic_site_masks(key, ("b",), ci, paths, True,
                                      "continuous", None)
  np.testing.assert_array_equal(both["b"].mask, alone["b"].mask)
  np.testing.assert_array_equal(both["b"].delta, alone["b"].delta)
  assert not np.array_equal(both["a"].mask, both["b"].mask)
  assert set(alone) == {"b"} and both["a"].route is None


def test_source_masks_broadcast_a_shared_source_and_carry_routes():
  ci = {"a": jnp.full((3, 2), 0.5)}
  source = jnp.array([[0.0, 1.0, 0.25]])  # scope c: one row for every position
  route = jnp.array([True, False, True])
  out = masks.source_site_masks(ci, {"a": source}, ("a",), {"a": route})
  np.testing.assert_allclose(out["a"].mask, [[0.5, 1.0]] * 3)
  np.testing.assert_allclose(out["a"].delta, [0.25] * 3)
  np.testing.assert_array_equal(out["a"].route, route)


def test_merged_masks_take_assigned_rows_from_the_persistent_sources():
  ci = {"a": jnp.zeros((4, 2))}
  paths = {"a": (0,)}
  persistent = {"a": jnp.array([[0.5, 0.5, 0.5]])}
  assign = jnp.array([True, False, True, False])
  routes = {"a": jnp.zeros((4,), bool)}
  key = jax.random.key(3)
  out = masks.merged_site_masks(key, ("a",), ci, paths, persistent, assign,
                                True, "continuous", routes)["a"]
  fresh = masks.stochastic_site_masks(key, ("a",), ci, paths, True,
                                      "continuous", None)["a"]
  rows = np.asarray(assign)
  np.testing.assert_array_equal(np.asarray(out.mask)[rows], 0.5)
  np.testing.assert_array_equal(np.asarray(out.mask)[~rows],
                                np.asarray(fresh.mask)[~rows])
  np.testing.assert_array_equal(np.asarray(out.delta)[~rows],
                                np.asarray(fresh.delta)[~rows])
  # Assigned rows are routed everywhere; the others keep their routes.
  np.testing.assert_array_equal(out.route, rows)


def test_row_assignment_is_per_row_and_broadcasts_over_positions():
  assign = masks.row_assignment(jax.random.key(0), 0.5, (2000, 3))
  assert assign.shape == (2000, 1)
  assert 0.45 < float(np.mean(assign)) < 0.55
  assert not np.any(masks.row_assignment(jax.random.key(0), 0.0, (8,)))


@pytest.mark.parametrize("with_delta", [False, True])
def test_variant_masks_follow_their_definitions(with_delta):
  ci = _ci()
  key = jax.random.key(1)
  out = {v: masks.variant_site_masks(v, key, ci, SITES, with_delta, 0.5)
         for v in masks.VARIANTS}
  for site, c in ci.items():
    np.testing.assert_array_equal(out["ci_masked"][site].mask, c)
    np.testing.assert_array_equal(out["unmasked"][site].mask, 1.0)
    np.testing.assert_array_equal(out["zero"][site].mask, 0.0)
    np.testing.assert_array_equal(out["rounded"][site].mask,
                                  (np.asarray(c) > 0.5).astype(np.float32))
    random = np.asarray(out["random"][site].mask)
    assert random.min() >= 0 and random.max() <= 1 and random.std() > 0.1
    stochastic = np.asarray(out["stochastic"][site].mask)
    assert np.all(stochastic >= np.asarray(c) - 1e-7)  # ci + (1−ci)·s ≥ ci
    for variant in ("ci_masked", "unmasked", "rounded", "zero", "random"):
      assert out[variant][site].delta is None  # SPEC §5.4 Constant(v)
    assert (out["stochastic"][site].delta is not None) == with_delta
    assert all(out[v][site].route is None for v in masks.VARIANTS)


def test_stochastic_variant_is_the_all_sites_training_draw():
  ci = _ci()
  key = jax.random.key(2)
  variant = masks.variant_site_masks("stochastic", key, ci, SITES, True, 0.5)
  draw = masks.stochastic_site_masks(key, ("a", "b"), ci,
                                     sites_lib.draw_paths(SITES), True,
                                     "continuous", None)
  for site in ci:
    np.testing.assert_array_equal(variant[site].mask, draw[site].mask)


def test_unknown_variant_is_refused():
  with pytest.raises(ValueError, match="unknown mask variant"):
    masks.variant_site_masks("half", jax.random.key(0), _ci(), SITES, False,
                             0.1)


def test_site_routes_by_routing():
  key, live = jax.random.key(4), ("a", "b", "c")
  assert masks.site_routes(key, "all", live, (5,)) is None
  uniform_k = masks.site_routes(key, "uniform_k", live, (500,))
  assert np.all(np.stack([uniform_k[n] for n in live]).sum(0) >= 1)
  every = masks.site_routes(key, "static_probability", live, (5, 2), 1.0)
  assert set(every) == set(live)
  assert all(r.shape == (5, 2) and bool(np.all(r)) for r in every.values())
  half = masks.site_routes(key, "static_probability", live, (2000,), 0.5)
  stacked = np.stack([half[n] for n in live])
  np.testing.assert_allclose(stacked.mean(1), 0.5, atol=0.06)
  # Unlike uniform_k, a position may route no site at all.
  assert np.any(stacked.sum(0) == 0)


def test_check_routing_refusals():
  masks.check_routing("static_probability", 1.0)
  masks.check_routing("uniform_k", None)
  with pytest.raises(ValueError, match="unknown routing"):
    masks.check_routing("sometimes", None)
  with pytest.raises(ValueError, match="needs a route probability"):
    masks.check_routing("static_probability", None)
  with pytest.raises(ValueError, match="takes no route probability"):
    masks.check_routing("all", 0.5)
