"""GLU LM attention taps and the attention-pattern KL (SPEC §11).

The pattern tap is checked against a softmax written out in numpy from the
block's own post-RoPE queries and keys, and against the block's attention
output (pattern times values), with the plain einsum attention and with
`jax.nn.dot_product_attention`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.targets import (
  glu_arrays, glu_attention, glu_config, glu_sites, glu_target, glu_weights)

CONFIG = glu_config.GluConfig(
  n_layers=2, d_model=8, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=8,
  vocab_size=16, rope_theta=10000.0, rms_eps=1e-6, tied=True, qk_norm=True,
  family="qwen3")
B, T = 2, 5
NH, NKV, HD = CONFIG.n_heads, CONFIG.n_kv_heads, CONFIG.head_dim
QK_SITES = ("layers.1.self_attn.q_proj", "layers.1.self_attn.k_proj")


def _weights(sites):
  seg = glu_sites.span_segments(CONFIG, sites)
  stack = glu_weights.init_stack(jax.random.key(0), CONFIG, CONFIG.n_layers)
  # Leaves this model lacks (biases) are None.
  arrays = {k: np.asarray(v) for k, v in stack._asdict().items()
            if v is not None}
  rng = np.random.default_rng(1)
  arrays["embed"] = rng.standard_normal((16, 8)).astype(np.float32)
  arrays["norm"] = np.ones(8, np.float32)
  return glu_arrays.weights_from_arrays(arrays, CONFIG, seg)


def _tokens():
  return jnp.asarray(np.random.default_rng(2).integers(0, 16, (B, T)),
                     jnp.int32)


def _softmax_pattern(q, k):
  """Return `softmax(q·kᵀ/√hd + causal)` per query head in numpy (fp64)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k = np.repeat(k, NH // NKV, axis=2)  # kv head j serves heads j·r … j·r+r−1
  scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(HD)
  scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
  e = np.exp(scores - scores.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("attention", ["reference", "xla"])
def test_attn_tap_is_the_causal_softmax_of_the_blocks_queries_and_keys(
    attention):
  sites = glu_sites.site_specs(CONFIG, QK_SITES, 3)
  fns = glu_target.target_fns(CONFIG, sites, attention)
  weights, tokens = _weights(sites), _tokens()
  keys = ("attn.1", "layers.1.self_attn.q_proj.out",
          "layers.1.self_attn.k_proj.out", "layers.1.self_attn.v_proj.out",
          "layers.1.self_attn.o_proj")
  run = jax.jit(fns.clean_forward, static_argnums=2)
  logits, taps = run(weights, tokens, keys)
  np.testing.assert_array_equal(logits, run(weights, tokens, ())[0])  # I29
  pattern = np.asarray(taps["attn.1"])
  assert pattern.shape == (B, NH, T, T) and pattern.dtype == np.float32
  # Queries and keys written out: heads, QK-norm, rotate-half RoPE.
  span = weights.span
  q = taps["layers.1.self_attn.q_proj.out"].reshape(B, T, NH, HD)
  k = taps["layers.1.self_attn.k_proj.out"].reshape(B, T, NKV, HD)
  q = _rope(_rms(q, span.q_norm[0]))
  k = _rope(_rms(k, span.k_norm[0]))
  np.testing.assert_allclose(pattern, _softmax_pattern(q, k), atol=1e-6)
  # The pattern is the one the block attends with: pattern · V is the
  # o_proj input, whichever attention implementation ran.
  v = np.repeat(np.asarray(taps["layers.1.self_attn.v_proj.out"]).reshape(
    B, T, NKV, HD), NH // NKV, axis=2)
  out = np.einsum("bhts,bshd->bthd", pattern, v).reshape(B, T, NH * HD)
  np.testing.assert_allclose(taps["layers.1.self_attn.o_proj"], out,
                             atol=1e-5)


def _rms(x, w):
  x = np.asarray(x, np.float64)
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + CONFIG.rms_eps) * (
    np.asarray(w, np.float64))


def _rope(x):
  inv = CONFIG.rope_theta ** (-np.arange(0, HD, 2) / HD)
  angle = np.arange(T)[:, None] * np.concatenate([inv, inv])[None]
  rotated = np.concatenate([-x[..., HD // 2:], x[..., :HD // 2]], -1)
  return x * np.cos(angle)[:, None] + rotated * np.sin(angle)[:, None]


def test_the_pattern_tap_is_known_and_costs_nothing_unasked():
  assert {"attn.0", "attn.1"} <= set(glu_weights.all_tap_keys(CONFIG))
  with pytest.raises(ValueError,
                     match=r"attn\.<i>, and in a mixture-of-experts"):
    glu_weights.parse_tap("attn.2", CONFIG.n_layers)
  sites = glu_sites.site_specs(CONFIG, QK_SITES, 3)
  fns = glu_target.target_fns(CONFIG, sites)
  weights, tokens = _weights(sites), _tokens()

  def exps(wanted):
    jaxpr = jax.make_jaxpr(fns.clean_forward, static_argnums=2)(
      weights, tokens, wanted)
    return str(jaxpr).count(" exp ")

  # Only a tapped pattern adds a softmax beside the block's own.
  assert exps(fns.attention_taps) == exps(())
  assert exps(("attn.1",)) > exps(())


def _random_qk(key, nh=NH):
  kq, kk = jax.random.split(key)
  return (jax.random.normal(kq, (B, T, nh, HD)),
          jax.random.normal(kk, (B, T, NKV, HD)))


def test_attention_kl_is_zero_for_equal_patterns_and_the_mean_row_kl():
  q, k = _random_qk(jax.random.key(0))
  assert float(glu_attention.attention_kl(q, k, q, k)) == 0.0
  q2, k2 = _random_qk(jax.random.key(1))
  p, r = _softmax_pattern(q, k), _softmax_pattern(q2, k2)
  with np.errstate(divide="ignore", invalid="ignore"):
    rows = np.where(p > 0, p * (np.log(p) - np.log(r)), 0.0).sum(-1)
  got = float(glu_attention.attention_kl(q, k, q2, k2))
  np.testing.assert_allclose(got, rows.mean(), rtol=1e-5)
  assert got > 0
  # Changing only the keys changes the rows of every query head they serve.
  assert float(glu_attention.attention_kl(q, k, q, k2)) > 0


def test_divergence_scores_blocks_with_a_decomposed_query_or_key():
  sites = glu_sites.site_specs(
    CONFIG, ("layers.0.mlp.up_proj", "layers.1.self_attn.k_proj"), 3)
  fns = glu_target.target_fns(CONFIG, sites)
  assert fns.attention_taps == ("layers.1.self_attn.q_proj.out",
                                "layers.1.self_attn.k_proj.out")
  weights, tokens = _weights(sites), _tokens()
  _, clean = fns.clean_forward(weights, tokens, fns.attention_taps + (
    "attn.1",))
  assert fns.attention_divergence(weights, clean, clean) == {
    "layers.1": 0.0}
  # Against an unrelated forward: the mean row KL of the two patterns.
  _, other = fns.clean_forward(weights, _tokens()[::-1], fns.attention_taps
                               + ("attn.1",))
  p, r = (np.asarray(taps["attn.1"], np.float64) for taps in (clean, other))
  with np.errstate(divide="ignore", invalid="ignore"):
    rows = np.where(p > 0, p * (np.log(p) - np.log(r)), 0.0).sum(-1)
  np.testing.assert_allclose(
    fns.attention_divergence(weights, other, clean)["layers.1"],
    rows.mean(), rtol=1e-4)
  mlp_only = glu_target.target_fns(
    CONFIG, glu_sites.site_specs(CONFIG, ("layers.1.mlp.up_proj",), 3))
  assert mlp_only.attention_taps == ()
