"""Logit parity with transformers' PyTorch models, and real model configs.

`tests/fixtures/tiny_{llama,qwen3}` hold tiny random checkpoints and the
logits transformers' own eager PyTorch model gave for fixed tokens
(`tests/fixtures/make_lm_fixtures.py` writes them, in an environment with
torch); these tests load them with decompax's loader, without torch.
`tests/fixtures/hf_configs/` holds the config.json of each supported real
model (no weights).
"""

import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core.masks import SiteMask
from decompax.core import sites as sites_lib
from decompax.io import hf_checkpoint
from decompax.targets import (
  glu_arrays, glu_config, glu_sites, glu_target, glu_weights)

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
PARITY_TOL = 1e-4  # fp32, the acceptance bound


def _load(name: str):
  model_dir = str(FIXTURES / name)
  config = glu_config.config_from_hf(hf_checkpoint.read_config(model_dir))
  arrays = hf_checkpoint.load_decoder_arrays(
    model_dir, config.n_layers, config.qk_norm, config.tied)
  ref = np.load(FIXTURES / name / "reference.npz")
  return config, arrays, ref


def _logits(config, arrays, tokens, names, attention):
  sites = glu_sites.site_specs(config, names, 4)
  seg = glu_sites.span_segments(config, sites)
  weights = glu_arrays.weights_from_arrays(arrays, config, seg)
  fns = glu_target.target_fns(config, sites, attention)
  run = jax.jit(lambda w, t: fns.clean_forward(w, t, ())[0])
  return np.asarray(run(weights, jnp.asarray(tokens)))


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen3"])
def test_logits_match_transformers(name):
  config, arrays, ref = _load(name)
  # Spans at the start, middle and end exercise each stack being empty.
  for layer, attention in ((0, "reference"), (1, "xla"), (2, "reference")):
    names = (glu_weights.site_name(layer, "up"),)
    logits = _logits(config, arrays, ref["tokens"], names, attention)
    err = float(np.max(np.abs(logits - ref["logits"])))
    assert err <= PARITY_TOL, (name, layer, attention, err)


def test_llama_fixture_depends_on_its_rope_scaling():
  # The parity above would not notice a dropped Llama-3 rescaling unless
  # it changes the logits well beyond the tolerance.
  config, arrays, ref = _load("tiny_llama")
  plain = dataclasses.replace(config, rope_scaling=None)
  logits = _logits(plain, arrays, ref["tokens"],
                   (glu_weights.site_name(1, "up"),), "reference")
  assert float(np.max(np.abs(logits - ref["logits"]))) > 100 * PARITY_TOL


def test_fixture_configs_are_what_the_parity_covers():
  llama, _, _ = _load("tiny_llama")
  assert llama.rope_scaling is not None and not llama.tied
  assert not llama.qk_norm
  qwen, arrays, _ = _load("tiny_qwen3")
  assert qwen.qk_norm and qwen.tied and "head" not in arrays
  assert qwen.head_dim * qwen.n_heads != qwen.d_model
  assert os.path.isfile(FIXTURES / "tiny_qwen3" /
                        "model.safetensors.index.json")


# name -> (layers, d, heads, kv, head_dim, d_ff, vocab, theta, eps, tied)
REAL = {
  "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336, 128256, 5e5, 1e-5, False),
  "qwen3-0.6b": (28, 1024, 16, 8, 128, 3072, 151936, 1e6, 1e-6, True),
  "qwen3-1.7b": (28, 2048, 16, 8, 128, 6144, 151936, 1e6, 1e-6, True),
  "qwen3-4b": (36, 2560, 32, 8, 128, 9728, 151936, 1e6, 1e-6, True),
  "qwen3-8b": (36, 4096, 32, 8, 128, 12288, 151936, 1e6, 1e-6, False),
  "qwen3-8b-base": (36, 4096, 32, 8, 128, 12288, 151936, 1e6, 1e-6, False),
  "qwen3-14b": (40, 5120, 40, 8, 128, 17408, 151936, 1e6, 1e-6, False),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_configs_resolve_to_the_spec_table(name):
  config = glu_config.config_from_hf(
    hf_checkpoint.read_config(str(FIXTURES / "hf_configs" / name)))
  got = (config.n_layers, config.d_model, config.n_heads, config.n_kv_heads,
         config.head_dim, config.d_ff, config.vocab_size, config.rope_theta,
         config.rms_eps, config.tied)
  assert got == REAL[name]
  assert config.qk_norm == name.startswith("qwen3")
  assert (config.rope_scaling is not None) == name.startswith("llama")
  names = glu_sites.all_site_names(config)
  assert len(names) == 7 * config.n_layers
  sites = glu_sites.site_specs(config, names[-7:], 8)
  dims = {s.kind: (s.d_in, s.d_out) for s in sites}
  d, q, kv, f = (config.d_model, config.n_heads * 128,
                 config.n_kv_heads * 128, config.d_ff)
  assert dims == {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv),
                  "o_proj": (q, d), "gate_proj": (d, f), "up_proj": (d, f),
                  "down_proj": (f, d)}
  assert glu_sites.span_segments(config, sites) == glu_weights.Segments(
    config.n_layers, config.n_layers - 1, config.n_layers)


def _hf(**changes):
  with open(FIXTURES / "hf_configs" / "qwen3-0.6b" / "config.json") as f:
    hf = json.load(f)
  hf.update(changes)
  return hf


@pytest.mark.parametrize("changes,message", [
  ({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]},
   "model_type 'qwen2_moe'"),
  ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]},
   "num_experts None"),
  ({"num_experts": 64}, "mixture-of-experts"),
  ({"use_sliding_window": True, "sliding_window": 4096}, "sliding-window"),
  ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
  ({"attention_bias": True}, "attention_bias"),
  ({"hidden_act": "gelu"}, "hidden_act"),
  ({"architectures": ["Qwen3ForSequenceClassification"]}, "architectures"),
  ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
  ({"layer_types": ["sliding_attention"] * 28}, "layer types"),
])
def test_unsupported_configs_are_refused(changes, message):
  with pytest.raises(ValueError, match=message) as info:
    glu_config.config_from_hf(_hf(**changes))
  assert "\n" not in str(info.value)


def test_transformers_4_and_5_rope_spellings_agree():
  old = {"rope_theta": 500000.0, "rope_scaling": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
  new = {"rope_parameters": {**old["rope_scaling"], "rope_theta": 500000.0}}
  base = {k: v for k, v in _hf().items()
          if k not in ("rope_theta", "rope_scaling")}
  base.update(model_type="llama", architectures=["LlamaForCausalLM"])
  assert (glu_config.config_from_hf({**base, **old})
          == glu_config.config_from_hf({**base, **new}))


def test_bfloat16_compute_stays_near_the_fp32_reference():
  # SPEC N4: bf16 weights and activations, fp32 norm statistics and
  # softmax; the masked path casts fp32 factors and masks down.
  config, arrays, ref = _load("tiny_llama")
  names = (glu_weights.site_name(1, "up"),)
  sites = glu_sites.site_specs(config, names, config.d_ff)
  seg = glu_sites.span_segments(config, sites)
  weights = glu_arrays.weights_from_arrays(arrays, config, seg, jnp.bfloat16)
  fns = glu_target.target_fns(config, sites)
  exact = {"up_proj": sites_lib.Factors(
    fns.frozen_stacks(weights)["up_proj"].astype(jnp.float32),
    jnp.eye(config.d_ff, dtype=jnp.float32)[None])}
  tokens = jnp.asarray(ref["tokens"])
  masks = {names[0]: SiteMask(
    jnp.ones((*tokens.shape, config.d_ff)))}

  @jax.jit
  def run():
    clean = fns.clean_forward(weights, tokens, ())[0]
    return clean, fns.masked_forward(weights, exact, tokens, masks)

  clean, masked = run()
  assert clean.dtype == jnp.bfloat16
  scale = float(np.max(np.abs(ref["logits"])))
  assert float(np.max(np.abs(np.asarray(clean, np.float32)
                             - ref["logits"]))) < 0.05 * scale
  assert float(np.max(np.abs(np.asarray(masked, np.float32)
                             - ref["logits"]))) < 0.05 * scale
