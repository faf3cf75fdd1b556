"""Nonlinearity locality (SPEC §5.10, I42, I43)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, optim, sites as sites_lib, train_step
from decompax.core import step_records
from decompax.core.schedules import Schedule
from decompax.core.sites import Factors, SiteSpec
from decompax.core.target import UnitSpec
from decompax.losses import locality


@pytest.mark.parametrize("mu", [1.0, 4.0])
def test_i42_one_hot_and_uniform_counts(mu):
  n, t = 8, 0.5
  one_hot = locality.unit_fractions(jnp.eye(n)[2] * 3.0, n)
  uniform = locality.unit_fractions(jnp.ones(n) * 1e-30, n)
  assert float(locality.soft_unit_count(one_hot, t, mu)) == pytest.approx(
    mu / (1 + t / n), rel=1e-6)
  assert float(locality.soft_unit_count(uniform, t, mu)) == pytest.approx(
    mu * n / (1 + t), rel=1e-6)


def test_i42_zero_row_gives_zero_shares_and_finite_grads():
  zero = jnp.zeros(6)
  np.testing.assert_array_equal(locality.unit_fractions(zero, 3), jnp.zeros(3))
  g = jax.grad(lambda r: locality.soft_unit_count(
    locality.unit_fractions(r, 3), 1.0, 1.0))(zero)
  assert np.isfinite(np.asarray(g)).all()


def test_equally_loaded_units_formula():
  n, m, t = 10, 4, 2.0
  row = jnp.concatenate([jnp.ones(m * 2), jnp.zeros((n - m) * 2)])
  count = locality.soft_unit_count(locality.unit_fractions(row, n), t, 1.0)
  assert float(count) == pytest.approx(m / (1 + t * m / n), rel=1e-6)


def test_loss_averages_per_unit_kind_and_excludes_none():
  sites = (SiteSpec("a", "a", 0, 2, 4, 2), SiteSpec("b", "b", 0, 2, 4, 1))
  comps = {"a": Factors(jnp.ones((1, 2, 2)), jnp.eye(4)[None, :2] + 0.0),
           "b": Factors(jnp.ones((1, 2, 1)), jnp.ones((1, 1, 4)))}
  units = {"a": UnitSpec("neuron", 4), "b": UnitSpec(
    "attention_head", 2)}
  only_neurons = locality.locality_loss(
    comps, sites, units, {"neuron": 1.0, "attention_head": None}, 1e-6)
  assert float(only_neurons) == pytest.approx(1.0, rel=1e-4)
  both = locality.locality_loss(
    comps, sites, units, {"neuron": 1.0, "attention_head": 2.0}, 1e-6)
  assert float(both) == pytest.approx(1.0 + 2.0 * 2.0, rel=1e-4)


def test_weights_must_name_exactly_the_kinds():
  units = {"a": UnitSpec("neuron", 4)}
  with pytest.raises(ValueError, match="exactly neuron"):
    locality.validate_weights(units, {"attention_head": 1.0})
  with pytest.raises(ValueError, match="every unit kind"):
    locality.validate_weights(units, {"neuron": None})


def _locality_step(chain, term):
  """Return the state before and after one step whose only term is `term`,
  with component-MLP CI (its input reads V, so V/U and the CI parameters
  share the prepared values)."""
  target, weights = chain
  ci_fn = ci_fns.make_ci_fn(ci_fns.CIConfig("component_mlp", (3,)),
                            target.sites)
  adam = optim.AdamWConfig(Schedule(1e-2))
  built = train_step.make_train_step(
    target, ci_fn, (term,), step_records.StepConfig(4, adam, adam))
  state = built.init(
    sites_lib.init_components(jax.random.key(0), target.sites),
    ci_fn.init(jax.random.key(1)), jax.random.key(2), (6,))
  before = jax.device_get(state._replace(rng=None))
  x = jax.random.normal(jax.random.key(3), (6, 4))
  after, metrics = built.step(state, weights, x)
  return before, jax.device_get(after._replace(rng=None)), metrics


CHAIN_UNITS = {"l0": UnitSpec("neuron", 4), "l1": UnitSpec("neuron", 2)}


def test_i43_nonlinearity_term_gives_ci_parameters_exactly_zero_gradient(
    chain):
  term = locality.nonlinearity_locality_term(1.0, 0.5, CHAIN_UNITS,
                                             {"neuron": 1.0})
  before, after, metrics = _locality_step(chain, term)
  assert float(metrics["loss/nonlinearity_locality"]) > 0
  # The CI optimizer saw a gradient of exactly zero, so nothing moved.
  ci_adam = [s for s in after.ci_opt if hasattr(s, "mu")][0]
  for moment in jax.tree.leaves((ci_adam.mu, ci_adam.nu)):
    np.testing.assert_array_equal(moment, 0.0)
  for got, want in zip(jax.tree.leaves(after.ci_params),
                       jax.tree.leaves(before.ci_params)):
    np.testing.assert_array_equal(got, want)
  # While the term does train the write vectors of the sites it covers.
  comps_adam = [s for s in after.components_opt if hasattr(s, "mu")][0]
  assert np.all(np.any(np.asarray(comps_adam.mu["sq"].u) != 0, axis=-1))
  assert not np.array_equal(after.components["sq"].u,
                            before.components["sq"].u)
  # Nothing else: not the uncovered head, not V (read only by the CI).
  np.testing.assert_array_equal(comps_adam.mu["head"].u, 0.0)
  for kind in ("sq", "head"):
    np.testing.assert_array_equal(comps_adam.mu[kind].v, 0.0)
