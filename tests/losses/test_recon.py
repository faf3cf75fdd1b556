"""Stochastic reconstruction over plans (SPEC §5.4, §5.5, I14, I15)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_site_draws_do_not_depend_on_other_live_sites():
  ci = {s.name: jnp.zeros((5, 3)) for s in SITES}
  index = sites_lib.draw_paths(SITES)
  key = jax.random.key(7)
  both = recon.stochastic_site_masks(
    key, recon.PlanEntry(("a", "b")), ci, index, True, "continuous", None)
  alone = recon.stochastic_site_masks(
    key, recon.PlanEntry(("b",)), ci, index, True, "continuous", None)
  np.testing.assert_array_equal(both["b"].mask, alone["b"].mask)
  np.testing.assert_array_equal(both["b"].delta, alone["b"].delta)
  assert not np.array_equal(both["a"].mask, both["b"].mask)


def test_uniform_k_routes_each_position_over_the_entry():
  routes = recon.entry_routes(
    jax.random.key(0), recon.PlanEntry(("a", "b", "c"), "uniform_k"), (1000,))
  stacked = np.stack([routes[n] for n in "abc"], -1)
  # I16: k ~ U{1..3} live sites per position, and given k each site is as
  # likely as the others (1000 draws: ±5 standard deviations).
  counts = np.bincount(stacked.sum(-1), minlength=4)
  assert counts[0] == 0
  np.testing.assert_allclose(counts[1:], 1000 / 3, atol=75)
  np.testing.assert_allclose(stacked.mean(0), 2 / 3, atol=0.08)
  assert recon.entry_routes(jax.random.key(0), recon.PlanEntry(("a",)), (3,)) is None


def test_mse_is_mean_over_elements():
  assert float(recon.mse(jnp.array([1.0, 3.0]), jnp.zeros(2))) == 5.0


def test_custom_groups_plan_orders_and_validates():
  plan = recon.custom_groups_plan(SITES, (("c", "a"), ("b",)), "uniform_k")
  assert [e.live_sites for e in plan] == [("a", "c"), ("b",)]
  with pytest.raises(ValueError, match="unknown site 'z'"):
    recon.custom_groups_plan(SITES, (("a", "z"),))
