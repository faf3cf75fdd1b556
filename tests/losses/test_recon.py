"""Stochastic reconstruction over plans (SPEC §5.4, §5.5, I14, I15)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import masks
from decompax.core import sites as sites_lib
from decompax.losses import recon

SITES = tuple(sites_lib.SiteSpec(n, n, 0, 2, 2, 3) for n in ("a", "b", "c"))


def test_plans_have_the_documented_entries():
  assert recon.all_sites_plan(SITES, "uniform_k", 2) == (
    recon.PlanEntry(("a", "b", "c"), "uniform_k", 2),)
  assert [e.live_sites for e in recon.per_site_plan(SITES)] == [
    ("a",), ("b",), ("c",)]
  assert [e.live_sites for e in recon.subset_chunks_plan(SITES, 2)] == [
    ("a", "b"), ("c",)]
  with pytest.raises(ValueError, match="routing"):
    recon.PlanEntry(("a",), "sometimes")
  assert recon.subset_chunks_plan(SITES, 2, "static_probability", 1, 0.3)[
    1] == recon.PlanEntry(("c",), "static_probability", 1, 0.3)


@pytest.mark.parametrize("routing, p", [
  ("static_probability", None), ("static_probability", 0.0),
  ("static_probability", 1.5), ("all", 0.5), ("uniform_k", 0.5)])
def test_route_probability_belongs_to_static_probability_alone(routing, p):
  with pytest.raises(ValueError, match="route probability"):
    recon.PlanEntry(("a",), routing, 1, p)


def test_i14_kl_direction_is_clean_to_masked():
  clean = jnp.log(jnp.array([[0.9, 0.1]]))
  masked = jnp.log(jnp.array([[0.5, 0.5]]))
  p, q = np.array([0.9, 0.1]), np.array([0.5, 0.5])
  expected = np.sum(p * np.log(p / q))
  reverse = np.sum(q * np.log(q / p))
  got = float(recon.kl_clean_to_masked(masked, clean))
  assert got == pytest.approx(expected, rel=1e-5)
  assert got != pytest.approx(reverse, rel=1e-2)


def test_i15_loss_is_mean_over_all_forwards():
  ci = {s.name: jnp.full((4, 3), 0.5) for s in SITES}
  calls = []

  def masked_forward(site_masks):
    calls.append(tuple(sorted(site_masks)))
    # Output = number of live sites; divergence vs 0 is its square.
    return jnp.full((4, 1), float(len(site_masks)))

  def sq(masked, clean):
    return jnp.mean(jnp.square(masked - clean))

  plan = (recon.PlanEntry(("a", "b"), "all", 2), recon.PlanEntry(("c",), "all", 1))
  loss = recon.stochastic_recon_loss(
    masked_forward, jnp.zeros((4, 1)), ci, SITES, plan,
    jax.random.key(0), jax.random.key(1), sq, with_delta=True)
  assert calls == [("a", "b"), ("a", "b"), ("c",)]
  assert float(loss) == pytest.approx((4 + 4 + 1) / 3)


def test_uniform_k_routes_each_position_over_the_entry():
  n = 30_000
  routes = recon.entry_routes(
    jax.random.key(0), recon.PlanEntry(("a", "b", "c"), "uniform_k"), (n,))
  stacked = np.stack([routes[name] for name in "abc"], -1)
  # I16: k ~ U{1..3} live sites per position, and given k each site is as
  # likely as the others. Bounds are 4 standard deviations of n draws: a
  # count of k is Binomial(n, 1/3), a site's share among the positions of
  # one k is k/3. (The key is fixed; measured within 2 deviations.)
  k = stacked.sum(-1)
  counts = np.bincount(k, minlength=4)
  assert counts[0] == 0
  np.testing.assert_allclose(counts[1:], n / 3, atol=4 * np.sqrt(n * 2 / 9))
  for live in (1, 2):
    share, q = stacked[k == live].mean(0), live / 3
    np.testing.assert_allclose(
      share, q, atol=4 * np.sqrt(q * (1 - q) / counts[live]))
  np.testing.assert_allclose(stacked.mean(0), 2 / 3,
                             atol=4 * np.sqrt(2 / 9 / n))
  assert recon.entry_routes(jax.random.key(0), recon.PlanEntry(("a",)), (3,)) is None


def test_mse_is_mean_over_elements():
  assert float(recon.mse(jnp.array([1.0, 3.0]), jnp.zeros(2))) == 5.0


def test_custom_groups_plan_orders_and_validates():
  plan = recon.custom_groups_plan(SITES, (("c", "a"), ("b",)), "uniform_k")
  assert [e.live_sites for e in plan] == [("a", "c"), ("b",)]
  with pytest.raises(ValueError, match="unknown site 'z'"):
    recon.custom_groups_plan(SITES, (("a", "z"),))


def test_static_probability_routes_each_site_and_position_at_p():
  entry = recon.all_sites_plan(SITES, "static_probability", 1, 0.25)[0]
  routes = recon.entry_routes(jax.random.key(2), entry, (4000,))
  stacked = np.stack([routes[n] for n in "abc"], -1)
  # Independent Bernoulli(0.25): per-site rate and no uniform_k floor of one
  # routed site per position (P(none) = 0.75³ ≈ 0.42; ±5 standard deviations).
  np.testing.assert_allclose(stacked.mean(0), 0.25, atol=0.035)
  assert abs((stacked.sum(-1) == 0).mean() - 0.75**3) < 0.04
  assert not np.array_equal(routes["a"], routes["b"])


def test_stochastic_term_routes_with_static_probability():
  """The term's forwards see the entry's static-probability routes: at p = 1
  every position routes, so the loss is that of route-all masks."""
  ci = {s.name: jnp.full((6, 3), 0.5) for s in SITES}
  seen = []

  def forward_loss(site_masks):
    seen.append({n: m.route for n, m in site_masks.items()})
    return sum(jnp.sum(m.mask) for m in site_masks.values())

  keys = (jax.random.key(0), jax.random.key(1))
  every = recon.stochastic_plan_mean(
    forward_loss, ci, SITES,
    recon.all_sites_plan(SITES, "static_probability", 2, 1.0), *keys, False)
  assert all(np.all(np.asarray(r)) for draw in seen for r in draw.values())
  route_all = recon.stochastic_plan_mean(
    forward_loss, ci, SITES, recon.all_sites_plan(SITES, "all", 2), *keys,
    False)
  assert float(every) == float(route_all)
  del seen[:]
  recon.stochastic_plan_mean(
    forward_loss, ci, SITES,
    recon.all_sites_plan(SITES, "static_probability", 2, 0.5), *keys, False)
  routed = np.stack([np.asarray(r) for draw in seen for r in draw.values()])
  assert 0.2 < routed.mean() < 0.8


def test_plan_mean_folds_entry_then_draw_and_weights_shared_draws():
  """Draw d of entry e gets fold_in(fold_in(k, e), d) for every plan key; a
  route-all entry of shared draws runs once, weighted by its n_draws."""
  plan = (recon.PlanEntry(("a",), "all", 3),
          recon.PlanEntry(("b", "c"), "uniform_k", 2))
  base = (jax.random.key(4), jax.random.key(5))
  calls = []

  def draw_loss(entry, draw, keys):
    calls.append((entry.live_sites, draw, keys))
    return jnp.asarray(10.0 * len(entry.live_sites) + draw)

  for draws_differ, expected_calls, expected in (
      (True, 5, (10 + 11 + 12 + 20 + 21) / 5),
      (False, 3, (3 * 10 + 20 + 21) / 5)):
    del calls[:]
    got = recon.plan_mean(draw_loss, plan, base, draws_differ)
    assert float(got) == pytest.approx(expected)
    assert len(calls) == expected_calls
    for live, d, keys in calls:
      e = 0 if live == ("a",) else 1
      for k, b in zip(keys, base):
        want = jax.random.fold_in(jax.random.fold_in(b, e), d)
        np.testing.assert_array_equal(jax.random.key_data(k),
                                      jax.random.key_data(want))


def test_stochastic_plan_mean_is_plan_mean_of_stochastic_masks():
  """The stochastic term's loss equals `plan_mean` over masks drawn from the
  documented keys: the forward key for sources, the route key for routes."""
  ci = {s.name: jax.random.uniform(jax.random.key(i), (5, 3))
        for i, s in enumerate(SITES)}
  plan = recon.subset_chunks_plan(SITES, 2, "uniform_k", 2)
  draw_key, route_key = jax.random.key(8), jax.random.key(9)
  paths = sites_lib.draw_paths(SITES)

  def forward_loss(site_masks):
    return sum(jnp.sum(jnp.where(m.route[..., None], m.mask, 0.0) ** 2)
               + jnp.sum(m.delta) for m in site_masks.values())

  def by_hand(entry, draw, keys):
    routes = recon.entry_routes(keys[1], entry, (5,))
    return forward_loss(masks.stochastic_site_masks(
      keys[0], entry.live_sites, ci, paths, True, "continuous", routes))

  got = recon.stochastic_plan_mean(forward_loss, ci, SITES, plan, draw_key,
                                   route_key, True)
  want = recon.plan_mean(by_hand, plan, (draw_key, route_key))
  assert float(got) == float(want)
  swapped = recon.plan_mean(by_hand, plan, (route_key, draw_key))
  assert float(got) != float(swapped)
