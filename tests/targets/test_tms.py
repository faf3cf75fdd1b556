"""TMS: the forward is `relu(x·W·Wᵀ + b)` (through the identity hidden layer
of `+ID`), its sites and their shapes, the features it represents, and its
weights' arrays round trip."""

import jax.numpy as jnp
import numpy as np
import pytest

from decompax.targets import tms

CONFIG = tms.TmsConfig(n_features=5, n_hidden=2)
RNG = np.random.default_rng(0)
W = jnp.asarray(RNG.standard_normal((5, 2)), jnp.float32)
B = jnp.asarray(RNG.standard_normal(5), jnp.float32)


def test_the_forward_is_relu_of_x_w_wt_plus_b():
  x = jnp.asarray(RNG.uniform(size=(3, 5)), jnp.float32)
  want = np.maximum(np.asarray(x) @ np.asarray(W) @ np.asarray(W).T
                    + np.asarray(B), 0)
  np.testing.assert_allclose(tms.forward(tms.TmsWeights(W, B), x), want,
                             rtol=1e-5, atol=1e-6)
  with_id = tms.TmsWeights(W, B, jnp.eye(2))
  np.testing.assert_allclose(tms.forward(with_id, x), want, rtol=1e-5,
                             atol=1e-6)


def test_sites_follow_the_identity_setting():
  assert tms.site_names(CONFIG) == ("linear1", "linear2")
  specs = tms.site_specs(tms.TmsConfig(5, 2, hidden_identity=True),
                         {"linear1": 3, "hidden_layers.0": 2, "linear2": 4})
  assert [(s.name, s.d_in, s.d_out, s.c) for s in specs] == [
    ("linear1", 5, 2, 3), ("hidden_layers.0", 2, 2, 2), ("linear2", 2, 5, 4)]


def test_a_feature_is_missing_unless_its_output_and_row_are_there():
  # Two features on orthogonal unit rows are represented; the others not.
  w = jnp.asarray([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0],
                   [0.0, 0.0]])
  assert tms.missing_features(tms.TmsWeights(w, jnp.zeros(5))) == (2, 3, 4)


def test_weights_round_trip_through_arrays_and_refuse_other_shapes():
  arrays = tms.weights_to_arrays(tms.TmsWeights(W, B))
  back = tms.weights_from_arrays(arrays, CONFIG)
  np.testing.assert_array_equal(back.w, W)
  np.testing.assert_array_equal(back.b, B)
  with pytest.raises(ValueError, match="expected"):
    tms.weights_from_arrays(arrays, tms.TmsConfig(6, 2))
