"""GPT-2 and GPT-NeoX/Pythia: parity with transformers, and frozen biases.

`tests/fixtures/tiny_{gpt2,pythia}` hold tiny random checkpoints under their
released tensor names, and the fp32 logits and taps transformers' eager
PyTorch model gave for fixed tokens (`make_lm_fixtures.py` writes them, in
an environment with torch); nothing here needs torch. Design §9.4, I52.
"""

import dataclasses
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import sites as sites_lib
from decompax.core.masks import SiteMask
from decompax.io import hf_checkpoint
from decompax.targets import (
  glu_arrays, glu_attention, glu_config, glu_sites, glu_target, glu_weights)

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
PARITY_TOL = 2e-5  # fp32
FAMILIES = ("tiny_gpt2", "tiny_pythia")


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
  model_dir = str(FIXTURES / request.param)
  config = glu_config.config_from_hf(hf_checkpoint.read_config(model_dir))
  arrays = hf_checkpoint.load_model_arrays(config, model_dir)
  return request.param, config, arrays, np.load(
    FIXTURES / request.param / "reference.npz")


def _fns(config, arrays, names, attention="reference", c=4):
  sites = glu_sites.site_specs(config, names, c)
  seg = glu_sites.span_segments(config, sites)
  weights = glu_arrays.weights_from_arrays(arrays, config, seg)
  return sites, weights, glu_target.target_fns(config, sites, attention)


def tap_keys(ref) -> tuple[str, ...]:
  """Return the tap keys a fixture's reference holds (its `tap.<key>`s)."""
  return tuple(k.removeprefix("tap.") for k in ref.files
               if k.startswith("tap."))


def parity_errors(fns, weights, ref, taps: tuple[str, ...]
                  ) -> dict[str, float]:
  """Return the largest absolute difference from the reference of the
  logits and of each tap, for the fixture's tokens (shared by the
  families' parity tests)."""
  logits, got = jax.jit(lambda w, t: fns.clean_forward(w, t, taps))(
    weights, jnp.asarray(ref["tokens"]))
  errors = {k: float(np.max(np.abs(np.asarray(got[k]) - ref[f"tap.{k}"])))
            for k in taps}
  errors["logits"] = float(np.max(np.abs(np.asarray(logits)
                                         - ref["logits"])))
  return errors


def test_logits_and_taps_match_transformers(model):
  name, config, arrays, ref = model
  taps = tap_keys(ref)
  assert len(taps) >= 7
  # Spans at the start, middle and end exercise each stack being empty.
  for layer, attention in ((0, "reference"), (1, "xla"), (2, "reference")):
    _, weights, fns = _fns(config, arrays, (glu_weights.site_name(layer, "up"),
                                            ),
                           attention)
    errors = parity_errors(fns, weights, ref, taps)
    assert max(errors.values()) <= PARITY_TOL, (name, layer, errors)


def test_fixture_configs_are_what_the_parity_covers(model):
  name, config, arrays, _ = model
  assert config.norm == "layer" and config.bias and not config.gated
  assert "gate" not in arrays and "norm_bias" in arrays
  assert "layers.0.mlp.gate_proj" not in glu_sites.all_site_names(config)
  if name == "tiny_gpt2":
    assert config.positions == "learned" and config.tied
    assert config.activation == "gelu_tanh" and "pos" in arrays
  else:
    assert config.positions == "rope" and not config.tied
    assert config.activation == "gelu" and config.parallel_residual
    assert 0 < config.rope_dims < config.head_dim


def test_sequential_neox_block_matches_transformers():
  # The Pythia fixture's reference also holds the same weights run with
  # use_parallel_residual=False.
  model_dir = str(FIXTURES / "tiny_pythia")
  hf = hf_checkpoint.read_config(model_dir)
  config = glu_config.config_from_hf({**hf, "use_parallel_residual": False})
  assert not config.parallel_residual
  arrays = hf_checkpoint.load_model_arrays(config, model_dir)
  ref = np.load(FIXTURES / "tiny_pythia" / "reference.npz")
  _, weights, fns = _fns(config, arrays, (glu_weights.site_name(1, "up"),))
  logits = np.asarray(fns.clean_forward(weights, jnp.asarray(ref["tokens"]),
                                        ())[0])
  assert np.max(np.abs(logits - ref["logits_sequential"])) <= PARITY_TOL
  assert np.max(np.abs(logits - ref["logits"])) > 100 * PARITY_TOL


def test_each_option_moves_the_logits(model):
  # Parity would not notice an option the fixture does not depend on.
  name, config, arrays, ref = model
  changes = [{"activation": "silu"}, {"rms_eps": 1.0}]
  if name == "tiny_pythia":
    changes += [{"rotary_dims": None}, {"parallel_residual": False}]
  names = (glu_weights.site_name(1, "up"),)
  for change in changes:
    changed = dataclasses.replace(config, **change)
    _, weights, fns = _fns(changed, arrays, names)
    logits = np.asarray(fns.clean_forward(
      weights, jnp.asarray(ref["tokens"]), ())[0])
    assert np.max(np.abs(logits - ref["logits"])) > 100 * PARITY_TOL, change


def _masked(config, arrays, tokens, role, masks_of, components_of=None):
  """Return the clean taps and the masked taps of a forward that decomposes
  layer 1's `role` (C its output width) with the given masks (and
  components)."""
  name = glu_weights.site_name(1, role)
  c = glu_sites.role_dims(config, role)[1]
  sites, weights, fns = _fns(config, arrays, (name,), c=c)
  kind = sites[0].kind
  w = fns.frozen_stacks(weights)[kind]
  components = {kind: components_of(w, c) if components_of else
                sites_lib.Factors(jnp.ones((1, w.shape[1], c)),
                                  jnp.ones((1, c, w.shape[2])))}
  wanted = (f"{name}.out", "resid.3")
  clean_logits, clean = fns.clean_forward(weights, tokens, wanted)
  logits, taps = fns.masked_forward_taps(
    weights, components, tokens, {name: masks_of(tokens, c)}, clean, wanted)
  return name, w, (clean_logits, clean), (logits, taps)


@pytest.mark.parametrize("role", ["q", "o", "up", "down"])
def test_a_fully_masked_site_leaves_exactly_its_bias(model, role):
  # I52: with every component masked and no delta, the site's output is
  # its frozen bias, bit for bit.
  _, config, arrays, ref = model
  tokens = jnp.asarray(ref["tokens"])
  name, _, _, (_, taps) = _masked(
    config, arrays, tokens, role,
    lambda t, c: SiteMask(jnp.zeros((*t.shape, c)), jnp.zeros(t.shape)))
  bias = arrays[f"{role}_bias"][1]
  assert np.abs(bias).max() > 0.05
  np.testing.assert_array_equal(
    np.asarray(taps[f"{name}.out"]),
    np.broadcast_to(bias, taps[f"{name}.out"].shape))


def test_the_bias_is_outside_the_factors_and_the_delta(model):
  # I52: the frozen stack a site decomposes is its matrix alone, and both
  # an exact decomposition and the delta channel reproduce the clean
  # output, so the bias is added once, by the forward, never by a factor.
  _, config, arrays, ref = model
  tokens = jnp.asarray(ref["tokens"])
  name, w, (clean_logits, clean), (logits, taps) = _masked(
    config, arrays, tokens, "up",
    lambda t, c: SiteMask(jnp.ones((*t.shape, c))),
    lambda w, c: sites_lib.Factors(w, jnp.eye(c)[None]))
  np.testing.assert_array_equal(np.asarray(w[0]), arrays["up"][1])
  assert w.shape[2] == config.d_ff == taps[f"{name}.out"].shape[-1]
  np.testing.assert_allclose(taps[f"{name}.out"], clean[f"{name}.out"],
                             atol=1e-5)
  np.testing.assert_allclose(logits, clean_logits, atol=1e-4)
  # Zero factors, delta mask 1: the delta carries x·W only.
  _, _, (_, clean), (_, taps) = _masked(
    config, arrays, tokens, "up",
    lambda t, c: SiteMask(jnp.zeros((*t.shape, c)), jnp.ones(t.shape)),
    lambda w, c: sites_lib.Factors(jnp.zeros((1, w.shape[1], c)),
                                   jnp.zeros((1, c, w.shape[2]))))
  np.testing.assert_allclose(taps[f"{name}.out"], clean[f"{name}.out"],
                             atol=1e-5)


def test_a_plain_mlp_has_no_gate_site_or_tap(model):
  _, config, arrays, ref = model
  with pytest.raises(ValueError, match="unknown site 'layers.0.mlp.gate_proj"
                     r"'.*mlp\.\{up,down\}_proj"):
    glu_sites.site_specs(config, ("layers.0.mlp.gate_proj",), 4)
  _, weights, fns = _fns(config, arrays, (glu_weights.site_name(1, "up"),))
  with pytest.raises(ValueError, match="lacks"):
    fns.clean_forward(weights, jnp.asarray(ref["tokens"]),
                      ("layers.1.mlp.gate_proj.out",))


def test_parallel_block_mlp_is_not_moved_by_its_attention():
  # In a parallel block the MLP reads the block input; attention sites of
  # the same block reach only its attention streams and the next blocks.
  pythia = glu_config.config_from_hf(
    hf_checkpoint.read_config(str(FIXTURES / "tiny_pythia")))
  sites = glu_sites.site_specs(pythia, (glu_weights.site_name(1, "o"),), 4)
  for config, moved in ((pythia, False),
                        (dataclasses.replace(pythia, parallel_residual=False),
                         True)):
    reaches = glu_sites.masking_reaches(config, sites)
    assert reaches("layers.1.mlp.up_proj") is moved
    assert reaches("layers.1.mlp.down_proj.out") is moved
    assert reaches("layers.1.self_attn.o_proj.out") and reaches("resid.2")


def _rewrite(src: pathlib.Path, dst: pathlib.Path, rename) -> str:
  shutil.copytree(src, dst)
  path = dst / "model.safetensors"
  header = hf_checkpoint.read_header(str(path))
  tensors = {rename(n): np.array(hf_checkpoint.read_tensor(str(path), n))
             for n in header}
  os.remove(path)
  hf_checkpoint.write_safetensors(str(path), tensors)
  return str(dst)


def test_released_tensor_name_variants_load_alike(tmp_path):
  # GPT-2's hub checkpoints store GPT2Model names (no `transformer.`);
  # GPT-NeoX heads appear as embed_out or lm_head.
  for name, rename in (
      ("tiny_gpt2", lambda n: n.removeprefix("transformer.")),
      ("tiny_pythia", lambda n: n.replace("embed_out", "lm_head"))):
    config = glu_config.config_from_hf(
      hf_checkpoint.read_config(str(FIXTURES / name)))
    want = hf_checkpoint.load_model_arrays(config, str(FIXTURES / name))
    got = hf_checkpoint.load_model_arrays(
      config, _rewrite(FIXTURES / name, tmp_path / name, rename))
    assert sorted(got) == sorted(want)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])


def test_a_missing_tensor_is_named(tmp_path):
  model_dir = _rewrite(FIXTURES / "tiny_gpt2", tmp_path / "m",
                       lambda n: n.replace("h.1.mlp.c_fc.bias", "h.1.x"))
  config = glu_config.config_from_hf(hf_checkpoint.read_config(model_dir))
  with pytest.raises(ValueError, match="lacks tensor "
                     "'transformer.h.1.mlp.c_fc.bias'"):
    hf_checkpoint.load_model_arrays(config, model_dir)


def _hf(name, **changes):
  return {**hf_checkpoint.read_config(str(FIXTURES / name)), **changes}


@pytest.mark.parametrize("name,changes,message", [
  ("tiny_gpt2", {"scale_attn_by_inverse_layer_idx": True},
   "scale_attn_by_inverse_layer_idx=True; only "
   "scale_attn_by_inverse_layer_idx=False"),
  ("tiny_gpt2", {"reorder_and_upcast_attn": True}, "reorder_and_upcast"),
  ("tiny_gpt2", {"add_cross_attention": True}, "add_cross_attention"),
  ("tiny_gpt2", {"scale_attn_weights": False}, "scale_attn_weights"),
  ("tiny_gpt2", {"activation_function": "relu"},
   r"activation_function 'relu'; supported: \['gelu'"),
  ("tiny_gpt2", {"architectures": ["GPT2ForSequenceClassification"]},
   "architectures"),
  ("tiny_pythia", {"attention_bias": False}, "attention_bias=False"),
  ("tiny_pythia", {"hidden_act": "relu"}, "hidden_act 'relu'"),
  ("tiny_pythia", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                       "rope_theta": 1e4}}, "'linear'"),
  ("tiny_pythia", {"model_type": "gpt_neo"},
   "model_type 'gpt_neo'.*supported: llama.*gpt2.*gpt_neox"),
])
def test_unsupported_family_options_are_refused(name, changes, message):
  with pytest.raises(ValueError, match=message) as info:
    glu_config.config_from_hf(_hf(name, **changes))
  assert "\n" not in str(info.value)


def test_gpt2_defaults_and_transformers_4_neox_spelling():
  gpt2 = _hf("tiny_gpt2", n_inner=None)
  assert glu_config.config_from_hf(gpt2).d_ff == 4 * gpt2["n_embd"]
  new = _hf("tiny_pythia")
  old = {k: v for k, v in new.items() if k != "rope_parameters"}
  old.update(rotary_pct=0.25, rotary_emb_base=10000)
  assert glu_config.config_from_hf(old) == glu_config.config_from_hf(new)


# name -> (layers, d, heads, head_dim, d_ff, vocab, rotary dims, max
# position, tied, parallel)
REAL = {
  "gpt2": (12, 768, 12, 64, 3072, 50257, None, 1024, True, False),
  "pythia-1.4b": (24, 2048, 16, 128, 8192, 50304, 32, 2048, False, True),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_family_configs_resolve(name):
  # Released configs in transformers 4 spelling (GPT-2's n_* keys and no
  # n_inner, Pythia's rotary_pct and rotary_emb_base).
  config = glu_config.config_from_hf(hf_checkpoint.read_config(
    str(FIXTURES / "hf_configs" / name), glu_config.check_fields))
  got = (config.n_layers, config.d_model, config.n_heads, config.head_dim,
         config.d_ff, config.vocab_size, config.rotary_dims,
         config.max_position, config.tied, config.parallel_residual)
  assert got == REAL[name]
  names = glu_sites.all_site_names(config)
  assert len(names) == 6 * config.n_layers
  sites = glu_sites.site_specs(config, names[-6:], 8)
  d, f = config.d_model, config.d_ff
  assert {s.kind: (s.d_in, s.d_out) for s in sites} == {
    "q_proj": (d, d), "k_proj": (d, d), "v_proj": (d, d), "o_proj": (d, d),
    "up_proj": (d, f), "down_proj": (f, d)}


def test_attention_eval_rebuilds_the_blocks_queries_and_keys(model):
  # The attention eval rebuilds queries and keys from the tapped q/k
  # outputs (bias included) with the family's positions: the clean pass
  # scores 0 against itself, and its pattern is the forward's own.
  _, config, arrays, ref = model
  tokens = jnp.asarray(ref["tokens"])
  names = (glu_weights.site_name(1, "q"),)
  sites, weights, fns = _fns(config, arrays, names)
  wanted = (*fns.attention_taps, "attn.1")
  _, clean = fns.clean_forward(weights, tokens, wanted)
  masks = {names[0]: SiteMask(jnp.zeros((*tokens.shape, 4)))}
  _, masked = fns.masked_forward_taps(weights, {sites[0].kind: (
    sites_lib.Factors(jnp.ones((1, 64, 4)), jnp.ones((1, 4, 64))))},
    tokens, masks, clean, wanted)
  same = fns.attention_divergence(weights, clean, clean)["layers.1"]
  moved = fns.attention_divergence(weights, masked, clean)["layers.1"]
  assert abs(float(same)) < 1e-6 < float(moved)
  q, k = (clean[f"layers.1.self_attn.{r}_proj.out"] for r in "qk")
  rope = glu_attention.rope_tables(config, tokens.shape[1])
  np.testing.assert_allclose(
    clean["attn.1"],
    glu_attention.attention_probs(*glu_attention.query_key_heads(
      q, k, None, None, config, rope)), atol=1e-6)


@pytest.mark.parametrize("change,message", [
  ({"norm": "batch"}, "unknown model norm 'batch'; use one of"),
  ({"activation": "relu"}, "unknown model activation 'relu'"),
  ({"positions": "alibi"}, "unknown model positions 'alibi'"),
  ({"rotary_dims": 3}, r"rotary dims 3 must be even and in \(0, head_dim"),
  ({"rotary_dims": 32}, r"rotary dims 32 must be even and in \(0, head_dim "
   "16]"),
])
def test_bad_family_options_are_refused(change, message):
  pythia = glu_config.config_from_hf(
    hf_checkpoint.read_config(str(FIXTURES / "tiny_pythia")))
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(pythia, **change)
