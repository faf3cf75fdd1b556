"""Nonlinearity locality (SPEC §5.10, I42, I43)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
