"""Qwen3-MoE: config, routed experts in the scanned forward, loading, and
parity with transformers.

`tests/fixtures/tiny_qwen3moe` holds a tiny random Qwen3MoeForCausalLM
(3 layers, each a sparse block of 4 SwiGLU experts, 2 per token,
renormalised) under the released per-expert tensor names, with the fp32
logits and taps transformers' eager PyTorch model gave for fixed tokens and
the logits of the same weights without `norm_topk_prob`
(`make_lm_fixtures.py` writes them, in an environment with torch); nothing
here needs torch. Design §9.5, I55.
"""

import dataclasses
import json
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
  glu_arrays, glu_block, glu_config, glu_lm, glu_sites, glu_target,
  glu_weights)

from .test_family_parity import parity_errors, tap_keys

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / (
  "tiny_qwen3moe")
PARITY_TOL = 2e-5  # fp32


@pytest.fixture(scope="module")
def model():
  config = glu_config.config_from_hf(hf_checkpoint.read_config(
    str(FIXTURE), glu_config.check_fields))
  arrays = hf_checkpoint.load_model_arrays(config, str(FIXTURE))
  return config, arrays, np.load(FIXTURE / "reference.npz")


def _raw() -> dict:
  return json.loads((FIXTURE / "config.json").read_text())


def _fns(config, arrays, names, c=4, **options):
  sites = glu_sites.site_specs(config, names, c)
  seg = glu_sites.span_segments(config, sites)
  weights = glu_arrays.weights_from_arrays(arrays, config, seg)
  return sites, weights, glu_target.target_fns(config, sites, **options)


def _logits(config, arrays, tokens):
  _, weights, fns = _fns(config, arrays, (glu_weights.site_name(1, "q"),))
  return np.asarray(fns.clean_forward(weights, jnp.asarray(tokens), ())[0])


def test_logits_and_taps_match_transformers(model):
  config, arrays, ref = model
  taps = tap_keys(ref)
  assert {"layers.0.mlp", "layers.1.mlp.gate.out", "layers.2.mlp.out"} <= (
    set(taps))
  # Spans at the start, middle and end: each stack empty once.
  for layer in range(config.n_layers):
    _, weights, fns = _fns(config, arrays, (glu_weights.site_name(layer, "q"),))
    errors = parity_errors(fns, weights, ref, taps)
    assert max(errors.values()) <= PARITY_TOL, (layer, errors)


def test_fixture_config_is_what_the_parity_covers(model):
  config, arrays, ref = model
  assert config.family == "qwen3_moe" and config.moe and config.qk_norm
  assert (config.n_experts, config.experts_per_token) == (4, 2)
  assert config.norm_topk and not config.tied
  assert config.d_ff == _raw()["moe_intermediate_size"] != (
    _raw()["intermediate_size"])
  e, d, f = config.n_experts, config.d_model, config.d_ff
  assert arrays["router"].shape == (config.n_layers, d, e)
  assert arrays["expert_gate"].shape == (config.n_layers, e, d, f)
  assert arrays["expert_down"].shape == (config.n_layers, e, f, d)
  assert not {"gate", "up", "down"} & set(arrays)
  # The router spreads the tokens: every expert is chosen somewhere.
  chosen = np.argsort(ref["tap.layers.1.mlp.gate.out"], -1)[..., -2:]
  assert set(chosen.ravel()) == set(range(e))


def test_without_norm_topk_prob_matches_transformers(model):
  config, arrays, ref = model
  logits = _logits(dataclasses.replace(config, norm_topk=False), arrays,
                   ref["tokens"])
  assert np.max(np.abs(logits - ref["logits_no_norm_topk"])) <= PARITY_TOL
  assert np.max(np.abs(logits - ref["logits"])) > 100 * PARITY_TOL


@pytest.mark.parametrize("k", [1, 3, 4])
def test_the_number_of_routed_experts_moves_the_logits(model, k):
  config, arrays, ref = model
  logits = _logits(dataclasses.replace(config, experts_per_token=k), arrays,
                   ref["tokens"])
  assert np.max(np.abs(logits - ref["logits"])) > 100 * PARITY_TOL


@pytest.mark.parametrize("norm_topk", [True, False])
def test_routing_weights_keep_the_top_k_probabilities(norm_topk):  # I55
  config = glu_config.GluConfig(
    n_layers=1, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=4,
    vocab_size=8, rope_theta=1e4, rms_eps=1e-6, tied=True, qk_norm=True,
    family="qwen3_moe", n_experts=5, experts_per_token=2,
    norm_topk=norm_topk)
  logits = jax.random.normal(jax.random.key(0), (3, 7, 5))
  w = np.asarray(glu_block.routing_weights(logits, config))
  probs = np.asarray(jax.nn.softmax(logits, -1))
  top = np.argsort(-probs, -1)[..., :2]
  chosen = np.zeros_like(w, bool)
  np.put_along_axis(chosen, top, True, -1)
  assert np.all(w[~chosen] == 0) and np.all(w[chosen] > 0)
  kept = np.where(chosen, probs, 0)
  want = kept / kept.sum(-1, keepdims=True) if norm_topk else kept
  np.testing.assert_allclose(w, want, rtol=1e-6)


def test_the_block_sums_the_chosen_experts_outputs(model):  # I55
  # Per position, the block's output is Σ over its chosen experts of the
  # routing weight times that expert's SwiGLU, each expert run alone.
  config, arrays, ref = model
  lw = glu_weights.layer_stack(**{k: jnp.asarray(arrays[k][1]) for k in (
    "ln1", "ln2", "q", "k", "v", "o", "router", "expert_gate", "expert_up",
    "expert_down")})
  xm = jnp.asarray(ref["tap.layers.0.mlp"])
  # The expert projections as the clean forward's blocks run them.
  out, logits, _ = glu_block.moe_mlp(
    xm, lw, config,
    lambda r, x: glu_block.frozen_site(r, x, getattr(lw, r), None))
  probs = jax.nn.softmax(logits, -1)
  top_p, top_i = jax.lax.top_k(probs, config.experts_per_token)
  top_p = top_p / top_p.sum(-1, keepdims=True)
  want = np.zeros(out.shape, np.float32)
  for e in range(config.n_experts):
    y = (jax.nn.silu(xm @ lw.expert_gate[e]) * (xm @ lw.expert_up[e])
         ) @ lw.expert_down[e]
    w = jnp.sum(jnp.where(top_i == e, top_p, 0.0), -1)
    want += np.asarray(w[..., None] * y)
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)


def test_a_moe_models_sites_are_its_attention_and_its_experts(model):
  config, _, _ = model
  names = glu_sites.all_site_names(config)
  experts = tuple(f"layers.1.mlp.experts.{e}.{r}_proj" for e in range(4)
                  for r in ("gate", "up", "down"))
  assert names[16:32] == tuple(glu_weights.site_name(1, r) for r in "qkvo") + (
    experts)
  assert len(names) == 3 * (4 + 3 * config.n_experts)
  sites = glu_sites.site_specs(config, names, 4)
  assert [s.name for s in sites] == list(names)
  assert len({s.draw_path for s in sites}) == len(sites)
  by_name = {s.name: s for s in sites}
  d, f = config.d_model, config.d_ff
  assert (by_name[experts[-1]].kind, by_name[experts[-1]].d_in,
          by_name[experts[-1]].d_out) == ("expert_down_proj", f, d)
  assert by_name[experts[0]].kind == "expert_gate_proj"
  for bad in ("layers.1.mlp.experts.4.up_proj", "layers.1.mlp.up_proj",
              "layers.1.mlp.gate"):
    with pytest.raises(ValueError, match=r"unknown site .*layers.<i>.mlp."
                       r"experts.<e>.\{gate,up,down\}_proj for e < 4"):
      glu_sites.site_specs(config, (bad,), 4)


# Expert sites of two layers (a kind gathered to span layout), one layer's
# attention beside them.
EXPERT_SITES = ("layers.1.self_attn.v_proj", "layers.1.mlp.experts.2.up_proj",
                "layers.1.mlp.experts.2.down_proj",
                "layers.2.mlp.experts.0.up_proj",
                "layers.2.mlp.experts.3.gate_proj")


def _exact(config, arrays, names, c):
  """Return sites, weights, fns and components that reproduce each site's
  `W` exactly (`V = W`, `U = I`, one C per site: its d_out)."""
  sites, weights, fns = _fns(config, arrays, names, c=c)
  frozen = fns.frozen_stacks(weights)
  components = {}
  for s in sites:
    components[s.kind] = sites_lib.Factors(
      frozen[s.kind], jnp.broadcast_to(jnp.eye(s.c), (
        frozen[s.kind].shape[0], s.c, s.c)))
  return sites, weights, fns, components


def test_an_exact_decomposition_of_experts_is_the_clean_forward(model):
  config, arrays, ref = model
  c = {n: glu_sites.role_dims(config, glu_weights.parse_site(n)[1])[1]
       for n in EXPERT_SITES}
  sites, weights, fns, components = _exact(config, arrays, EXPERT_SITES, c)
  tokens = jnp.asarray(ref["tokens"])
  clean_logits, clean = fns.clean_forward(weights, tokens, fns.start_taps)
  masks = {s.name: SiteMask(jnp.ones((*tokens.shape, s.c))) for s in sites}
  masked = fns.masked_forward_taps(weights, components, tokens, masks, clean,
                                   ())[0]
  np.testing.assert_allclose(masked, clean_logits, atol=1e-5)
  assert np.max(np.abs(np.asarray(clean_logits) - ref["logits"])) <= (
    PARITY_TOL)
  # Random factors with the delta on: `x·V·U + (x·W − x·V·U)` is `x·W`.
  keys = iter(jax.random.split(jax.random.key(0), 2 * len(components)))
  noisy = {k: sites_lib.Factors(jax.random.normal(next(keys), f.v.shape),
                                jax.random.normal(next(keys), f.u.shape))
           for k, f in components.items()}
  with_delta = {n: SiteMask(m.mask, jnp.ones(tokens.shape))
                for n, m in masks.items()}
  for site_masks, moved in ((with_delta, False), (masks, True)):
    got = np.asarray(fns.masked_forward_taps(
      weights, noisy, tokens, site_masks, clean, ())[0])
    error = np.max(np.abs(got - np.asarray(clean_logits)))
    assert (error > 1e-2) if moved else (error < 1e-4), error


@pytest.mark.parametrize("name", EXPERT_SITES[1:])
def test_masking_an_expert_removes_exactly_that_expert(model, name):  # I55
  # Every component of one expert's projection masked, no delta: the
  # forward of the model whose matrix for that expert (only) is zero.
  config, arrays, ref = model
  layer, role, _ = glu_weights.parse_site(name)
  expert = glu_weights.site_expert(name)
  c = glu_sites.role_dims(config, role)[1]
  sites, weights, fns, components = _exact(config, arrays, EXPERT_SITES, c)
  tokens = jnp.asarray(ref["tokens"])
  _, clean = fns.clean_forward(weights, tokens, fns.start_taps)
  masks = {name: SiteMask(jnp.zeros((*tokens.shape, c)))}
  masked = np.asarray(fns.masked_forward_taps(
    weights, components, tokens, masks, clean, ())[0])
  zeroed = dict(arrays)
  zeroed[role] = arrays[role].copy()
  zeroed[role][layer, expert] = 0
  want = _logits(config, zeroed, ref["tokens"])
  np.testing.assert_allclose(masked, want, atol=1e-5)
  assert np.max(np.abs(want - ref["logits"])) > 100 * PARITY_TOL


def test_expert_taps_are_each_experts_projection(model):
  config, arrays, ref = model
  _, weights, fns = _fns(config, arrays, (glu_weights.site_name(1, "q"),))
  keys = [f"layers.1.mlp.experts.2.{r}_proj{o}" for r in ("gate", "up",
                                                         "down")
          for o in ("", ".out")]
  _, taps = fns.clean_forward(weights, jnp.asarray(ref["tokens"]),
                              ("layers.1.mlp", *keys))
  xm = np.asarray(taps["layers.1.mlp"])
  gate, up, down = (arrays[f"expert_{r}"][1, 2] for r in ("gate", "up",
                                                         "down"))
  hidden = np.asarray(jax.nn.silu(xm @ gate)) * (xm @ up)
  want = dict(zip(keys, (xm, xm @ gate, xm, xm @ up, hidden,
                         hidden @ down)))
  for k in keys:
    np.testing.assert_allclose(np.asarray(taps[k]), want[k], atol=1e-5,
                               err_msg=k)
  with pytest.raises(ValueError, match="beyond the model's 4"):
    fns.clean_forward(weights, jnp.asarray(ref["tokens"]),
                      ("layers.1.mlp.experts.4.up_proj.out",))


def test_what_masking_an_expert_reaches(model):
  config, arrays, _ = model
  _, _, fns = _fns(config, arrays, ("layers.1.mlp.experts.2.up_proj",))
  reaches = fns.masking_reaches
  for tap in ("layers.1.mlp.out", "layers.1.mlp.experts.2.up_proj.out",
              "layers.1.mlp.experts.2.down_proj", "resid.2",
              "layers.2.mlp.gate.out"):
    assert reaches(tap), tap
  for tap in ("layers.1.mlp", "layers.1.mlp.gate.out",
              "layers.1.mlp.experts.2.gate_proj.out", "resid.1",
              "layers.1.self_attn.o_proj.out"):
    assert not reaches(tap), tap
  assert fns.hidden_pass_points == ("layers.1.mlp.out", "layers.2.mlp.out")


def test_the_router_eval_scores_the_routers_masking_moves(model):  # I56
  config, arrays, _ = model
  cases = {("layers.1.mlp.experts.2.up_proj",): (2,),
           ("layers.1.self_attn.v_proj",): (1, 2),
           ("layers.0.mlp.experts.0.gate_proj",
            "layers.2.mlp.experts.1.down_proj"): (1, 2),
           ("embed_tokens",): (0, 1, 2), ("lm_head",): ()}
  for names, layers in cases.items():
    _, _, fns = _fns(config, arrays, names)
    assert fns.router_taps == tuple(f"layers.{i}.mlp.gate.out"
                                    for i in layers), names
    assert fns.router_divergence is not None


def _router_kl(clean, masked):
  # Direct: per position Σ_e p_e·log(p_e/q_e), averaged over positions.
  def softmax(x):
    z = np.exp(x - np.max(x, -1, keepdims=True))
    return z / np.sum(z, -1, keepdims=True)

  p, q = (softmax(np.asarray(x, np.float64)) for x in (clean, masked))
  return np.mean(np.sum(p * np.log(p / q), -1))


def test_the_router_kl_is_zero_with_the_delta_and_the_direct_kl_else(
    model):  # I56
  config, arrays, ref = model
  c = {n: glu_sites.role_dims(config, glu_weights.parse_site(n)[1])[1]
       for n in EXPERT_SITES}
  sites, weights, fns, components = _exact(config, arrays, EXPERT_SITES, c)
  assert fns.router_taps == ("layers.1.mlp.gate.out",
                             "layers.2.mlp.gate.out")
  tokens = jnp.asarray(ref["tokens"])
  _, clean = fns.clean_forward(weights, tokens,
                               (*fns.start_taps, *fns.router_taps))
  keys = iter(jax.random.split(jax.random.key(1), 2 * len(components)))
  noisy = {k: sites_lib.Factors(jax.random.normal(next(keys), f.v.shape),
                                jax.random.normal(next(keys), f.u.shape))
           for k, f in components.items()}
  ones = {s.name: jnp.ones((*tokens.shape, s.c)) for s in sites}
  with_delta = {n: SiteMask(m, jnp.ones(tokens.shape))
                for n, m in ones.items()}
  # Exact factors reproduce every router bit for bit; random ones with the
  # delta up to fp32 rounding of `x·V·U + (x·W − x·V·U)`.
  for factors, site_masks, tol in (
      (components, {n: SiteMask(m) for n, m in ones.items()}, 0.0),
      (noisy, with_delta, 1e-7)):
    _, taps = fns.masked_forward_taps(weights, factors, tokens, site_masks,
                                      clean, fns.router_taps)
    for value in fns.router_divergence(taps, clean).values():
      assert abs(float(value)) <= tol
  # Without the delta the random factors move layer 1's attention (its
  # v_proj) and so both routers.
  _, taps = fns.masked_forward_taps(
    weights, noisy, tokens, {n: SiteMask(m) for n, m in ones.items()},
    clean, fns.router_taps)
  kl = fns.router_divergence(taps, clean)
  assert list(kl) == ["layers.1", "layers.2"]
  for i in (1, 2):
    tap = f"layers.{i}.mlp.gate.out"
    want = _router_kl(clean[tap], taps[tap])
    assert want > 1e-3
    np.testing.assert_allclose(float(kl[f"layers.{i}"]), want, rtol=1e-4)


def test_a_dense_model_has_no_router_eval():
  config = glu_config.GluConfig(
    n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=4,
    vocab_size=8, rope_theta=1e4, rms_eps=1e-6, tied=True, qk_norm=False)
  fns = glu_target.target_fns(config, glu_sites.site_specs(
    config, ("layers.0.mlp.up_proj", "layers.1.self_attn.q_proj"), 2))
  assert fns.router_taps == () and fns.router_divergence is None


def test_moe_taps_are_refused_on_a_dense_model():
  config = glu_config.GluConfig(
    n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=4,
    vocab_size=8, rope_theta=1e4, rms_eps=1e-6, tied=True, qk_norm=False)
  assert "layers.0.mlp.out" not in glu_weights.all_tap_keys(config)
  with pytest.raises(ValueError, match="mixture-of-experts block"):
    glu_lm._parsed_taps(("layers.0.mlp.out",), config, 0)


def test_fused_expert_tensors_load_alike(model, tmp_path):
  # transformers 5 saves each layer's experts fused: `gate_up_proj [E, 2f,
  # d]` (gate rows first) and `down_proj [E, d, f]`.
  config, arrays, _ = model
  path = FIXTURE / "model.safetensors"
  tensors = {n: np.asarray(hf_checkpoint.read_tensor(str(path), n))
             for n in hf_checkpoint.read_header(str(path))}
  fused = {}
  for name, t in tensors.items():
    if ".mlp.experts." not in name:
      fused[name] = t
      continue
    layer = name.split(".mlp.experts.")[0]
    e = config.n_experts
    if name.endswith(".0.gate_proj.weight"):
      fused[f"{layer}.mlp.experts.gate_up_proj"] = np.stack([
        np.concatenate([tensors[f"{layer}.mlp.experts.{i}.{r}_proj.weight"]
                        for r in ("gate", "up")]) for i in range(e)])
      fused[f"{layer}.mlp.experts.down_proj"] = np.stack([
        tensors[f"{layer}.mlp.experts.{i}.down_proj.weight"]
        for i in range(e)])
  assert len(fused) < len(tensors)
  shutil.copy(FIXTURE / "config.json", tmp_path / "config.json")
  hf_checkpoint.write_safetensors(str(tmp_path / "model.safetensors"), fused)
  again = hf_checkpoint.load_model_arrays(config, str(tmp_path))
  assert set(again) == set(arrays)
  for k in arrays:
    np.testing.assert_array_equal(again[k], arrays[k], err_msg=k)


def test_a_missing_expert_is_named(model, tmp_path):
  config, _, _ = model
  path = FIXTURE / "model.safetensors"
  gone = "model.layers.2.mlp.experts.3.up_proj.weight"
  tensors = {n: np.asarray(hf_checkpoint.read_tensor(str(path), n))
             for n in hf_checkpoint.read_header(str(path)) if n != gone}
  hf_checkpoint.write_safetensors(str(tmp_path / "model.safetensors"),
                                  tensors)
  with pytest.raises(ValueError, match=f"lacks tensor '{gone}'"):
    hf_checkpoint.load_model_arrays(config, str(tmp_path))


def test_released_and_transformers_5_config_spellings_agree():
  raw = _raw()
  released = {k: v for k, v in raw.items() if k != "num_local_experts"}
  released["num_experts"] = raw["num_local_experts"]
  assert (glu_config.config_from_hf(released)
          == glu_config.config_from_hf(raw))


@pytest.mark.parametrize("changes, message", [
  ({"mlp_only_layers": [1]}, r"dense MLP layers \[1\]"),
  ({"decoder_sparse_step": 2}, r"dense MLP layers \[0, 2\]"),
  ({"shared_expert_intermediate_size": 64}, "a shared expert"),
  ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 > num_experts 4"),
  ({"num_local_experts": 0}, "num_experts 0"),
  ({"moe_intermediate_size": None}, "moe_intermediate_size None"),
  ({"norm_topk_prob": "yes"}, "norm_topk_prob 'yes'"),
  ({"hidden_act": "gelu"}, "hidden_act"),
  ({"use_sliding_window": True, "sliding_window": 8}, "sliding-window"),
  ({"architectures": ["Qwen3MoeForSequenceClassification"]},
   "architectures"),
])
def test_unsupported_moe_configs_are_refused(changes, message):
  with pytest.raises(ValueError, match=message) as info:
    glu_config.config_from_hf(_raw() | changes)
  assert "\n" not in str(info.value)


def test_only_silu_experts_are_built():
  with pytest.raises(ValueError, match="SwiGLU"):
    glu_config.GluConfig(
      n_layers=1, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=4,
      vocab_size=8, rope_theta=1e4, rms_eps=1e-6, tied=True, qk_norm=True,
      family="qwen3_moe", n_experts=4, experts_per_token=2,
      activation="gelu")
  with pytest.raises(ValueError, match="experts per token 5"):
    glu_config.GluConfig(
      n_layers=1, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=4,
      vocab_size=8, rope_theta=1e4, rms_eps=1e-6, tied=True, qk_norm=True,
      family="qwen3_moe", n_experts=4, experts_per_token=5)


def test_random_moe_layers_have_the_loaded_layout(model):
  # `init_stack` draws the same leaves and shapes a checkpoint loads, and
  # they run through the forward.
  config, arrays, ref = model
  stack = glu_weights.init_stack(jax.random.key(0), config, config.n_layers)
  drawn = {k: v for k, v in stack._asdict().items() if v is not None}
  layers = {k: v for k, v in arrays.items() if k not in (
    "embed", "norm", "head")}
  assert {k: v.shape for k, v in drawn.items()} == {
    k: v.shape for k, v in layers.items()}
  assert not np.allclose(drawn["expert_up"][0, 0], drawn["expert_up"][0, 1])
  logits = _logits(config, {**arrays, **drawn}, ref["tokens"])
  assert np.all(np.isfinite(logits))
  assert np.max(np.abs(logits - ref["logits"])) > 100 * PARITY_TOL
