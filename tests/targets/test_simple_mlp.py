"""The simple MLP: its forward is the ReLU stack of its layers, its widths
and sites, and its weights' arrays round trip."""

import jax.numpy as jnp
import numpy as np
import pytest

from decompax.targets import simple_mlp

CONFIG = simple_mlp.SimpleMlpConfig(n_features=4, hidden=(3,))
RNG = np.random.default_rng(1)
WEIGHTS = simple_mlp.SimpleMlpWeights(
  w=(jnp.asarray(RNG.standard_normal((4, 3)), jnp.float32),
     jnp.asarray(RNG.standard_normal((3, 4)), jnp.float32)),
  b=(jnp.asarray(RNG.standard_normal(3), jnp.float32),
     jnp.asarray(RNG.standard_normal(4), jnp.float32)))


def test_the_forward_is_relu_between_layers_only():
  x = jnp.asarray(RNG.uniform(size=(2, 4)), jnp.float32)
  w, b = [np.asarray(a) for a in WEIGHTS.w], [np.asarray(a) for a in WEIGHTS.b]
  want = np.maximum(np.asarray(x) @ w[0] + b[0], 0) @ w[1] + b[1]
  np.testing.assert_allclose(simple_mlp.forward(WEIGHTS, x), want,
                             rtol=1e-5, atol=1e-6)


def test_widths_and_sites_run_input_to_output():
  assert CONFIG.widths() == (4, 3, 4)
  specs = simple_mlp.site_specs(CONFIG, 2)
  assert [(s.name, s.d_in, s.d_out) for s in specs] == [
    ("layers.0", 4, 3), ("layers.1", 3, 4)]


def test_weights_round_trip_through_arrays_and_refuse_other_shapes():
  arrays = simple_mlp.weights_to_arrays(WEIGHTS)
  assert sorted(arrays) == ["layers.0.b", "layers.0.w", "layers.1.b",
                            "layers.1.w"]
  back = simple_mlp.weights_from_arrays(arrays, CONFIG)
  for got, want in zip(back.w + back.b, WEIGHTS.w + WEIGHTS.b):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError):
    simple_mlp.weights_from_arrays(
      arrays, simple_mlp.SimpleMlpConfig(n_features=4, hidden=(5,)))
