"""One decoder block: attention and MLP sublayers whose every projection
runs through a site function, and Qwen3-MoE's routed mixture of SwiGLU
experts (`moe_mlp`, design §9.5), whose projections run through the same
site functions, batched over the experts.

Site matmuls go through `SiteFn(role, x, w, extra)`, where `extra` is the
per-layer slice of whatever the caller scanned beside the weights (live
factors and masks): the clean forward and the frozen parts of a masked one
run the very same `x @ w`, so a masked forward with no live site is the clean
forward bit for bit (I2). Biases are added after the site matmul, outside
the decomposition (I52).
"""

from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from decompax.targets import glu_attention, glu_config, glu_norms, glu_weights


# (role, x, W, per-layer extra) -> x·W or a live site's output.
SiteFn = Callable[[str, Array, Array, Any], Array]


def frozen_site(role: str, x: Array, w: Array, extra: Any) -> Array:
  """Return the frozen `x @ w` (every matmul of the clean forward)."""
  del role, extra
  return x @ w


def block(
  h: Float[Array, "b t d"],
  lw: glu_weights.LayerStack,
  site: Callable[[str, Array, Array], Array],
  config: glu_config.GluConfig,
  rope: Optional[tuple[Array, Array]],
  attend: Callable[..., Array],
  streams: tuple[str, ...] = (),
  mask: Optional[Bool[Array, "t t"]] = None,
) -> tuple[Float[Array, "b t d"], dict[str, Array]]:
  """Run one decoder block (SPEC §9.1, design §9.4) on one layer's weights.

  Returns the block output and the `streams` asked for: `resid` (the
  input), each role's input under the role and its output under
  `<role>.out` (its bias added, I52; before a sandwich norm), and the
  attention pattern `attn`. `mask` is a sliding-window layer's (None:
  causal).
  """
  b, t, _ = h.shape

  def project(role, x):
    y = site(role, x, getattr(lw, role))
    bias = getattr(lw, f"{role}_bias")
    return y if bias is None else y + bias

  xa = glu_norms.norm(h, lw.ln1, lw.ln1_bias, config)
  q, k, v = project("q", xa), project("k", xa), project("v", xa)
  qh, kh = glu_attention.query_key_heads(q, k, lw.q_norm, lw.k_norm, config,
                                         rope)
  vh = v.reshape(b, t, config.n_kv_heads, config.head_dim)
  options = ({"config": config, "mask": mask}
             if glu_attention.custom_scores(config)
             else {})
  o_in = attend(qh, kh, vh, **options).reshape(b, t, config.q_width)
  o = project("o", o_in)
  h1 = h + glu_norms.post_norm(o, lw.post_attn_norm, config)
  # A parallel block's MLP reads the block input, not h + attention.
  xm = glu_norms.norm(h if config.parallel_residual else h1, lw.ln2,
                      lw.ln2_bias, config)
  down, values = _mlp(xm, lw, project, config,
                      lambda r, x: site(r, x, getattr(lw, r)))
  values.update({"resid": h, "q": xa, "k": xa, "v": xa, "o": o_in,
                 "q.out": q, "k.out": k, "v.out": v, "o.out": o})
  out = {s: _stream_value(values, s) for s in streams if s != "attn"}
  if "attn" in streams:
    # Built only when tapped: `[b, nh, t, t]` outweighs the whole block.
    # From its own copy of q and k: sharing `qh` with the attention lets XLA
    # fuse the attention differently and move the logits by rounding (I29).
    q_own, k_own = jax.lax.optimization_barrier((q, k))
    out["attn"] = glu_attention.attention_probs(*glu_attention.query_key_heads(
      q_own, k_own, lw.q_norm, lw.k_norm, config, rope), config, mask)
  return h1 + glu_norms.post_norm(down, lw.post_mlp_norm, config), out


def _stream_value(values: dict[str, Array], stream: str) -> Array:
  """Return a stream's value; `<stream>@<e>` is expert `e`'s slice of an
  expert stream stacked `[b, expert, t, ...]`."""
  base, _, expert = stream.partition("@")
  return values[base][:, int(expert)] if expert else values[base]


def _mlp(
  xm: Float[Array, "b t d"], lw: glu_weights.LayerStack,
  project: Callable[[str, Array], Array], config: glu_config.GluConfig,
  expert_site: Callable[[str, Array], Array],
) -> tuple[Float[Array, "b t d"], dict[str, Array]]:
  """Return a block's MLP output on its normed input `xm` and the MLP's
  streams: a GLU, a plain MLP, or a mixture of experts (whose projections
  run through `expert_site(role, x)`)."""
  if config.moe:
    down, router_logits, experts = moe_mlp(xm, lw, config, expert_site)
    return down, {"moe": xm, "moe.out": down, "router": xm,
                  "router.out": router_logits, **experts}
  values = {}
  if config.gated:
    gate, up = project("gate", xm), project("up", xm)
    act = glu_norms.activation(config)(gate) * up
    values.update({"gate": xm, "gate.out": gate})
  else:
    up = project("up", xm)
    act = glu_norms.activation(config)(up)
  down = project("down", act)
  values.update({"up": xm, "up.out": up, "down": act, "down.out": down})
  return down, values


def routing_weights(
  logits: Float[Array, "*l e"], config: glu_config.GluConfig
) -> Float[Array, "*l e"]:
  """Return each expert's weight per position: its router probability
  (softmax over all experts in fp32) where it is among the position's
  `experts_per_token` most probable, renormalised over those when
  `norm_topk`, 0 elsewhere; cast to the logits' dtype, as transformers'
  Qwen3MoeTopKRouter casts its top-k values."""
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  top, index = jax.lax.top_k(probs, config.experts_per_token)
  if config.norm_topk:
    top = top / jnp.sum(top, axis=-1, keepdims=True)
  top = top.astype(logits.dtype)
  # Each position's chosen experts are distinct, so the one-hot rows of
  # `index` never overlap: the sum places each weight, adding nothing.
  onehot = jax.nn.one_hot(index, config.n_experts, dtype=logits.dtype)
  return jnp.einsum("...k,...ke->...e", top, onehot)


def router_kl(
  clean_logits: Float[Array, "b t e"], masked_logits: Float[Array, "b t e"]
) -> Float[Array, ""]:
  """Return `mean KL(clean ‖ masked)` of two forwards' router distributions
  (softmax over all experts in fp32, as `routing_weights` takes it) over
  the batch's positions."""
  log_p = jax.nn.log_softmax(clean_logits.astype(jnp.float32), axis=-1)
  log_q = jax.nn.log_softmax(masked_logits.astype(jnp.float32), axis=-1)
  return jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1))


def moe_mlp(
  xm: Float[Array, "b t d"], lw: glu_weights.LayerStack,
  config: glu_config.GluConfig, site: Callable[[str, Array], Array],
) -> tuple[Float[Array, "b t d"], Float[Array, "b t e"], dict[str, Array]]:
  """Return a Qwen3-MoE sparse block's output, its router logits and its
  experts' streams.

  Logits `xm @ router` (frozen, never a site); each expert `e` is a SwiGLU
  `down_e(silu(gate_e xm) ⊙ up_e xm)`, and the output is
  `Σ_e w_e·expert_e(xm)` with `routing_weights` `w` (transformers'
  Qwen3MoeSparseMoeBlock, which also weights each expert's output).

  Every expert runs on every position and the unchosen ones are weighted
  by an exact 0: the same sum as transformers' loop over the tokens routed
  to each expert, up to the order of its fp additions, with static shapes
  and no gather (a gathered form that runs only the chosen experts would
  cut the work by `n_experts / experts_per_token`; not done yet).
  Each projection runs as `site(role, x)` on `[b, expert, t, d_in]` inputs
  (`xm` broadcast over the experts for gate and up) against its
  `[expert, d_in, d_out]` stack, by default the frozen `x @ w`; the
  streams `expert_gate.out`, `expert_up.out`, `expert_down` (the hidden
  `silu(gate) ⊙ up`) and `expert_down.out` are stacked `[b, expert, t,
  ...]`.
  """
  logits = xm @ lw.router
  weights = routing_weights(logits, config)
  x = xm[:, None]
  gate = site("expert_gate", x)
  up = site("expert_up", x)
  hidden = jax.nn.silu(gate) * up
  down = site("expert_down", hidden)
  out = jnp.einsum("betd,bte->btd", down, weights)
  return out, logits, {"expert_gate.out": gate, "expert_up.out": up,
                       "expert_down": hidden, "expert_down.out": down}
