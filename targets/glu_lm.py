"""Pure forward of a decoder LM over three stored layer stacks (SPEC §9).

The block is Llama's (GLU MLP, RMSNorm, RoPE) or, by the config's family
options, GPT-2's, GPT-NeoX's or Gemma's (design §9.4): LayerNorm with
bias, a plain MLP, learned positions, partial rotary, parallel residual,
biases that every projection adds after its site matmul, outside the
decomposition (I52), and Gemma's offset RMSNorm, sandwich norms, GeGLU,
soft-capping and sliding-window layers. Which layers attend through a
window is a per-layer flag scanned beside the weights, so one scan runs
both kinds. Qwen3-MoE's MLP is a routed mixture of SwiGLU experts
(`moe_mlp`, design §9.5) whose projections run through the same site
functions, batched over the experts.

Frozen weights are stacked per kind on a leading `layer` axis, in the
orientation `y = x @ W` (`W: [d_in, d_out]`), and stored as three stacks:
the frozen prefix `[0, split)`, the decomposed span `[split, tail)` and the
frozen tail `[tail, n_layers)` (an empty one is None). Each runs as one
`lax.scan` over a whole stored leaf, so no forward slices a copy out of a
stack (I41). Activations are `[b, t, ...]`; tokens `[b, t]` int.

Tap keys (SPEC §1): `resid.{i}` is the residual entering block `i`
(`resid.0` the embeddings, `resid.{n_layers}` the pre-final-norm residual);
a site name `layers.{i}.self_attn.q_proj` is that matrix's input and
`<site>.out` its output; `attn.{i}` is block `i`'s fp32 attention pattern
`[b, n_heads, t, t]`, built only when asked (`attention_probs` of the
block's own queries and keys: the exact softmax whatever attention
implementation the block runs); a mixture-of-experts model's
`layers.{i}.mlp` / `.mlp.out` and `layers.{i}.mlp.gate` / `.mlp.gate.out`
are its MLP block's input and output and its router's input and logits.
Taps leave a segment's scan as stacked
outputs only for its layers up to the deepest tapped one; boundaries
between segments are the carries.

Site matmuls go through `SiteFn(role, x, w, extra)`, where `extra` is the
per-layer slice of whatever the caller scanned beside the weights (live
factors and masks): the clean forward and the frozen parts of a masked one
run the very same `x @ w`, so a masked forward with no live site is the clean
forward bit for bit (I2).
"""

import dataclasses
import re
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from decompax.core import attention as attention_lib
from decompax.targets import glu_config

ROLES = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION_IMPLS = ("reference", "xla", "cudnn", "auto")
# A mixture-of-experts model's expert projections, HF's
# `mlp.experts.<e>.{gate,up,down}_proj`: roles of their own, each site one
# expert's matrix (design §9.5).
EXPERT_ROLES = ("expert_gate", "expert_up", "expert_down")
_SITE_RE = re.compile(
  r"^layers\.(\d+)\.(?:self_attn\.(q|k|v|o)|mlp\.(gate|up|down)"
  r"|mlp\.experts\.(\d+)\.(gate|up|down))_proj(\.out)?$")
# The token embedding and the unembedding as sites and taps (design §9.2):
# HF's `model.embed_tokens` and `lm_head`, named like `layers.<i>` without
# the `model.` prefix. Their tap is the site's input: the token ids, and the
# final hidden state (after the final norm) the head reads; `.out` the
# site's output: the embedding rows (before any position table), the logits.
EMBED_SITE = "embed_tokens"
HEAD_SITE = "lm_head"
END_SITES = (EMBED_SITE, HEAD_SITE)
END_TAPS = END_SITES + tuple(f"{n}.out" for n in END_SITES)
# A mixture-of-experts model's MLP taps, named after HF's modules:
# `layers.<i>.mlp` is the block's input (the normed residual) and `.out`
# its output (the routed sum), `layers.<i>.mlp.gate` the router's input and
# `.out` its logits `[b, t, n_experts]`; streams `moe`, `moe.out`, `router`,
# `router.out`.
_MOE_TAP_RE = re.compile(r"^layers\.(\d+)\.mlp(\.gate)?(\.out)?$")
MOE_STREAMS = ("moe", "moe.out", "router", "router.out")
_RESID_RE = re.compile(r"^resid\.(\d+)$")
_ATTN_RE = re.compile(r"^attn\.(\d+)$")


class LayerStack(NamedTuple):
  """Frozen weights of consecutive layers, each leaf `[layer, ...]`."""

  ln1: Float[Array, "layer d"]
  q: Float[Array, "layer d q"]
  k: Float[Array, "layer d kv"]
  v: Float[Array, "layer d kv"]
  o: Float[Array, "layer q d"]
  ln2: Float[Array, "layer d"]
  gate: Float[Array, "layer d f"]
  up: Float[Array, "layer d f"]
  down: Float[Array, "layer f d"]
  q_norm: Optional[Float[Array, "layer hd"]] = None
  k_norm: Optional[Float[Array, "layer hd"]] = None
  # Frozen biases (I52) of models that have them, else None: one per
  # projection role (`<role>_bias`, `[layer, d_out]`) and LayerNorm's.
  q_bias: Optional[Float[Array, "layer q"]] = None
  k_bias: Optional[Float[Array, "layer kv"]] = None
  v_bias: Optional[Float[Array, "layer kv"]] = None
  o_bias: Optional[Float[Array, "layer d"]] = None
  gate_bias: Optional[Float[Array, "layer f"]] = None
  up_bias: Optional[Float[Array, "layer f"]] = None
  down_bias: Optional[Float[Array, "layer d"]] = None
  ln1_bias: Optional[Float[Array, "layer d"]] = None
  ln2_bias: Optional[Float[Array, "layer d"]] = None
  # Sandwich norms (Gemma): on the attention and the MLP output before
  # each residual add.
  post_attn_norm: Optional[Float[Array, "layer d"]] = None
  post_mlp_norm: Optional[Float[Array, "layer d"]] = None
  # A mixture-of-experts MLP (Qwen3-MoE) in place of gate/up/down: the
  # frozen router `x @ router -> [.., expert]` and each expert's SwiGLU
  # projections, stacked `[layer, expert, d_in, d_out]`.
  router: Optional[Float[Array, "layer d e"]] = None
  expert_gate: Optional[Float[Array, "layer e d f"]] = None
  expert_up: Optional[Float[Array, "layer e d f"]] = None
  expert_down: Optional[Float[Array, "layer e f d"]] = None


def layer_stack(**leaves: Any) -> LayerStack:
  """Return a `LayerStack` of the given leaves, every other one None (a
  plain MLP has no `gate`)."""
  return LayerStack(**{name: leaves.get(name) for name in LayerStack._fields})


class GluWeights(NamedTuple):
  """A decoder's frozen weights; `head` None means tied to `embed`.

  `pos` is a learned position table `[max_position, d]` added to the
  embeddings (GPT-2), `norm_bias` the final LayerNorm's bias; None where
  the model has none.
  """

  embed: Float[Array, "vocab d"]
  prefix: Optional[LayerStack]
  span: Optional[LayerStack]
  tail: Optional[LayerStack]
  norm: Float[Array, " d"]
  head: Optional[Float[Array, "vocab d"]] = None
  pos: Optional[Float[Array, "p d"]] = None
  norm_bias: Optional[Float[Array, " d"]] = None


@dataclasses.dataclass(frozen=True)
class Segments:
  """Layer bounds of the three stacks: `[0, split)`, `[split, tail)`, rest."""

  n_layers: int
  split: int
  tail: int

  def __post_init__(self):
    if not 0 <= self.split <= self.tail <= self.n_layers:
      raise ValueError(f"segment bounds 0 <= split {self.split} <= tail "
                       f"{self.tail} <= n_layers {self.n_layers} violated")

  def bounds(self) -> tuple[tuple[str, int, int], ...]:
    return (("prefix", 0, self.split), ("span", self.split, self.tail),
            ("tail", self.tail, self.n_layers))


MLP_ROLES = ("gate", "up", "down")


def model_roles(config: glu_config.GluConfig) -> tuple[str, ...]:
  """Return the model's projection roles: `ROLES`, less `gate` for a plain
  (ungated) MLP, and a mixture of experts' `EXPERT_ROLES` (each site one
  expert's matrix) in place of the three MLP roles."""
  if config.moe:
    return tuple(r for r in ROLES if r not in MLP_ROLES) + EXPERT_ROLES
  return ROLES if config.gated else tuple(r for r in ROLES if r != "gate")


def site_name(layer: int, role: str, expert: Optional[int] = None) -> str:
  """Return the HF-style name of one projection (of expert `expert` for an
  expert role)."""
  if role in EXPERT_ROLES:
    return (f"layers.{layer}.mlp.experts.{expert}."
            f"{role.removeprefix('expert_')}_proj")
  group = "self_attn" if role in ("q", "k", "v", "o") else "mlp"
  return f"layers.{layer}.{group}.{role}_proj"


def parse_site(name: str) -> Optional[tuple[int, str, bool]]:
  """Return `(layer, role, is_output)` of a site (or site-output) key; an
  expert's role is `expert_<gate|up|down>`, its index `site_expert`'s."""
  m = _SITE_RE.match(name)
  if m is None:
    return None
  role = (f"expert_{m.group(5)}" if m.group(4) is not None
          else m.group(2) or m.group(3))
  return int(m.group(1)), role, m.group(6) is not None


def router_tap(layer: int) -> str:
  """Return the tap of a mixture-of-experts layer's router logits `[b, t,
  n_experts]`."""
  return f"layers.{layer}.mlp.gate.out"


def site_expert(name: str) -> Optional[int]:
  """Return the expert index of an expert site (or its output) key, None
  for any other key."""
  m = _SITE_RE.match(name)
  return None if m is None or m.group(4) is None else int(m.group(4))


def split_stacks(
  full: LayerStack, segments: Segments
) -> tuple[Optional[LayerStack], Optional[LayerStack], Optional[LayerStack]]:
  """Return the prefix, span and tail stacks of a whole-model stack.

  Meant for host arrays at load time, never inside a jitted step (I41).
  """
  out = []
  for _, lo, hi in segments.bounds():
    out.append(None if lo == hi else jax.tree.map(lambda a: a[lo:hi], full))
  return tuple(out)


def check_segments(weights: GluWeights, segments: Segments) -> None:
  """Raise ValueError unless the stored stacks have the segments' bounds."""
  for name, lo, hi in segments.bounds():
    stack = getattr(weights, name)
    n = 0 if stack is None else stack.ln1.shape[0]
    if n != hi - lo:
      raise ValueError(f"stored {name} stack holds {n} layers, but the "
                       f"segments need [{lo}, {hi}) (I41)")


def rms_norm(
  x: Float[Array, "*l d"], w: Float[Array, " d"], eps: float
) -> Float[Array, "*l d"]:
  """Return `x·rsqrt(mean(x²)+eps)·w`, the statistic in fp32 (N4)."""
  return w * attention_lib.rms_normalize(x, eps).astype(x.dtype)


def layer_norm(
  x: Float[Array, "*l d"], w: Float[Array, " d"], b: Float[Array, " d"],
  eps: float,
) -> Float[Array, "*l d"]:
  """Return `(x − mean)·rsqrt(var + eps)·w + b` (biased variance), the
  statistics in fp32 (N4)."""
  xf = x.astype(jnp.float32)
  centered = xf - jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
  return w * (centered * jax.lax.rsqrt(var + eps)).astype(x.dtype) + b


def rms_offset_norm(
  x: Float[Array, "*l d"], w: Float[Array, " d"], eps: float
) -> Float[Array, "*l d"]:
  """Return Gemma's `x·rsqrt(mean(x²)+eps)·(1 + w)`, the product taken in
  fp32 before the cast back (where Llama casts, then scales)."""
  scale = 1.0 + w.astype(jnp.float32)
  return (attention_lib.rms_normalize(x, eps) * scale).astype(x.dtype)


def norm(
  x: Float[Array, "*l d"], w: Float[Array, " d"],
  b: Optional[Float[Array, " d"]], config: glu_config.GluConfig,
) -> Float[Array, "*l d"]:
  """Return the model's norm of `x`: RMSNorm, LayerNorm with bias `b`, or
  Gemma's offset RMSNorm."""
  if config.norm == "layer":
    return layer_norm(x, w, b, config.rms_eps)
  if config.norm == "rms_offset":
    return rms_offset_norm(x, w, config.rms_eps)
  return rms_norm(x, w, config.rms_eps)


def softcap(x: Array, cap: Optional[float]) -> Array:
  """Return `cap·tanh(x/cap)` (Gemma's soft-capping), `x` for None."""
  return x if cap is None else jnp.tanh(x / cap) * cap


_ACTIVATIONS = {"silu": jax.nn.silu,
                "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
                "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


def activation(config: glu_config.GluConfig) -> Callable[[Array], Array]:
  """Return the MLP's activation `act`: of the gate in `act(gate)·up`, of
  `up` in a plain MLP's `act(up)`."""
  return _ACTIVATIONS[config.activation]


def rope_tables(
  config: glu_config.GluConfig, t: int, local: bool = False
) -> Optional[tuple[Float[Array, "t r"], Float[Array, "t r"]]]:
  """Return fp32 `cos, sin` of `pos·inv_freq` over the rotated dims,
  repeated over both halves (of the sliding-window layers' base when
  `local`); None for learned positions."""
  if config.positions != "rope":
    return None
  return attention_lib.rope_tables(
    jnp.asarray(glu_config.inv_freq(config, local)), t)


def window_mask(config: glu_config.GluConfig, t: int) -> Bool[Array, "t t"]:
  """Return a sliding-window layer's mask: query `i` sees keys `j` with
  `i − window < j <= i` (transformers' sliding-window causal mask)."""
  i = jnp.arange(t)[:, None]
  j = jnp.arange(t)[None, :]
  return attention_lib.causal_mask(t) & (j > i - config.sliding_window)


class WindowTables(NamedTuple):
  """A windowed model's per-layer choices, built once per forward: the
  RoPE tables of global and of sliding-window layers (the same where one
  base serves both; None for learned positions) and the two masks."""

  global_rope: Optional[tuple[Array, Array]]
  local_rope: Optional[tuple[Array, Array]]
  causal: Bool[Array, "t t"]
  window: Bool[Array, "t t"]


def window_tables(config: glu_config.GluConfig, t: int,
                  rope: Optional[tuple[Array, Array]] = None) -> WindowTables:
  """Return a windowed model's tables for sequences of `t` (`rope`: the
  global RoPE tables, if already built)."""
  if rope is None:
    rope = rope_tables(config, t)
  local_rope = (rope_tables(config, t, local=True)
                if rope is not None and config.local_rope_theta is not None
                else rope)
  return WindowTables(rope, local_rope, attention_lib.causal_mask(t),
                      window_mask(config, t))


def pick_layer(tables: WindowTables, local: bool | Array,
               ) -> tuple[Optional[tuple[Array, Array]], Bool[Array, "t t"]]:
  """Return one layer's RoPE tables and mask from `tables`, `local` (a
  Python or traced bool) telling whether it is a sliding-window one."""
  rope = tables.global_rope
  if rope is not None and tables.local_rope is not rope:
    rope = tuple(jnp.where(local, a, b)
                 for a, b in zip(tables.local_rope, rope))
  return rope, jnp.where(local, tables.window, tables.causal)


def layer_attention(
  config: glu_config.GluConfig, t: int, local: bool | Array,
) -> tuple[Optional[tuple[Array, Array]], Optional[Bool[Array, "t t"]]]:
  """Return the RoPE tables and the mask of a layer, `local` (a Python or
  traced bool) telling whether it is a sliding-window one. The mask is None
  (plain causal) for models without windows."""
  if not config.windowed:
    return rope_tables(config, t), None
  return pick_layer(window_tables(config, t), local)


def custom_scores(config: glu_config.GluConfig) -> bool:
  """Whether the model's attention scores differ from causal `q·k/√hd`:
  another scale, soft-capping or sliding windows (reference attention
  only)."""
  return (config.attn_scalar is not None or config.attn_softcap is not None
          or config.windowed)


def _rotate(
  x: Float[Array, "b t h hd"], rope: tuple[Array, Array], dims: int
) -> Float[Array, "b t h hd"]:
  """Return `x` with RoPE on its first `dims` dims, the rest passed through
  (GPT-NeoX's partial rotary)."""
  if dims == x.shape[-1]:
    return attention_lib.apply_rope(x, *rope)
  return jnp.concatenate(
    [attention_lib.apply_rope(x[..., :dims], *rope), x[..., dims:]], axis=-1)


def reference_attention(
  q: Float[Array, "b t nh hd"], k: Float[Array, "b t nkv hd"],
  v: Float[Array, "b t nkv hd"],
  config: Optional[glu_config.GluConfig] = None,
  mask: Optional[Bool[Array, "t t"]] = None,
) -> Float[Array, "b t nh hd"]:
  """Return causal GQA attention as plain einsums (fp32 softmax).

  kv head `j` serves query heads `j·r … j·r+r−1`, `r = nh/nkv`. With a
  `config`, its score scale and soft-cap; `mask` (a sliding window) in
  place of the causal one.
  """
  t, hd = q.shape[1], q.shape[-1]
  scale = hd ** -0.5 if config is None else config.attention_scale
  scores = attention_lib.grouped_logits(q, k) * scale
  if config is not None:
    scores = softcap(scores, config.attn_softcap)
  mask = attention_lib.causal_mask(t) if mask is None else mask
  scores = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return attention_lib.grouped_values(probs, v)


def attention_scores(
  q: Float[Array, "b t nh hd"], k: Float[Array, "b t nkv hd"],
  config: Optional[glu_config.GluConfig] = None,
  mask: Optional[Bool[Array, "t t"]] = None,
) -> Float[Array, "b nh t t"]:
  """Return fp32 causal scores `q·kᵀ/√hd`, −inf above the diagonal (with
  a `config`, its scale and soft-cap; −inf outside `mask` when given).

  Query head `h` reads kv head `h // r`, `r = nh/nkv` (as in
  `reference_attention`). Products are taken in fp32 from the forward's
  own q and k, so a bf16 forward's pattern carries no bf16 matmul rounding.
  """
  b, t, nh, hd = q.shape
  scores = attention_lib.grouped_logits(q.astype(jnp.float32),
                                        k.astype(jnp.float32))
  if config is None:
    scores = scores * (hd ** -0.5)
  else:
    scores = softcap(scores * config.attention_scale, config.attn_softcap)
  mask = attention_lib.causal_mask(t) if mask is None else mask
  scores = jnp.where(mask, scores, -jnp.inf)
  return scores.reshape(b, nh, t, t)


def attention_probs(
  q: Float[Array, "b t nh hd"], k: Float[Array, "b t nkv hd"],
  config: Optional[glu_config.GluConfig] = None,
  mask: Optional[Bool[Array, "t t"]] = None,
) -> Float[Array, "b nh t t"]:
  """Return the causal attention pattern `softmax(q·kᵀ/√hd + causal)`
  (`attention_scores`' options)."""
  return jax.nn.softmax(attention_scores(q, k, config, mask), axis=-1)


def _group_row_kl(
  q_clean: Float[Array, "b t r hd"], k_clean: Float[Array, "b t 1 hd"],
  q_masked: Float[Array, "b t r hd"], k_masked: Float[Array, "b t 1 hd"],
  config: Optional[glu_config.GluConfig], mask: Optional[Array],
) -> Float[Array, ""]:
  log_p = jax.nn.log_softmax(
    attention_scores(q_clean, k_clean, config, mask), axis=-1)
  log_q = jax.nn.log_softmax(
    attention_scores(q_masked, k_masked, config, mask), axis=-1)
  t = q_clean.shape[1]
  # Outside the mask both rows are −inf: 0·(−inf + inf) would be NaN.
  seen = attention_lib.causal_mask(t) if mask is None else mask
  return jnp.sum(jnp.where(seen, jnp.exp(log_p) * (log_p - log_q), 0.0))


def attention_kl(
  q_clean: Float[Array, "b t nh hd"], k_clean: Float[Array, "b t nkv hd"],
  q_masked: Float[Array, "b t nh hd"], k_masked: Float[Array, "b t nkv hd"],
  config: Optional[glu_config.GluConfig] = None,
  mask: Optional[Bool[Array, "t t"]] = None,
) -> Float[Array, ""]:
  """Return `mean KL(clean row ‖ masked row)` of two forwards' attention
  patterns over batch, query heads and query positions (fp32).

  Every query position's row counts; row 0 attends only to itself, so its
  KL is 0. One kv head's group of query heads at a time, so the transient
  is `[b, nh/nkv, t, t]` rather than the whole `[b, nh, t, t]`.
  """
  b, t, nh, _ = q_clean.shape
  nkv = k_clean.shape[2]
  r = nh // nkv

  def group(g):
    qs = [jax.lax.dynamic_slice_in_dim(q, g * r, r, axis=2)
          for q in (q_clean, q_masked)]
    ks = [jax.lax.dynamic_slice_in_dim(k, g, 1, axis=2)
          for k in (k_clean, k_masked)]
    return _group_row_kl(qs[0], ks[0], qs[1], ks[1], config, mask)

  total = jnp.sum(jax.lax.map(group, jnp.arange(nkv)))
  return total / (b * nh * t)


def attention_fn(impl: str) -> Callable[..., Array]:
  """Return causal attention by name: `reference` einsums, or
  `jax.nn.dot_product_attention` with implementation `xla`, `cudnn` or
  `auto` (JAX's choice)."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"unknown attention implementation {impl!r}; use one of "
                     f"{ATTENTION_IMPLS}")
  if impl == "reference":
    return reference_attention
  implementation = None if impl == "auto" else impl

  def attend(q, k, v):
    return jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation=implementation)

  return attend


# (role, x, W, per-layer extra) -> x·W or a live site's output.
SiteFn = Callable[[str, Array, Array, Any], Array]


def frozen_site(role: str, x: Array, w: Array, extra: Any) -> Array:
  """Return the frozen `x @ w` (every matmul of the clean forward)."""
  del role, extra
  return x @ w


def query_key_heads(
  q: Float[Array, "b t q"], k: Float[Array, "b t kv"],
  q_norm: Optional[Float[Array, " hd"]], k_norm: Optional[Float[Array, " hd"]],
  config: glu_config.GluConfig, rope: Optional[tuple[Array, Array]],
) -> tuple[Float[Array, "b t nh hd"], Float[Array, "b t nkv hd"]]:
  """Return a block's attention queries and keys from its q_proj and k_proj
  outputs: split into heads, QK-normed (Qwen3, Gemma 3 in its offset form)
  and rotated (SPEC §9.1; not with learned positions, `rope` None)."""
  b, t, _ = q.shape
  qh = q.reshape(b, t, config.n_heads, config.head_dim)
  kh = k.reshape(b, t, config.n_kv_heads, config.head_dim)
  if q_norm is not None:
    qh = norm(qh, q_norm, None, config)
    kh = norm(kh, k_norm, None, config)
  if rope is None:
    return qh, kh
  return (_rotate(qh, rope, config.rope_dims),
          _rotate(kh, rope, config.rope_dims))


def block(
  h: Float[Array, "b t d"],
  lw: LayerStack,
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

  xa = norm(h, lw.ln1, lw.ln1_bias, config)
  q, k, v = project("q", xa), project("k", xa), project("v", xa)
  qh, kh = query_key_heads(q, k, lw.q_norm, lw.k_norm, config, rope)
  vh = v.reshape(b, t, config.n_kv_heads, config.head_dim)
  options = ({"config": config, "mask": mask} if custom_scores(config)
             else {})
  o_in = attend(qh, kh, vh, **options).reshape(b, t, config.q_width)
  o = project("o", o_in)
  h1 = h + post_norm(o, lw.post_attn_norm, config)
  # A parallel block's MLP reads the block input, not h + attention.
  xm = norm(h if config.parallel_residual else h1, lw.ln2, lw.ln2_bias,
            config)
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
    out["attn"] = attention_probs(*query_key_heads(
      q_own, k_own, lw.q_norm, lw.k_norm, config, rope), config, mask)
  return h1 + post_norm(down, lw.post_mlp_norm, config), out


def _stream_value(values: dict[str, Array], stream: str) -> Array:
  """Return a stream's value; `<stream>@<e>` is expert `e`'s slice of an
  expert stream stacked `[b, expert, t, ...]`."""
  base, _, expert = stream.partition("@")
  return values[base][:, int(expert)] if expert else values[base]


def _mlp(
  xm: Float[Array, "b t d"], lw: LayerStack,
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
    act = activation(config)(gate) * up
    values.update({"gate": xm, "gate.out": gate})
  else:
    up = project("up", xm)
    act = activation(config)(up)
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
  xm: Float[Array, "b t d"], lw: LayerStack, config: glu_config.GluConfig,
  site: Callable[[str, Array], Array],
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


def post_norm(
  y: Float[Array, "b t d"], w: Optional[Float[Array, " d"]],
  config: glu_config.GluConfig,
) -> Float[Array, "b t d"]:
  """Return a sublayer's output as the residual adds it: through its
  sandwich norm where the model has one."""
  return y if w is None else norm(y, w, None, config)


def parse_tap(key: str, n_layers: int) -> tuple[str, int]:
  """Return `(stream, layer)` of a tap key; ValueError if unknown."""
  m = _RESID_RE.match(key)
  if m is not None and int(m.group(1)) <= n_layers:
    return "resid", int(m.group(1))
  m = _ATTN_RE.match(key)
  if m is not None and int(m.group(1)) < n_layers:
    return "attn", int(m.group(1))
  parsed = parse_site(key)
  if parsed is not None and parsed[0] < n_layers:
    layer, role, is_out = parsed
    stream = f"{role}.out" if is_out else role
    if role in ("expert_gate", "expert_up") and not is_out:
      return "moe", layer  # every expert's gate and up read the block input
    if role in EXPERT_ROLES:
      stream += f"@{site_expert(key)}"
    return stream, layer
  m = _MOE_TAP_RE.match(key)
  if m is not None and int(m.group(1)) < n_layers:
    stream = "router" if m.group(2) else "moe"
    return stream + (m.group(3) or ""), int(m.group(1))
  raise ValueError(f"unknown tap key {key!r}; known: resid.0..resid."
                   f"{n_layers}, layers.<i>.self_attn.{{q,k,v,o}}_proj, "
                   "layers.<i>.mlp.{gate,up,down}_proj, each optionally "
                   "with .out, attn.<i>, and in a mixture-of-experts model "
                   "layers.<i>.mlp, layers.<i>.mlp.gate and "
                   "layers.<i>.mlp.experts.<e>.{gate,up,down}_proj, each "
                   "optionally with .out")


@dataclasses.dataclass(frozen=True)
class ForwardSpec:
  """Static settings of a forward: model, segments, attention, remat.

  `unroll` is `lax.scan`'s: unrolling small models is twice as fast on CPU
  (toy training), scanning keeps compile time flat for deep ones.
  """

  config: glu_config.GluConfig
  segments: Segments
  attention: str = "reference"
  remat: bool = True
  unroll: int | bool = 1

  def __post_init__(self):
    if self.attention != "reference" and custom_scores(self.config):
      raise ValueError(
        f"attention {self.attention!r} computes plain causal softmax(q·k/"
        f"√hd); this {self.config.family} model's scores need its own "
        "scale, soft-cap or sliding windows: use --attention=reference")


def _run_segment(
  h: Array, stack: LayerStack, extra: Any, lo: int, hi: int,
  site: SiteFn, streams: tuple[str, ...], spec: ForwardSpec,
  rope: Optional[tuple[Array, Array]], remat: bool,
  emit_layers: tuple[int, ...] = (),
) -> tuple[Array, dict[str, Array]]:
  """Run layers `[lo, hi)`; `ys` stacks `streams` of layers `lo` up to the
  deepest of `emit_layers` (all layers when it is empty)."""
  if stack.ln1.shape[0] != hi - lo:
    raise ValueError(f"stack of {stack.ln1.shape[0]} layers does not match "
                     f"segment [{lo}, {hi}) (I41)")
  attend = attention_fn(spec.attention)
  config = spec.config
  # Which layers attend through a window: a flag per layer, scanned beside
  # the weights (models without windows scan none).
  local = (jnp.asarray([i in config.local_layers for i in range(lo, hi)])
           if config.windowed else None)
  # Built once for the scan; each layer picks its own.
  tables = (window_tables(config, h.shape[1], rope) if config.windowed
            else None)

  def body(carry, xs):
    lw, ex, is_local = xs
    layer_rope, mask = ((rope, None) if is_local is None else
                        pick_layer(tables, is_local))
    return block(carry, lw, lambda r, x, w: site(r, x, w, ex), config,
                 layer_rope, attend, streams, mask)

  if remat:
    body = jax.checkpoint(body)
  last = max(emit_layers, default=hi - 1)
  if extra is not None or last == hi - 1:
    return jax.lax.scan(body, h, (stack, extra, local), unroll=spec.unroll)
  # Taps stop below the segment's end (SPEC §3.4): the layers above run the
  # same body emitting nothing. Both scans index the one stored stack, so no
  # sub-range of it is copied (I41). Only for forwards without live factors,
  # whose slices are never differentiated.
  def indexed(carry, i):
    return body(carry, jax.tree.map(
      lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False),
      (stack, None, local)))

  def quiet(carry, i):
    return indexed(carry, i)[0], None

  emitting = last + 1 - lo
  h, ys = jax.lax.scan(indexed, h, jnp.arange(emitting), unroll=spec.unroll)
  h, _ = jax.lax.scan(quiet, h, jnp.arange(emitting, hi - lo),
                      unroll=spec.unroll)
  return h, ys


def _parsed_taps(wanted: tuple[str, ...], config: glu_config.GluConfig,
                 first: int) -> dict[str, tuple[str, int]]:
  """Return each wanted tap's `(stream, layer)`; ValueError for one below
  the residual start at block `first` (I28) or of a role the model lacks."""
  parsed = {key: parse_tap(key, config.n_layers) for key in wanted}
  roles = model_roles(config)
  absent = [k for k, (s, _) in parsed.items()
            if s.removesuffix(".out") in ROLES
            and s.removesuffix(".out") not in roles]
  if absent:
    raise ValueError(f"taps {absent} name a projection this model lacks; "
                     f"its roles are {roles}")
  dense = [k for k, (s, _) in parsed.items()
           if (s in MOE_STREAMS or "@" in s) and not config.moe]
  if dense:
    raise ValueError(f"taps {dense} name a mixture-of-experts block; this "
                     "model's MLPs are dense")
  beyond = [k for k in parsed if (site_expert(k) or 0) >= config.n_experts
            > 0]
  if beyond:
    raise ValueError(f"taps {beyond} name an expert beyond the model's "
                     f"{config.n_experts}")
  below = [k for k, (_, layer) in parsed.items() if layer < first]
  if below:
    raise ValueError(f"taps {below} lie below the residual start at block "
                     f"{first} (I28)")
  return parsed


def _gathered_taps(
  parsed: dict[str, tuple[str, int]], boundary: dict[int, Array],
  stream_values: dict[tuple[int, int], dict[str, Array]],
) -> dict[str, Array]:
  """Return each parsed tap: a residual at a segment boundary as it is,
  any other stream from its segment's stacked scan outputs."""
  taps = {}
  for key, (stream, layer) in parsed.items():
    if stream == "resid" and layer in boundary:
      taps[key] = boundary[layer]
      continue
    for (lo, hi), ys in stream_values.items():
      if lo <= layer < hi:
        taps[key] = ys[stream][layer - lo]
  return taps


def head_matrix(weights: GluWeights) -> Float[Array, "vocab d"]:
  """Return the output head, the embedding when tied."""
  return weights.embed if weights.head is None else weights.head


def head_logits(
  weights: GluWeights, x: Float[Array, "*l d"]
) -> Float[Array, "*l vocab"]:
  """Return the logits of final hidden states `x` (after the final norm)."""
  return jnp.einsum("...d,vd->...v", x, head_matrix(weights))


# A live embedding `(table [vocab, d], tokens) -> [b, t, d]` and a live
# head `(x [b, t, d], head [vocab, d]) -> logits`, each in place of the
# frozen lookup or product.
EmbedFn = Callable[[Array, Array], Array]
HeadFn = Callable[[Array, Array], Array]


def forward(
  weights: GluWeights,
  tokens: Int[Array, "b t"],
  wanted: tuple[str, ...],
  spec: ForwardSpec,
  span_site: SiteFn = frozen_site,
  span_extra: Any = None,
  start: Optional[Float[Array, "b t d"]] = None,
  embed_fn: Optional[EmbedFn] = None,
  head_fn: Optional[HeadFn] = None,
) -> tuple[Float[Array, "b t vocab"], dict[str, Array]]:
  """Return logits and the `wanted` taps of one forward.

  `span_site` runs the span's matmuls (scanning `span_extra` beside the
  span weights); prefix and tail are always frozen. `start` is a residual
  start at block `split` (SPEC §3.5): the prefix is not run, a tap below
  `split` fails and `resid.{split}` is the start value (I28). `embed_fn`
  and `head_fn`, where given, are the live embedding and head sites.
  """
  logits_tap = f"{HEAD_SITE}.out"
  x, taps = final_hidden(weights, tokens,
                         tuple(k for k in wanted if k != logits_tap), spec,
                         span_site, span_extra, start, embed_fn)
  logits = (head_logits(weights, x) if head_fn is None
            else head_fn(x, head_matrix(weights)))
  if logits_tap in wanted:
    # The head module's output, before any final soft-cap (Gemma 2).
    taps[logits_tap] = logits
  return softcap(logits, spec.config.final_softcap), taps


def final_hidden(
  weights: GluWeights,
  tokens: Int[Array, "b t"],
  wanted: tuple[str, ...],
  spec: ForwardSpec,
  span_site: SiteFn = frozen_site,
  span_extra: Any = None,
  start: Optional[Float[Array, "b t d"]] = None,
  embed_fn: Optional[EmbedFn] = None,
) -> tuple[Float[Array, "b t d"], dict[str, Array]]:
  """Return `forward`'s final hidden state (after the final norm, what the
  head reads) and its `wanted` taps."""
  config, seg = spec.config, spec.segments
  check_segments(weights, seg)
  first = 0 if start is None else seg.split
  parsed = _parsed_taps(tuple(k for k in wanted if k not in END_TAPS),
                        config, first)
  rope = rope_tables(config, tokens.shape[1])
  boundary = {}
  rows = None
  if start is None:
    h = rows = (jnp.take(weights.embed, tokens, axis=0) if embed_fn is None
                else embed_fn(weights.embed, tokens))
    if config.embed_scale:
      # √d rounded to fp32, then to the weights' dtype, as Gemma's.
      h = h * jnp.asarray(np.float32(config.d_model ** 0.5), h.dtype)
    if weights.pos is not None:
      h = h + weights.pos[:tokens.shape[1]]
  else:
    h = start
  boundary[first] = h
  stream_values = {}
  for name, lo, hi in seg.bounds():
    stack = getattr(weights, name)
    if hi <= first:
      continue
    if stack is None:
      boundary[hi] = h
      continue
    emitted = {(s, layer) for s, layer in parsed.values()
               if lo <= layer < hi and not (s == "resid" and layer == lo)}
    streams = tuple(sorted({s for s, _ in emitted}))
    is_span = name == "span"
    # A masked forward differentiates the span and, through its carry, the
    # frozen tail: without remat each tail layer's attention scores and MLP
    # activations would stay stacked until the backward. The prefix never
    # sees a live site, so it has nothing to keep.
    h, ys = _run_segment(
      h, stack, span_extra if is_span else None, lo, hi,
      span_site if is_span else frozen_site, streams, spec, rope,
      spec.remat and name != "prefix" and span_extra is not None,
      tuple(layer for _, layer in emitted))
    boundary[hi] = h
    stream_values[(lo, hi)] = ys
  taps = _gathered_taps(parsed, boundary, stream_values)
  x = norm(h, weights.norm, weights.norm_bias, config)
  taps.update(_end_taps(weights, tokens, x, rows, wanted))
  return x, taps


def _end_taps(
  weights: GluWeights, tokens: Int[Array, "b t"], x: Float[Array, "b t d"],
  rows: Optional[Float[Array, "b t d"]], wanted: tuple[str, ...],
) -> dict[str, Array]:
  """Return the wanted taps of the embedding and the head (`END_TAPS`):
  `rows` the embedding's output (None from a residual start, which skips
  it, I28), the logits the frozen head's (`forward` taps its own)."""
  out = {}
  for key in (k for k in wanted if k in END_TAPS):
    if key == EMBED_SITE:
      out[key] = tokens
    elif key == HEAD_SITE:
      out[key] = x
    elif key == f"{HEAD_SITE}.out":
      out[key] = head_logits(weights, x)
    elif rows is None:
      raise ValueError(f"tap {key} lies below the residual start (I28)")
    else:
      out[key] = rows
  return out


def all_tap_keys(config: glu_config.GluConfig) -> tuple[str, ...]:
  """Return every tap key of a model, in layer order."""
  keys = [f"resid.{i}" for i in range(config.n_layers + 1)]
  for i in range(config.n_layers):
    for role in model_roles(config):
      for e in range(config.n_experts) if role in EXPERT_ROLES else (None,):
        keys += [site_name(i, role, e), f"{site_name(i, role, e)}.out"]
    if config.moe:
      keys += [f"layers.{i}.mlp{s}" for s in ("", ".gate", ".gate.out",
                                              ".out")]
    keys.append(f"attn.{i}")
  return tuple(keys)


def init_stack(
  key: jax.Array, config: glu_config.GluConfig, n: int,
  dtype: Any = jnp.float32,
) -> LayerStack:
  """Return `n` random layers: matrices `N(0, 1/d_in)`, norms near 1,
  biases (of models with them) `N(0, 0.1²)`."""
  d, f, hd = config.d_model, config.d_ff, config.head_dim
  shapes = {"q": (d, config.q_width), "k": (d, config.kv_width),
            "v": (d, config.kv_width), "o": (config.q_width, d),
            "gate": (d, f), "up": (d, f), "down": (f, d)}
  keys = dict(zip([*shapes, "ln1", "ln2", "q_norm", "k_norm"],
                  jax.random.split(key, len(shapes) + 4)))
  mats = {r: jax.random.normal(keys[r], (n, *s), jnp.float32) / np.sqrt(s[0])
          for r, s in shapes.items() if r in model_roles(config)}

  def near_one(name, width):
    return 1.0 + 0.1 * jax.random.normal(keys[name], (n, width), jnp.float32)

  leaves = {"ln1": near_one("ln1", d), "ln2": near_one("ln2", d), **mats}
  if config.qk_norm:
    leaves.update(q_norm=near_one("q_norm", hd), k_norm=near_one("k_norm", hd))
  # Drawn from a key of their own, so models without them draw as before.
  widths = {f"{r}_bias": shapes[r][1] for r in mats} if config.bias else {}
  if config.norm == "layer":
    widths.update(ln1_bias=d, ln2_bias=d)
  bias_keys = jax.random.split(jax.random.fold_in(key, 1), len(widths) or 1)
  for k, (name, width) in zip(bias_keys, sorted(widths.items())):
    leaves[name] = 0.1 * jax.random.normal(k, (n, width), jnp.float32)
  if config.sandwich:
    post = jax.random.split(jax.random.fold_in(key, 2))
    for k, name in zip(post, ("post_attn_norm", "post_mlp_norm")):
      leaves[name] = 1.0 + 0.1 * jax.random.normal(k, (n, d), jnp.float32)
  if config.moe:
    e = config.n_experts
    moe_shapes = {"router": (d, e), "expert_gate": (e, d, f),
                  "expert_up": (e, d, f), "expert_down": (e, f, d)}
    moe_keys = jax.random.split(jax.random.fold_in(key, 3), len(moe_shapes))
    for k, (name, shape) in zip(moe_keys, moe_shapes.items()):
      leaves[name] = (jax.random.normal(k, (n, *shape), jnp.float32)
                      / np.sqrt(shape[-2]))
  return jax.tree.map(lambda a: a.astype(dtype), layer_stack(**leaves))
