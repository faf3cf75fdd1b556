"""A decoder LM's weights as a checkpoint's flat arrays and back: the shapes
a config implies, and `weights_to_arrays` inverting `weights_from_arrays`
for any segments (I41)."""

import numpy as np
import pytest

from decompax.targets import glu_arrays, glu_config, glu_weights

CONFIG = glu_config.GluConfig(
  n_layers=3, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=12,
  vocab_size=16, rope_theta=10000.0, rms_eps=1e-5, tied=False, qk_norm=False)


def _arrays():
  rng = np.random.default_rng(0)
  return {name: rng.standard_normal(shape).astype(np.float32)
          for name, shape in glu_arrays.array_shapes(CONFIG).items()}


def test_the_shapes_are_the_models():
  layer = glu_arrays.layer_array_shapes(CONFIG)
  assert layer["q"] == (8, CONFIG.q_width) and layer["down"] == (12, 8)
  shapes = glu_arrays.array_shapes(CONFIG)
  assert shapes["q"] == (3, 8, CONFIG.q_width)
  assert shapes["embed"] == shapes["head"] == (16, 8)
  assert "head" not in glu_arrays.array_shapes(
    glu_config.GluConfig(**{**CONFIG.__dict__, "tied": True}))


@pytest.mark.parametrize("split, tail", [(0, 3), (1, 2), (2, 3)])
def test_arrays_round_trip_through_any_segments(split, tail):
  arrays = _arrays()
  seg = glu_weights.Segments(CONFIG.n_layers, split, tail)
  weights = glu_arrays.weights_from_arrays(arrays, CONFIG, seg)
  glu_weights.check_segments(weights, seg)
  back = glu_arrays.weights_to_arrays(weights)
  assert set(back) == set(arrays)
  for name, value in arrays.items():
    np.testing.assert_array_equal(back[name], value)
