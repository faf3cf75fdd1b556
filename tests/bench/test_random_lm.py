"""bench/random_lm.py: random weights stored around the sites' span, in
the asked dtype, at the model's shapes and scales."""

import jax
import jax.numpy as jnp
import pytest

from bench import random_lm
from decompax.targets import glu_config, glu_sites, glu_weights

MODEL = glu_config.GluConfig(
  n_layers=5, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=16,
  vocab_size=32, rope_theta=500000.0, rms_eps=1e-5, tied=False,
  qk_norm=True)


@pytest.mark.parametrize("layer, stacks", [(0, (0, 1, 4)), (2, (2, 1, 2)),
                                           (4, (4, 1, 0))])
def test_weights_lie_in_the_three_stacks_of_the_span(layer, stacks):
  sites = glu_sites.site_specs(MODEL, (glu_weights.site_name(layer, "up"),), 4)
  weights = random_lm.random_weights(jax.random.key(0), MODEL, sites,
                                     jnp.bfloat16)
  seg = glu_sites.span_segments(MODEL, sites)
  glu_weights.check_segments(weights, seg)  # raises unless they fit
  held = [0 if s is None else s.ln1.shape[0]
          for s in (weights.prefix, weights.span, weights.tail)]
  assert tuple(held) == stacks
  dtypes = {leaf.dtype for leaf in jax.tree.leaves(weights)}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}
  assert weights.head.shape == weights.embed.shape == (32, 8)
  assert weights.span.q_norm.shape == (1, 4)


def test_matrices_scale_by_fan_in_and_norms_sit_near_one():
  big = glu_config.GluConfig(
    n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=256,
    vocab_size=64, rope_theta=10000.0, rms_eps=1e-5, tied=True,
    qk_norm=False)
  sites = glu_sites.site_specs(big, (glu_weights.site_name(1, "down"),), 4)
  weights = random_lm.random_weights(jax.random.key(1), big, sites,
                                     jnp.float32)
  assert weights.head is None
  assert jnp.std(weights.prefix.down) == pytest.approx(256**-0.5, rel=0.05)
  assert jnp.std(weights.prefix.up) == pytest.approx(64**-0.5, rel=0.05)
  assert jnp.abs(jnp.mean(weights.prefix.ln1) - 1) < 0.05
  assert jnp.std(weights.embed) == pytest.approx(1, rel=0.1)
