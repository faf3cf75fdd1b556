"""A decoder block's attention: the implementations agree, windows mask
what they should, and the pattern and its KL are what a direct softmax
gives."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.targets import glu_attention, glu_config

CONFIG = glu_config.GluConfig(
  n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=24,
  vocab_size=32, rope_theta=10000.0, rms_eps=1e-5, tied=True, qk_norm=False)


def test_attention_implementations_agree():
  rng = np.random.default_rng(9)
  q = jnp.asarray(rng.standard_normal((2, 7, 4, 8)), jnp.float32)
  k, v = jnp.asarray(rng.standard_normal((2, 2, 7, 2, 8)), jnp.float32)

  @jax.jit
  def run():
    return [glu_attention.attention_fn(impl)(q, k, v)
            for impl in ("reference", "xla", "auto")]

  ref, *others = run()
  for other in others:
    np.testing.assert_allclose(other, ref, atol=1e-5)
  # Causal: the first position attends to itself alone.
  np.testing.assert_allclose(ref[:, 0], jnp.repeat(v[:, 0], 2, axis=1),
                             atol=1e-6)
  with pytest.raises(ValueError, match="unknown attention"):
    glu_attention.attention_fn("flash")


def test_a_window_sees_the_latest_keys_only():
  config = dataclasses.replace(CONFIG, sliding_window=2, local_layers=(0,))
  mask = np.asarray(glu_attention.window_mask(config, 5))
  i, j = np.indices((5, 5))
  np.testing.assert_array_equal(mask, (j <= i) & (j > i - 2))


def test_the_pattern_is_the_causal_softmax_of_the_scores():
  rng = np.random.default_rng(3)
  q = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
  k = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
  probs = np.asarray(glu_attention.attention_probs(jnp.asarray(q),
                                                   jnp.asarray(k)))
  # One kv head serves both query heads.
  scores = np.einsum("bthd,bshd->bhts", q, np.repeat(k, 2, axis=2))
  scores = scores / np.sqrt(8) + np.where(np.tri(4, dtype=bool), 0, -np.inf)
  want = np.exp(scores - scores.max(-1, keepdims=True))
  np.testing.assert_allclose(probs, want / want.sum(-1, keepdims=True),
                             atol=1e-6)
