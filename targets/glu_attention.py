"""A decoder block's attention: rotary tables, sliding-window masks, the
implementations a forward may choose (`attention_fn`), the reference
attention with a family's own scale and soft-cap, and the fp32 pattern
and its KL divergence that the attention taps and losses read.

Heads are `[b, t, heads, head_dim]`. Which layers attend through a window
is a per-layer flag scanned beside the weights (`WindowTables`), so one
scan runs both kinds. `attention_probs` is the exact softmax of a block's
own queries and keys whatever implementation the block runs.
"""

from collections.abc import Callable
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from decompax.core import attention as attention_lib
from decompax.targets import glu_config, glu_norms


ATTENTION_IMPLS = ("reference", "xla", "cudnn", "auto")


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
    scores = glu_norms.softcap(scores, config.attn_softcap)
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
    scores = glu_norms.softcap(scores * config.attention_scale,
                               config.attn_softcap)
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
    qh = glu_norms.norm(qh, q_norm, None, config)
    kh = glu_norms.norm(kh, k_norm, None, config)
  if rope is None:
    return qh, kh
  return (_rotate(qh, rope, config.rope_dims),
          _rotate(kh, rope, config.rope_dims))
