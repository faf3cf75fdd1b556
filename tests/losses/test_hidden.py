"""Hidden-activation reconstruction rider (SPEC §5.9)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, masks, sites as sites_lib, squash
from decompax.core import step_records
from decompax.losses import hidden, recon
from decompax.losses import loss_terms as terms


def test_relative_error_known_answer():
  clean = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([[3.0, 4.0]])}
  masked = {"a": jnp.array([1.0, 0.0]), "b": jnp.array([[0.0, 4.0]])}
  # a: 4 / 5, b: 9 / 25.
  value = hidden.relative_error(masked, clean, ("a", "b"))
  np.testing.assert_allclose(float(value), (4 / 5 + 9 / 25) / 2, rtol=1e-6)


def test_site_squared_errors_sum_and_count():
  out = hidden.site_squared_errors(
    {"a": jnp.ones((2, 3))}, {"a": jnp.zeros((2, 3))}, ("a",))
  assert float(out["a"][0]) == 6.0 and out["a"][1] == 6


def test_rider_refusals():
  with pytest.raises(ValueError, match="at least one point"):
    hidden.HiddenRider(1.0, ())
  with pytest.raises(ValueError, match=">= 0"):
    hidden.HiddenRider(-1.0, ("a",))


@pytest.fixture(scope="module")
def ctx(chain):
  target, weights = chain
  ci = ci_fns.make_ci_fn(ci_fns.CIConfig("site_mlp", (4,)), target.sites)
  comps = sites_lib.init_components(jax.random.key(0), target.sites)
  x = jax.random.normal(jax.random.key(3), (8, 4))
  points = ("l0.out", "head.out")
  out, taps = target.clean_forward(weights, x, ci.input_taps + points)
  ci_out = squash.squash(ci.apply(ci.init(jax.random.key(1)), taps, comps))
  return step_records.StepContext(
    jnp.zeros((), jnp.int32), 10, target, weights, x, out, comps, ci_out,
    clean_taps=taps)


def test_recon_term_adds_the_rider_on_its_own_draws(ctx):
  rider = hidden.HiddenRider(0.5, ("l0.out", "head.out"))
  plan = recon.all_sites_plan(ctx.target.sites, "uniform_k", 2)
  key = jax.random.key(5)
  plain = terms.stochastic_recon_term("r", 1.0, plan, True)
  ridden = terms.stochastic_recon_term("r", 1.0, plan, True, rider=rider)
  assert ridden.clean_taps == rider.points and plain.clean_taps == ()
  draw_key, route_key = masks.split_pair(key)

  def rider_only(site_masks):
    _, taps = ctx.masked_forward_with_taps(site_masks, rider.points)
    return hidden.relative_error(taps, ctx.clean_taps, rider.points)

  expected_rider = recon.stochastic_plan_mean(
    rider_only, ctx.ci.lower, ctx.target.sites, plan, draw_key, route_key,
    True)
  assert float(expected_rider) > 0
  np.testing.assert_allclose(
    float(ridden.fn(ctx, key, None)[0]),
    float(plain.fn(ctx, key, None)[0]) + 0.5 * float(expected_rider),
    rtol=1e-6)


def test_no_live_site_gives_zero_rider(ctx):
  rider = hidden.HiddenRider(1.0, ("l0.out", "head.out"))
  value = hidden.forward_loss(ctx, rider)({})
  assert float(value) == 0.0
