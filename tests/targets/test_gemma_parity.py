"""Gemma 2 and Gemma 3 (text): parity with transformers, sliding-window
layers in the scanned stacks, and refusals.

`tests/fixtures/tiny_gemma{2,3}` hold tiny random checkpoints mixing
sliding-window and full layers (window shorter than the 16 reference
tokens), and the fp32 logits and taps transformers' eager PyTorch model
gave for fixed tokens (`make_lm_fixtures.py` writes them, in an
environment with torch); nothing here needs torch. Design §9.4, I54.
"""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import sites as sites_lib
from decompax.core.masks import SiteMask
from decompax.io import hf_checkpoint
from decompax.targets import (
  glu_arrays, glu_attention, glu_config, glu_sites, glu_target, glu_weights)

from .test_family_parity import parity_errors, tap_keys

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
PARITY_TOL = 2e-5  # fp32
FAMILIES = ("tiny_gemma2", "tiny_gemma3")


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
  model_dir = str(FIXTURES / request.param)
  config = glu_config.config_from_hf(hf_checkpoint.read_config(model_dir))
  arrays = hf_checkpoint.load_model_arrays(config, model_dir)
  return request.param, config, arrays, np.load(
    FIXTURES / request.param / "reference.npz")


def _fns(config, arrays, names, c=4, **options):
  sites = glu_sites.site_specs(config, names, c)
  seg = glu_sites.span_segments(config, sites)
  weights = glu_arrays.weights_from_arrays(arrays, config, seg)
  return sites, weights, glu_target.target_fns(config, sites, **options)


def _logits(config, arrays, tokens, layer=1):
  _, weights, fns = _fns(config, arrays, (glu_weights.site_name(layer, "up"),))
  return np.asarray(fns.clean_forward(weights, jnp.asarray(tokens), ())[0])


def test_logits_and_taps_match_transformers(model):
  name, config, arrays, ref = model
  taps = tap_keys(ref)
  assert len(taps) >= 9
  # Spans at the start, middle and end: each stack empty once, and each
  # holding both layer kinds.
  for layer in (0, 1, 3):
    _, weights, fns = _fns(config, arrays, (glu_weights.site_name(layer, "up"),
                                            ))
    errors = parity_errors(fns, weights, ref, taps)
    assert max(errors.values()) <= PARITY_TOL, (name, layer, errors)


def test_fixture_configs_are_what_the_parity_covers(model):
  name, config, arrays, ref = model
  t = ref["tokens"].shape[1]
  assert config.norm == "rms_offset" and config.sandwich and config.gated
  assert config.embed_scale and config.tied and config.activation == (
    "gelu_tanh")
  assert config.attn_scalar != config.head_dim
  assert 0 < len(config.local_layers) < config.n_layers
  assert config.sliding_window < t
  assert {"post_attn_norm", "post_mlp_norm"} <= set(arrays)
  if name == "tiny_gemma2":
    assert config.attn_softcap and config.final_softcap
    assert not config.qk_norm and config.local_rope_theta is None
  else:
    assert config.qk_norm and config.n_kv_heads == 1
    assert config.attn_softcap is None and config.final_softcap is None
    assert config.local_rope_theta != config.rope_theta


def test_each_option_moves_the_logits(model):
  # Parity would not notice an option the fixture does not depend on.
  name, config, arrays, ref = model
  changes = [{"local_layers": ()}, {"attn_scalar": None},
             {"embed_scale": False}, {"norm": "rms"},
             {"activation": "silu"},
             {"sliding_window": config.sliding_window + 1}]
  if name == "tiny_gemma2":
    changes += [{"attn_softcap": None}, {"final_softcap": None}]
  else:
    changes += [{"local_rope_theta": None}]
  for change in changes:
    changed = dataclasses.replace(config, **change)
    logits = _logits(changed, arrays, ref["tokens"])
    assert np.max(np.abs(logits - ref["logits"])) > 100 * PARITY_TOL, change


def test_sliding_window_layers_see_only_their_window(model):  # I54
  # The `attn.<i>` pattern of a local layer is zero outside the window,
  # a global layer's is not; every row sums to 1.
  _, config, arrays, ref = model
  glob = next(i for i in range(config.n_layers)
              if i not in config.local_layers)
  local = config.local_layers[-1]
  _, weights, fns = _fns(config, arrays, (glu_weights.site_name(1, "up"),))
  _, taps = fns.clean_forward(weights, jnp.asarray(ref["tokens"]),
                              (f"attn.{local}", f"attn.{glob}"))
  t = ref["tokens"].shape[1]
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  outside = (j <= i - config.sliding_window)
  assert outside.any()
  for layer, zero in ((local, True), (glob, False)):
    pattern = np.asarray(taps[f"attn.{layer}"])
    np.testing.assert_allclose(pattern.sum(-1), 1.0, rtol=1e-5)
    assert np.all(pattern[..., j > i] == 0)
    assert bool(np.abs(pattern[..., outside]).max() == 0) is zero


def test_masked_forward_shares_the_prefix_and_matches_the_clean_one(model):
  # An exact decomposition reproduces the clean logits, and a masked
  # forward resumed from the clean prefix equals one that reruns it.
  _, config, arrays, ref = model
  tokens = jnp.asarray(ref["tokens"])
  name = glu_weights.site_name(2, "q")
  c = config.q_width
  out = {}
  for sharing in (True, False):
    sites, weights, fns = _fns(config, arrays, (name,), c=c,
                               prefix_sharing=sharing)
    w = fns.frozen_stacks(weights)[sites[0].kind]
    components = {sites[0].kind: sites_lib.Factors(w, jnp.eye(c)[None])}
    clean_logits, clean = fns.clean_forward(weights, tokens, fns.start_taps)
    masks = {name: SiteMask(jnp.ones((*tokens.shape, c)))}
    out[sharing] = np.asarray(fns.masked_forward_taps(
      weights, components, tokens, masks, clean, ())[0])
    np.testing.assert_allclose(out[sharing], clean_logits, atol=1e-4)
  assert fns.start_taps == ()
  np.testing.assert_allclose(out[True], out[False], atol=1e-5)


def test_attention_eval_uses_the_layers_window_and_scores(model):  # I54
  _, config, arrays, ref = model
  tokens = jnp.asarray(ref["tokens"])
  layer = config.local_layers[0]
  names = (glu_weights.site_name(layer, "q"),)
  sites, weights, fns = _fns(config, arrays, names)
  wanted = (*fns.attention_taps, f"attn.{layer}")
  _, clean = fns.clean_forward(weights, tokens, wanted)
  masks = {names[0]: SiteMask(jnp.zeros((*tokens.shape, 4)))}
  _, masked = fns.masked_forward_taps(weights, {sites[0].kind: (
    sites_lib.Factors(jnp.ones((1, 64, 4)), jnp.ones((1, 4, 64))))},
    tokens, masks, clean, wanted)
  key = f"layers.{layer}"
  same = fns.attention_divergence(weights, clean, clean)[key]
  moved = fns.attention_divergence(weights, masked, clean)[key]
  assert abs(float(same)) < 1e-6 < float(moved) < np.inf
  q, k = (clean[f"layers.{layer}.self_attn.{r}_proj.out"] for r in "qk")
  norms = ([jnp.asarray(arrays[n][layer]) for n in ("q_norm", "k_norm")]
           if config.qk_norm else [None, None])
  rope, mask = glu_attention.layer_attention(config, tokens.shape[1], True)
  np.testing.assert_allclose(
    clean[f"attn.{layer}"],
    glu_attention.attention_probs(*glu_attention.query_key_heads(
      q, k, *norms, config, rope), config, mask), atol=1e-6)


def test_chunked_head_kl_soft_caps_like_the_whole_logits(model):
  _, config, arrays, ref = model
  tokens = jnp.asarray(ref["tokens"])
  names = (glu_weights.site_name(1, "up"),)
  sites, weights, whole = _fns(config, arrays, names)
  split = glu_target.target_fns(config, sites, output_chunk=5).split_head
  masks = {names[0]: SiteMask(0.5 * jnp.ones((*tokens.shape, 4)))}
  components = {sites[0].kind: sites_lib.Factors(
    0.1 * jnp.ones((1, 64, 4)), 0.1 * jnp.ones((1, 4, 96)))}
  clean_logits, clean = whole.clean_forward(weights, tokens, ())
  logits, _ = whole.masked_forward_taps(weights, components, tokens, masks,
                                        clean, ())
  want = whole.divergence(logits, clean_logits)
  clean_x, _ = split.clean_forward(weights, tokens, ())
  x, _ = split.masked_forward_taps(weights, components, tokens, masks, {},
                                   ())
  np.testing.assert_allclose(split.divergence(weights, x, clean_x), want,
                             rtol=1e-5)


@pytest.mark.parametrize("attention", ["xla", "cudnn", "auto"])
def test_fused_attention_is_refused_for_gemma(model, attention):  # I54
  _, config, arrays, _ = model
  with pytest.raises(ValueError, match="use --attention=reference") as info:
    _fns(config, arrays, (glu_weights.site_name(1, "up"),), attention=attention)
  assert "\n" not in str(info.value)


def _hf(name, **changes):
  return {**hf_checkpoint.read_config(str(FIXTURES / name)), **changes}


@pytest.mark.parametrize("name,changes,message", [
  ("tiny_gemma2", {"attention_bias": True}, "attention_bias is set"),
  ("tiny_gemma3", {"use_bidirectional_attention": True},
   "use_bidirectional_attention is set"),
  ("tiny_gemma3", {"attn_logit_softcapping": 50.0},
   "which Gemma3ForCausalLM ignores"),
  ("tiny_gemma2", {"hidden_activation": "relu"}, "hidden_activation 'relu'"),
  ("tiny_gemma2", {"layer_types": ["chunked_attention"] * 4},
   "layer_types.*give one of"),
  ("tiny_gemma2", {"layer_types": ["full_attention"]}, "each of the 4"),
  ("tiny_gemma2", {"sliding_window": None}, "sliding_window None"),
  ("tiny_gemma2", {"rope_parameters": {"rope_type": "linear",
                                       "factor": 8.0, "rope_theta": 1e4}},
   "rope scaling type 'linear'; supported: default"),
  ("tiny_gemma3", {"rope_parameters": {
    "full_attention": {"rope_type": "linear", "factor": 8.0,
                       "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
   "full_attention rope scaling type 'linear'"),
  ("tiny_gemma3", {"model_type": "gemma3",
                   "architectures": ["Gemma3ForConditionalGeneration"]},
   "multimodal Gemma 3.*gemma3_text"),
  ("tiny_gemma3", {"architectures": ["Gemma3ForConditionalGeneration"]},
   "expected \\[Gemma3ForCausalLM\\]"),
])
def test_unsupported_gemma_options_are_refused(name, changes, message):
  with pytest.raises(ValueError, match=message) as info:
    glu_config.config_from_hf(_hf(name, **changes))
  assert "\n" not in str(info.value)


def test_sliding_layers_need_a_window():
  config = glu_config.config_from_hf(_hf("tiny_gemma2"))
  with pytest.raises(ValueError, match="need a sliding_window"):
    dataclasses.replace(config, sliding_window=None)
  with pytest.raises(ValueError, match=r"must lie in \[0, n_layers 4\)"):
    dataclasses.replace(config, local_layers=(4,))


# name -> (layers, d, heads, kv heads, head_dim, d_ff, vocab, window,
# local layers, global base, local base, soft-caps)
REAL = {
  "gemma-2-2b": (26, 2304, 8, 4, 256, 9216, 256000, 4096,
                 tuple(range(0, 26, 2)), 1e4, None, (50.0, 30.0)),
  "gemma-3-1b": (26, 1152, 4, 1, 256, 6912, 262144, 512,
                 tuple(i for i in range(26) if (i + 1) % 6), 1e6, 1e4,
                 (None, None)),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_gemma_configs_resolve(name):
  # Released configs in transformers 4 spelling (Gemma 3's
  # rope_local_base_freq and sliding_window_pattern).
  config = glu_config.config_from_hf(hf_checkpoint.read_config(
    str(FIXTURES / "hf_configs" / name), glu_config.check_fields))
  got = (config.n_layers, config.d_model, config.n_heads, config.n_kv_heads,
         config.head_dim, config.d_ff, config.vocab_size,
         config.sliding_window, config.local_layers, config.rope_theta,
         config.local_rope_theta,
         (config.attn_softcap, config.final_softcap))
  assert got == REAL[name]
  assert config.attention_scale == 256 ** -0.5 and config.tied
