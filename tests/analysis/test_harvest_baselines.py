"""The units a harvest sets beside the components: their store keys, the
kinds each MLP form has, and an expert's activity weighted by its routing
(design §9.5)."""

import jax
import jax.numpy as jnp
import numpy as np

from decompax.analysis import harvest_baselines
from decompax.targets import glu_block, glu_config


def test_baseline_keys_name_each_units_kind():
  gated = harvest_baselines.MlpForm()
  assert harvest_baselines.mlp_prefix(2) == "layers.2.mlp"
  assert harvest_baselines.mlp_prefix((2, 5)) == "layers.2.mlp.experts.5"
  assert harvest_baselines.baseline_keys((1,), (0,), gated, (("s", 1),)) == (
    "layers.1.mlp.neurons", "layers.1.mlp.gates", "layers.1.mlp.rotated",
    "layers.0.self_attn.heads", "s.density_matched", "s.top_k")
  plain = harvest_baselines.MlpForm(gated=False)
  assert "gates" not in harvest_baselines.mlp_kinds(plain)


def test_an_experts_activity_is_weighted_by_its_routing():
  # Expert 2 of 3, 1 per token: its units count only where it is routed,
  # by its weight there.
  config = glu_config.GluConfig(
    n_layers=2, d_model=4, n_heads=1, n_kv_heads=1, head_dim=4, d_ff=5,
    vocab_size=8, rope_theta=1e4, rms_eps=1e-6, tied=True, qk_norm=True,
    family="qwen3_moe", n_experts=3, experts_per_token=1)
  mlp = harvest_baselines.MlpForm(
    routing=lambda logits: glu_block.routing_weights(logits, config))
  keys = jax.random.split(jax.random.key(0), 3)
  prefix = "layers.1.mlp.experts.2"
  taps = {f"{prefix}.gate_proj.out": jax.random.normal(keys[0], (2, 6, 5)),
          f"{prefix}.up_proj.out": jax.random.normal(keys[1], (2, 6, 5)),
          "layers.1.mlp.gate.out": jax.random.normal(keys[2], (2, 6, 3))}
  assert set(harvest_baselines.baseline_taps(((1, 2),), ())) == set(taps)
  rotation = np.linalg.qr(np.random.default_rng(0).normal(size=(5, 5)))[0]
  got = harvest_baselines.baseline_activity(taps, ((1, 2),), (), 0,
                                            {"rotation": jnp.asarray(
                                              rotation[None], jnp.float32)},
                                            mlp)
  logits = np.asarray(taps["layers.1.mlp.gate.out"])
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  weight = np.where(logits.argmax(-1) == 2, probs[..., 2], 0.0)[..., None]
  gate, up = (np.asarray(taps[f"{prefix}.{r}_proj.out"]) for r in ("gate",
                                                                   "up"))
  silu = gate / (1 + np.exp(-gate))
  want = {"neurons": np.maximum(silu * up, 0) * weight,
          "gates": np.maximum(silu, 0) * weight,
          "rotated": np.maximum(silu * up @ rotation, 0) * weight}
  assert sorted(got) == sorted(f"{prefix}.{k}" for k in want)
  assert 0 < np.mean(weight > 0) < 1
  for kind, value in want.items():
    np.testing.assert_allclose(got[f"{prefix}.{kind}"], value, rtol=1e-5,
                               atol=1e-6, err_msg=kind)
