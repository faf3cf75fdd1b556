"""Importance and frequency minimality (SPEC §5.2, §5.3, I11, I12)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import schedules, squash
from decompax.core.step_records import StepContext
from decompax.losses import minimality
from decompax.losses import loss_terms as terms


def test_frequencies_are_batch_means_of_powered_ci():
  ci = jnp.array([[0.0, 1.0], [0.5, 1.0]])
  f = minimality.component_frequencies(ci, 2.0)
  np.testing.assert_allclose(f, [0.125, 1.0], rtol=1e-6)
  # ε sits inside the power, so p < 1 stays finite at c = 0.
  g = jax.grad(lambda c: minimality.component_frequencies(c, 0.5).sum())(ci)
  assert np.isfinite(np.asarray(g)).all()


def test_i11_frequencies_from_global_sums_match_shard_union():
  ci = jax.random.uniform(jax.random.key(0), (8, 3, 4))
  full = minimality.component_frequencies(ci, 1.0)
  shards = [minimality.component_frequencies(ci[i:i + 2], 1.0)
            for i in range(0, 8, 2)]
  np.testing.assert_allclose(full, np.mean(shards, axis=0), rtol=1e-6)
  # The Jensen trap: the penalty of the global f is not the shard mean.
  phi = minimality.frequency_minimality({"s": full}, 1e6)
  phi_shards = np.mean([minimality.frequency_minimality({"s": s}, 1e6)
                        for s in shards])
  assert float(phi) != pytest.approx(float(phi_shards), rel=1e-4)


def test_i12_frequency_term_equals_legacy_beta_form():
  ci = jax.random.uniform(jax.random.key(1), (16, 5)) ** 4
  f = {"s": minimality.component_frequencies(ci, 1.0)}
  imp, beta, bt = 3e-3, 0.5, 16.0
  new = imp * minimality.importance_minimality(f) + (
    imp * beta) * minimality.frequency_minimality(f, bt)
  legacy = imp * jnp.sum(f["s"] * (1 + beta * jnp.log2(1 + bt * f["s"])))
  np.testing.assert_allclose(new, legacy, rtol=1e-6)


def test_importance_sums_over_sites_and_components():
  f = {"a": jnp.array([0.1, 0.2]), "b": jnp.array([0.3])}
  assert float(minimality.importance_minimality(f)) == pytest.approx(0.6)


def test_importance_weighs_each_site_by_its_own_weight():
  f = {"a": jnp.array([0.1, 0.2]), "b": jnp.array([0.3])}
  weighted = minimality.importance_minimality(f, {"a": 4.0})
  assert float(weighted) == pytest.approx(4.0 * 0.3 + 0.3)
  silent = minimality.importance_minimality(f, {"a": 0.0, "b": 2.0})
  assert float(silent) == pytest.approx(0.6)


def test_smooth_l0_counts_components_and_has_its_gradient():
  ci = jnp.array([[0.0, 1.0, 0.02], [0.5, 1.0, 0.0]])
  gamma = 0.1
  f = minimality.smooth_l0_frequencies(ci, gamma)
  psi = lambda c: c**2 / (c**2 + gamma**2)
  np.testing.assert_allclose(
    f, [psi(0.5) / 2, psi(1.0), psi(0.02) / 2], rtol=1e-6)
  # Normalised, a fully active component counts exactly 1 at any γ.
  np.testing.assert_allclose(
    minimality.smooth_l0_frequencies(jnp.ones((3, 1)), 0.7, True), [1.0],
    rtol=1e-6)
  # d/dc c²/(c²+γ²) = 2cγ²/(c²+γ²)²: zero at 0 (no ε needed), finite.
  grad = jax.grad(lambda c: minimality.smooth_l0_frequencies(c, gamma).sum())(
    ci)
  c = np.asarray(ci)
  np.testing.assert_allclose(
    grad, 2 * c * gamma**2 / (c**2 + gamma**2) ** 2 / 2, rtol=1e-5)


def _ctx(upper, step, total_steps=11):
  # Only the CI and the step matter to the minimality terms, which read the
  # upper CI (I6): the lower and pre-squash CI differ from it, so a term reading
  # either would be seen.
  lower = {k: 0.5 * v for k, v in upper.items()}
  pre = {k: v - 0.25 for k, v in upper.items()}
  ci = squash.CIOutput(pre=pre, lower=lower, upper=upper)
  return StepContext(jnp.asarray(step), total_steps, None, None, None,
                     jnp.zeros(()), {}, ci)


def test_importance_term_takes_the_smooth_l0_penalty_on_its_gamma_schedule():
  upper = {"a": jnp.array([[0.3, 0.0], [1.0, 0.05]]),
           "b": jnp.array([[0.2], [0.0]])}
  gamma = schedules.Schedule(1.0, "linear", 0.01)
  term = terms.importance_minimality_term(1.0, minimality.SmoothL0(gamma))
  for step in (0, 10):
    g = float(schedules.schedule_value(gamma, step, 11))
    expected = sum(float(minimality.smooth_l0_frequencies(c, g).sum())
                   for c in upper.values())
    np.testing.assert_allclose(term.fn(_ctx(upper, step), None, None)[0], expected,
                               rtol=1e-6)
  # The L_p default on the same CI differs: the penalty choice is honoured.
  lp = terms.importance_minimality_term(1.0, 1.0)
  lp_value = float(lp.fn(_ctx(upper, 10), None, None)[0])
  assert abs(lp_value - expected) > 1e-3
  np.testing.assert_allclose(lp_value, sum(
    float(jnp.sum(jnp.mean(c, axis=0))) for c in upper.values()), rtol=1e-6)


@pytest.mark.parametrize("bad, message", [
  (minimality.SmoothL0(schedules.Schedule(1.0, "linear", 0.1, 0.2)),
   "smooth-L0 gamma anneal takes no warmup"),
])
def test_smooth_l0_term_refusals(bad, message):
  with pytest.raises(ValueError, match=message):
    terms.importance_minimality_term(1.0, bad)


@pytest.mark.parametrize("gamma", [0.0, -1.0,
                                   schedules.Schedule(1.0, "linear", 0.0)])
def test_smooth_l0_gamma_must_stay_positive(gamma):
  with pytest.raises(ValueError, match="gamma must stay > 0"):
    minimality.SmoothL0(gamma)
