"""A decoder LM's weights, segments and names: site and tap keys parse back
to what built them (SPEC §1, §9.2), stacks split at the segments' bounds
(I41) and random stacks have the model's shapes."""

import jax
import numpy as np
import pytest

from decompax.targets import glu_config, glu_weights

CONFIG = glu_config.GluConfig(
  n_layers=3, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=12,
  vocab_size=16, rope_theta=10000.0, rms_eps=1e-5, tied=True, qk_norm=False)


@pytest.fixture(scope="module")
def stack():
  """Numbered host leaves (no compile per random op): leaf `a[i]` is layer
  `i`'s."""
  shapes = {"ln1": (8,), "ln2": (8,), "q": (8, 8), "k": (8, 4),
            "v": (8, 4), "o": (8, 8), "gate": (8, 12), "up": (8, 12),
            "down": (12, 8)}
  return glu_weights.layer_stack(**{
    name: np.arange(3 * np.prod(s), dtype=np.float32).reshape(3, *s)
    for name, s in shapes.items()})


def test_site_names_parse_back_to_their_layer_and_role():
  for layer in range(CONFIG.n_layers):
    for role in glu_weights.model_roles(CONFIG):
      name = glu_weights.site_name(layer, role)
      assert glu_weights.parse_site(name) == (layer, role, False)
      assert glu_weights.parse_site(f"{name}.out") == (layer, role, True)
  expert = glu_weights.site_name(2, "expert_up", 5)
  assert expert == "layers.2.mlp.experts.5.up_proj"
  assert glu_weights.parse_site(expert) == (2, "expert_up", False)
  assert glu_weights.site_expert(expert) == 5
  assert glu_weights.site_expert(glu_weights.site_name(2, "up")) is None
  assert glu_weights.parse_site("layers.0.mlp.fc_proj") is None


def test_tap_keys_parse_to_their_stream_and_layer():
  n = CONFIG.n_layers
  assert glu_weights.parse_tap(f"resid.{n}", n) == ("resid", n)
  assert glu_weights.parse_tap("attn.1", n) == ("attn", 1)
  assert glu_weights.parse_tap("layers.2.mlp.down_proj.out", n) == (
    "down.out", 2)
  assert glu_weights.parse_tap("layers.1.mlp.experts.3.down_proj", n) == (
    "expert_down@3", 1)
  assert glu_weights.parse_tap("layers.1.mlp.gate.out", n) == (
    "router.out", 1)
  for bad in (f"resid.{n + 1}", f"attn.{n}", "layers.0.mlp.fc_proj"):
    with pytest.raises(ValueError, match="unknown tap key"):
      glu_weights.parse_tap(bad, n)
  every = glu_weights.all_tap_keys(CONFIG)
  assert len(every) == len(set(every))
  assert all(glu_weights.parse_tap(k, n) for k in every)


def test_stacks_split_at_the_segment_bounds(stack):
  seg = glu_weights.Segments(CONFIG.n_layers, 1, 2)
  prefix, span, tail = glu_weights.split_stacks(stack, seg)
  np.testing.assert_array_equal(prefix.q, stack.q[:1])
  np.testing.assert_array_equal(span.q, stack.q[1:2])
  np.testing.assert_array_equal(tail.down, stack.down[2:])
  weights = glu_weights.GluWeights(embed=np.zeros((16, 8), np.float32),
                                   prefix=prefix, span=span, tail=tail,
                                   norm=np.ones(8, np.float32))
  glu_weights.check_segments(weights, seg)
  with pytest.raises(ValueError, match="I41"):
    glu_weights.check_segments(weights, glu_weights.Segments(3, 0, 2))
  none_first = glu_weights.split_stacks(stack, glu_weights.Segments(3, 0, 3))
  assert none_first[0] is None and none_first[2] is None
  with pytest.raises(ValueError, match="violated"):
    glu_weights.Segments(3, 2, 1)


def test_a_random_stack_has_the_model_shapes():
  stack = jax.eval_shape(
    lambda key: glu_weights.init_stack(key, CONFIG, 3), jax.random.key(0))
  assert stack.q.shape == (3, 8, CONFIG.q_width)
  assert stack.k.shape == (3, 8, CONFIG.kv_width)
  assert stack.down.shape == (3, 12, 8)
  assert stack.q_bias is None and stack.router is None
  assert stack.ln1.shape == (3, 8)
