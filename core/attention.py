"""Attention primitives shared by the CI transformer (`core.ci_transformer`)
and the GLU language model (`targets.glu_lm`): RMS normalisation, rotate-half
RoPE and grouped-query attention's head grouping (SPEC §9.1).

Each is written once here, in one operation order, so both models compute
them alike. What differs between the two stays with each model: the norm's
weight and epsilon, RoPE's frequencies (the LM's may be scaled), the
causal mask and how logits are scaled (the CI transformer divides by
`√hd`, the LM multiplies by `hd^−½`: not the same rounding).
"""

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float


def rms_normalize(x: Float[Array, "*s d"], eps: float
                  ) -> Float[Array, "*s d"]:
  """Return `x·rsqrt(mean(x²) + eps)` over the last axis, in fp32 (N4)."""
  xf = x.astype(jnp.float32)
  var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
  return xf * lax.rsqrt(var + eps)


def rope_tables(
  inv_freq: Float[Array, " half"], t: int
) -> tuple[Float[Array, "t hd"], Float[Array, "t hd"]]:
  """Return fp32 `cos, sin` of `pos·inv_freq` at positions `0..t−1`,
  repeated over both halves of a head."""
  freqs = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(
  x: Float[Array, "b t h hd"], cos: Float[Array, "t hd"],
  sin: Float[Array, "t hd"], split: bool = False,
) -> Float[Array, "b t h hd"]:
  """Return `x·cos + rot(x)·sin`, `rot(x) = [−x₂, x₁]` (rotate-half), the
  tables cast to `x`'s dtype.

  The halves are sliced (the LM's form, as Hugging Face writes it) or, with
  `split`, taken by `jnp.split` (the CI transformer's). Both give the same
  values; their backward passes compile differently and round apart in the
  last bit, so each model keeps the form its runs have always used.
  """
  cos = cos.astype(x.dtype)[:, None, :]
  sin = sin.astype(x.dtype)[:, None, :]
  if split:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


def grouped_logits(
  q: Float[Array, "b t nh hd"], k: Float[Array, "b s nkv hd"]
) -> Float[Array, "b nkv r t s"]:
  """Return the unscaled `q·kᵀ` of every query head against its kv head:
  kv head `j` serves query heads `j·r … j·r+r−1`, `r = nh/nkv`."""
  b, t, nh, hd = q.shape
  nkv = k.shape[2]
  groups = q.reshape(b, t, nkv, nh // nkv, hd)
  return jnp.einsum("btgrh,bsgh->bgrts", groups, k)


def grouped_values(
  probs: Float[Array, "b nkv r t s"], v: Float[Array, "b s nkv hd"]
) -> Float[Array, "b t nh hd"]:
  """Return the attention output `probs·v`, query heads grouped as in
  `grouped_logits`."""
  b, nkv, r, t, _ = probs.shape
  out = jnp.einsum("bgrts,bsgh->btgrh", probs, v)
  return out.reshape(b, t, nkv * r, v.shape[-1])


def causal_mask(t: int) -> Bool[Array, "t t"]:
  """Return `mask[i, j] = j <= i`: a query sees itself and the past."""
  return jnp.tril(jnp.ones((t, t), bool))
