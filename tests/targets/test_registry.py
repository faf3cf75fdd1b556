"""Tests for decompax.targets.registry."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import sites
from decompax.targets import registry

NAMES = (
  "tms_5-2",
  "tms_5-2-id",
  "tms_40-10",
  "tms_40-10-id",
  "resid_mlp1",
  "resid_mlp2",
  "resid_mlp3",
  "simple_mlp",
)


@functools.cache
def _init(name):
  """Return the untrained weights of toy `name` (cached; uses are pure)."""
  return jax.jit(registry.get(name).init)(jax.random.key(0))


def test_toy_names():
  # The token toys take token ids, not features; tests/targets/
  # test_induction.py and test_token_embed.py cover them.
  assert registry.toy_names() == (*NAMES, "embed_16-8", "induction",
                                  "addsub")


def test_unknown_name_lists_known_names():
  with pytest.raises(ValueError, match="tms_5-2.*simple_mlp"):
    registry.get("tms_3-1")


@pytest.mark.parametrize("name", NAMES)
def test_entry_is_consistent(name):
  toy = registry.get(name)
  assert toy.name == name and toy.default_seed == 0
  specs = toy.sites(4)
  assert toy.fns(4).sites == specs
  weights = _init(name)
  stacks = toy.fns(4).frozen_stacks(weights)
  for kind, spec in sites.kind_specs(specs).items():
    assert stacks[kind].shape == (spec.n, spec.d_in, spec.d_out)
  x = toy.sample_inputs(jax.random.key(1), 3)
  assert x.shape == (3, toy.config.n_features)


@pytest.mark.parametrize("name", NAMES)
def test_weights_arrays_round_trip(name):
  toy = registry.get(name)
  weights = _init(name)
  arrays = toy.weights_to_arrays(weights)
  assert all(isinstance(a, np.ndarray) for a in arrays.values())
  restored = toy.weights_from_arrays(dict(arrays))
  assert jax.tree.structure(restored) == jax.tree.structure(weights)
  assert all(jax.tree.leaves(jax.tree.map(jnp.array_equal, restored, weights)))


def test_weights_from_arrays_rejects_another_config():
  arrays = registry.get("tms_5-2").weights_to_arrays(_init("tms_5-2"))
  with pytest.raises(ValueError, match="shape"):
    registry.get("tms_40-10").weights_from_arrays(arrays)
  with pytest.raises(ValueError, match="fields"):
    registry.get("tms_5-2-id").weights_from_arrays(arrays)


def test_resid_targets_are_the_papers():
  """Labels `x + relu(x)` and no biases: the target on which the paper's
  recipe finds one dense `W_out` block (docs/recovery.md)."""
  toy = registry.get("resid_mlp2")
  arrays = toy.weights_to_arrays(_init("resid_mlp2"))
  assert set(arrays) == {"w_e", "w_in", "w_out", "kappa"}
  assert arrays["w_in"].shape == (2, 1000, 25)
  np.testing.assert_array_equal(arrays["kappa"], 1.0)


def test_resid_target_saved_with_a_bias_loads_with_it():
  """A run made when the toys had an `mlp_in` bias keeps its target."""
  toy = registry.get("resid_mlp1")
  arrays = dict(toy.weights_to_arrays(_init("resid_mlp1")))
  arrays["b_in"] = np.full((1, 50), 0.25, np.float32)
  weights = toy.weights_from_arrays(arrays)
  np.testing.assert_array_equal(weights.b_in, arrays["b_in"])
  with pytest.raises(ValueError, match="b_in: shape"):
    toy.weights_from_arrays(arrays | {"b_in": np.zeros((1, 49), np.float32)})


@pytest.mark.parametrize("name", ["tms_5-2-id", "simple_mlp"])
def test_default_seed_trains_quickly(name):
  toy = registry.get(name)
  weights = toy.train(toy.default_seed)
  assert toy.missing_features(weights) == ()


@pytest.mark.slow
@pytest.mark.parametrize(
  "name",
  ["tms_40-10", "tms_40-10-id", "resid_mlp1", "resid_mlp2", "resid_mlp3"],
)
def test_default_seed_trains(name):
  toy = registry.get(name)
  weights = toy.train(toy.default_seed)
  assert toy.missing_features(weights) == ()
