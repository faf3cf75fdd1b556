"""One decoder block's pieces: the frozen site is `x @ w`, a mixture of
experts routes each position to its top experts (design §9.5), and the
router KL is the mean KL of the router distributions."""

import dataclasses

import jax.numpy as jnp
import numpy as np

from decompax.targets import glu_block, glu_config

CONFIG = glu_config.GluConfig(
  n_layers=1, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=6,
  vocab_size=16, rope_theta=10000.0, rms_eps=1e-5, tied=True, qk_norm=False,
  n_experts=4, experts_per_token=2)
LOGITS = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(
  np.float32)


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_the_frozen_site_is_the_matmul():
  x = jnp.arange(6.0).reshape(2, 3)
  w = jnp.arange(12.0).reshape(3, 4)
  np.testing.assert_array_equal(glu_block.frozen_site("up", x, w, None),
                                x @ w)


def test_routing_keeps_each_positions_top_experts():
  probs = _softmax(LOGITS)
  top = np.argsort(-probs, axis=-1)[..., :2]
  kept = np.zeros_like(probs, bool)
  np.put_along_axis(kept, top, True, axis=-1)
  weights = np.asarray(glu_block.routing_weights(jnp.asarray(LOGITS),
                                                 CONFIG))
  np.testing.assert_allclose(weights, np.where(kept, probs, 0), rtol=1e-6)
  normed = np.asarray(glu_block.routing_weights(
    jnp.asarray(LOGITS), dataclasses.replace(CONFIG, norm_topk=True)))
  np.testing.assert_allclose(normed.sum(-1), 1.0, rtol=1e-6)


def test_the_router_kl_is_the_mean_kl_of_the_distributions():
  other = LOGITS[::-1].copy()
  p, q = _softmax(LOGITS), _softmax(other)
  want = np.mean(np.sum(p * (np.log(p) - np.log(q)), axis=-1))
  np.testing.assert_allclose(glu_block.router_kl(jnp.asarray(LOGITS),
                                                 jnp.asarray(other)),
                             want, rtol=1e-5)
  assert float(glu_block.router_kl(jnp.asarray(LOGITS),
                                   jnp.asarray(LOGITS))) == 0.0
