"""A decoder block's norms, soft-cap and activations against their formulas
(design §9.4; statistics in fp32, N4)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from decompax.targets import glu_config, glu_norms

CONFIG = glu_config.GluConfig(
  n_layers=1, d_model=6, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8,
  vocab_size=16, rope_theta=10000.0, rms_eps=1e-5, tied=True, qk_norm=False)
RNG = np.random.default_rng(0)
X, W, B = (jnp.asarray(RNG.standard_normal(shape), jnp.float32)
           for shape in ((3, 6), (6,), (6,)))
EPS = 1e-5


def _rms(x):
  x = np.asarray(x)
  return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + EPS)


def test_each_norm_is_its_formula():
  np.testing.assert_allclose(glu_norms.rms_norm(X, W, EPS), _rms(X) * W,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(glu_norms.rms_offset_norm(X, W, EPS),
                             _rms(X) * (1 + W), rtol=1e-5, atol=1e-6)
  centered = np.asarray(X) - np.asarray(X).mean(-1, keepdims=True)
  layer = centered / np.sqrt(np.mean(centered ** 2, -1, keepdims=True) + EPS)
  np.testing.assert_allclose(glu_norms.layer_norm(X, W, B, EPS),
                             layer * W + B, rtol=1e-5, atol=1e-6)


def test_the_config_picks_the_norm_and_a_missing_sandwich_norm_is_none():
  for kind, want in (("rms", glu_norms.rms_norm(X, W, EPS)),
                     ("rms_offset", glu_norms.rms_offset_norm(X, W, EPS)),
                     ("layer", glu_norms.layer_norm(X, W, B, EPS))):
    config = dataclasses.replace(CONFIG, norm=kind)
    np.testing.assert_array_equal(glu_norms.norm(X, W, B, config), want)
  y = X[None]
  assert glu_norms.post_norm(y, None, CONFIG) is y
  np.testing.assert_array_equal(glu_norms.post_norm(y, W, CONFIG),
                                glu_norms.rms_norm(y, W, EPS))


def test_softcap_bounds_the_values_and_none_leaves_them():
  x = jnp.asarray([-100.0, -1.0, 0.0, 2.0, 100.0])
  np.testing.assert_allclose(glu_norms.softcap(x, 5.0),
                             5.0 * np.tanh(np.asarray(x) / 5.0), rtol=1e-6)
  assert glu_norms.softcap(x, None) is x


def test_the_activation_is_the_configured_one():
  x = jnp.linspace(-3.0, 3.0, 7)
  for name, want in (("silu", jax.nn.silu(x)),
                     ("gelu_tanh", jax.nn.gelu(x, approximate=True)),
                     ("gelu", jax.nn.gelu(x, approximate=False))):
    config = dataclasses.replace(CONFIG, activation=name)
    np.testing.assert_array_equal(glu_norms.activation(config)(x), want)
