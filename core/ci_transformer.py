"""Chunkwise transformer causal-importance function (SPEC §4.3).

Sites are partitioned into chunks; each chunk reads some taps `[*b, t, d_tap]`
and emits the CI pre-activations of its output sites, `[*b, t, C_s]`. Every
chunk is an independent bidirectional pre-norm RoPE transformer:

  u = concat_k rms(x_k);  h = u @ w_in + b_in
  repeat n_blocks:  h += attn(rms(h));  h += gelu(rms(h) @ w1 + b1) @ w2 + b2
  pre = h @ w_out + b_out, split into the chunk's sites by their C

`rms` is weightless (eps 2^-23, fp32). Chunks must be homogeneous (equal
concatenated tap width, equal per-slot C tuple), so their parameters stack on
a leading `chunk` axis and all chunks run under one `jax.vmap`; blocks stack
on a `block` axis inside a chunk and run under `lax.scan`. RoPE inverse
frequencies are derived from the config, never stored in the parameters, so
no optimizer can see or change them (I8).
"""

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Key

from decompax.core import attention as attention_lib
from decompax.core.sites import SiteSpec

RMS_EPS = 2.0**-23
ROPE_BASE = 10000.0
# "reference" is plain einsum-softmax attention that lowers anywhere; the
# others are `jax.nn.dot_product_attention` with that `implementation`
# ("auto" passes None and lets JAX choose).
ATTENTION_IMPLS = ("reference", "xla", "cudnn", "auto")


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One chunk: the taps it reads (concatenated in order), its sites."""

  input_taps: tuple[str, ...]
  output_sites: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TransformerCIConfig:
  """Sizes of the chunk transformers and the site-to-chunk assignment.

  `chunks` empty means one chunk per site reading that site's own input.
  `tap_widths` names the width of every tap that is not a site input (a site
  name's tap is that site's `d_in`). `n_kv_heads` None means multi-head
  attention. `remat` keeps only each block's input and recomputes the block
  in the backward pass (one block's activations live at a time) instead of
  keeping the matmul outputs.
  """

  chunks: tuple[Chunk, ...] = ()
  tap_widths: tuple[tuple[str, int], ...] = ()
  d_model: int = 64
  n_blocks: int = 2
  n_heads: int = 4
  n_kv_heads: int | None = None
  d_mlp: int = 256
  attention: str = "reference"  # one of ATTENTION_IMPLS
  remat: bool = False

  def __post_init__(self):
    if self.attention not in ATTENTION_IMPLS:
      raise ValueError(f"unknown CI attention {self.attention!r};"
                       f" use one of {ATTENTION_IMPLS}")
    for name, value in (("d_model", self.d_model), ("n_heads", self.n_heads),
                        ("d_mlp", self.d_mlp), ("n_kv_heads", self.kv_heads)):
      if value <= 0:
        raise ValueError(f"CI transformer {name} must be positive, got {value}")
    if self.n_blocks < 0:
      raise ValueError(f"CI transformer n_blocks must be >= 0,"
                       f" got {self.n_blocks}")
    if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
      raise ValueError(
        f"CI transformer d_model {self.d_model} / n_heads {self.n_heads}"
        " must be an even integer head dim (RoPE rotates pairs)")
    if self.n_heads % self.kv_heads:
      raise ValueError(f"CI transformer n_heads {self.n_heads} must be a"
                       f" multiple of n_kv_heads {self.kv_heads}")

  @property
  def kv_heads(self) -> int:
    return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


class Blocks(NamedTuple):
  """The transformer blocks of one chunk, stacked on a leading `block` axis."""

  wq: Float[Array, "block d_model q"]
  wk: Float[Array, "block d_model kv"]
  wv: Float[Array, "block d_model kv"]
  wo: Float[Array, "block q d_model"]
  w1: Float[Array, "block d_model d_mlp"]
  b1: Float[Array, "block d_mlp"]
  w2: Float[Array, "block d_mlp d_model"]
  b2: Float[Array, "block d_model"]


class ChunkParams(NamedTuple):
  """One chunk's transformer; `apply` sees every leaf with a `chunk` axis."""

  w_in: Float[Array, "d_u d_model"]
  b_in: Float[Array, " d_model"]
  blocks: Blocks
  w_out: Float[Array, "d_model c_sum"]
  b_out: Float[Array, " c_sum"]


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
  """Resolved chunks: every tap read, the per-slot C and the input width."""

  chunks: tuple[Chunk, ...]
  taps: tuple[str, ...]
  c_slots: tuple[int, ...]
  d_u: int


def chunks_by_tap(
  sites: tuple[SiteSpec, ...], tap_of: Callable[[SiteSpec], str]
) -> tuple[Chunk, ...]:
  """Return one chunk per distinct `tap_of(site)`, sites in canonical order.

  For an LM, `tap_of = lambda s: f"resid.{layer of s}"` gives the production
  layout: one chunk per decomposed block reading that block's residual.
  """
  groups: dict[str, list[str]] = {}
  for site in sites:
    groups.setdefault(tap_of(site), []).append(site.name)
  return tuple(Chunk((tap,), tuple(names)) for tap, names in groups.items())


def plan_chunks(
  config: TransformerCIConfig, sites: tuple[SiteSpec, ...]
) -> ChunkPlan:
  """Resolve and check the chunks of `config` over `sites` (I7).

  Raises:
    ValueError: chunks do not partition the sites, a tap width is unknown,
      or chunks differ in concatenated width or per-slot C.
  """
  by_name = {s.name: s for s in sites}
  chunks = config.chunks or chunks_by_tap(sites, lambda s: s.name)
  emitted = [name for chunk in chunks for name in chunk.output_sites]
  unknown = sorted(set(emitted) - set(by_name))
  repeated = sorted({n for n in emitted if emitted.count(n) > 1})
  missing = [s.name for s in sites if s.name not in emitted]
  if unknown or repeated or missing:
    raise ValueError(
      "CI chunks must partition the sites: unknown "
      f"{unknown}, in two chunks {repeated}, in no chunk {missing}")
  if any(not chunk.input_taps or not chunk.output_sites for chunk in chunks):
    raise ValueError("every CI chunk needs at least one input tap and site")
  widths = {s.name: s.d_in for s in sites} | dict(config.tap_widths)
  taps = dict.fromkeys(t for chunk in chunks for t in chunk.input_taps)
  no_width = [t for t in taps if t not in widths]
  if no_width:
    raise ValueError(f"CI taps {no_width} have no width; give tap_widths")
  shapes = [(sum(widths[t] for t in chunk.input_taps),
             tuple(by_name[n].c for n in chunk.output_sites))
            for chunk in chunks]
  for chunk, shape in zip(chunks, shapes):
    if shape != shapes[0]:
      raise ValueError(
        f"CI chunks must be homogeneous: chunk {chunk.output_sites} has"
        f" (input width, C per slot) {shape}, but {chunks[0].output_sites}"
        f" has {shapes[0]}; group sites so every chunk matches")
  return ChunkPlan(tuple(chunks), tuple(taps), shapes[0][1], shapes[0][0])


def rope_inv_freq(head_dim: int) -> Float[Array, " half"]:
  """Return `10000^(−2i/hd)`: a constant of the config, never a parameter."""
  i = jnp.arange(head_dim // 2, dtype=jnp.float32)
  return ROPE_BASE ** (-2.0 * i / head_dim)


def rms(x: Float[Array, "*s d"]) -> Float[Array, "*s d"]:
  """Return weightless RMS normalisation over the last axis, in fp32."""
  return attention_lib.rms_normalize(x, RMS_EPS)


def reference_attention(
  q: Float[Array, "b t heads hd"],
  k: Float[Array, "b t kv hd"],
  v: Float[Array, "b t kv hd"],
) -> Float[Array, "b t heads hd"]:
  """Return bidirectional softmax attention; kv head j serves query heads
  `j·r .. j·r + r − 1`."""
  logits = attention_lib.grouped_logits(q, k) / math.sqrt(q.shape[-1])
  weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  return attention_lib.grouped_values(weights.astype(v.dtype), v)


def attention(
  q: Float[Array, "b t heads hd"],
  k: Float[Array, "b t kv hd"],
  v: Float[Array, "b t kv hd"],
  impl: str,
) -> Float[Array, "b t heads hd"]:
  """Return bidirectional attention computed by implementation `impl`."""
  if impl == "reference":
    return reference_attention(q, k, v)
  dtype = q.dtype
  if impl == "cudnn":
    # cuDNN's fused attention takes only half precision.
    q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
  out = jax.nn.dot_product_attention(
    q, k, v, implementation=None if impl == "auto" else impl)
  return out.astype(dtype)


def _uniform(key, shape, bound: float) -> Array:
  return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def _normal(key, shape, fan_in: int, gain: float) -> Array:
  return jax.random.normal(key, shape, jnp.float32) * (gain / math.sqrt(fan_in))


def _init_block(key: Key[Array, ""], config: TransformerCIConfig) -> Blocks:
  d, d_mlp = config.d_model, config.d_mlp
  d_q = config.n_heads * config.head_dim
  d_kv = config.kv_heads * config.head_dim
  kq, kk, kv, ko, k1, k2 = jax.random.split(key, 6)
  bound = 1 / math.sqrt(d)
  return Blocks(
    wq=_uniform(kq, (d, d_q), bound), wk=_uniform(kk, (d, d_kv), bound),
    wv=_uniform(kv, (d, d_kv), bound), wo=_uniform(ko, (d_q, d), bound),
    w1=_normal(k1, (d, d_mlp), d, math.sqrt(2.0)), b1=jnp.zeros((d_mlp,)),
    w2=_normal(k2, (d_mlp, d), d_mlp, 1.0), b2=jnp.zeros((d,)))


def init_chunk(
  key: Key[Array, ""], config: TransformerCIConfig, d_u: int, c_sum: int
) -> ChunkParams:
  """Return one chunk's parameters (SPEC §4.3 init)."""
  k_in, k_out, *k_blocks = jax.random.split(key, 2 + config.n_blocks)
  d = config.d_model
  if k_blocks:
    blocks = jax.vmap(lambda k: _init_block(k, config))(jnp.stack(k_blocks))
  else:
    template = jax.eval_shape(lambda: _init_block(k_in, config))
    blocks = jax.tree.map(lambda s: jnp.zeros((0, *s.shape), s.dtype),
                          template)
  return ChunkParams(
    w_in=_normal(k_in, (d_u, d), d_u, math.sqrt(2.0)), b_in=jnp.zeros((d,)),
    blocks=blocks, w_out=_normal(k_out, (d, c_sum), d, 1.0),
    b_out=jnp.zeros((c_sum,)))


def init_params(
  key: Key[Array, ""], config: TransformerCIConfig, plan: ChunkPlan
) -> ChunkParams:
  """Return every chunk's parameters stacked on a leading `chunk` axis.

  Chunk `i` initialises from `fold_in(key, i)`.
  """
  keys = jnp.stack(
    [jax.random.fold_in(key, i) for i in range(len(plan.chunks))])
  return jax.vmap(
    lambda k: init_chunk(k, config, plan.d_u, sum(plan.c_slots)))(keys)


def _block(
  h: Float[Array, "b t d_model"],
  p: Blocks,
  config: TransformerCIConfig,
  inv_freq: Float[Array, " half"],
) -> Float[Array, "b t d_model"]:
  b, t, _ = h.shape
  hd = config.head_dim
  x = rms(h).astype(h.dtype)
  q = attention_lib.apply_rope(
    (x @ p.wq).reshape(b, t, config.n_heads, hd),
    *attention_lib.rope_tables(inv_freq, t), split=True)
  k = attention_lib.apply_rope(
    (x @ p.wk).reshape(b, t, config.kv_heads, hd),
    *attention_lib.rope_tables(inv_freq, t), split=True)
  v = (x @ p.wv).reshape(b, t, config.kv_heads, hd)
  o = attention(q, k, v, config.attention).reshape(b, t, -1)
  h = h + o @ p.wo
  # N3: the nonlinearity in fp32 whatever the compute dtype.
  pre = (rms(h).astype(h.dtype) @ p.w1 + p.b1).astype(jnp.float32)
  hidden = jax.nn.gelu(pre, approximate=False).astype(h.dtype)
  return h + hidden @ p.w2 + p.b2


def chunk_trunk(
  params: ChunkParams,
  u: Float[Array, "b t d_u"],
  config: TransformerCIConfig,
  inv_freq: Float[Array, " half"],
) -> Float[Array, "b t d_model"]:
  """Return one chunk's final hidden states from its normalised taps `u`,
  computed in the parameters' dtype (N4: bf16 for LMs; `rms` statistics
  stay fp32)."""
  h = u.astype(params.w_in.dtype) @ params.w_in + params.b_in

  def body(h, block):
    return _block(h, block, config, inv_freq), None

  if config.remat:
    # Only the block inputs are kept; the backward recomputes one block at a
    # time instead of stacking every block's attention and MLP activations.
    body = jax.checkpoint(body)
  h, _ = lax.scan(body, h, params.blocks)
  return h


def chunk_inputs(
  plan: ChunkPlan, taps: dict[str, Float[Array, "..."]]
) -> Float[Array, "chunk n t d_u"]:
  """Return `concat_k rms(x_k)` for every chunk, stacked, batch flattened."""
  normed = {name: rms(taps[name]) for name in plan.taps}
  per_chunk = [
    jnp.concatenate([normed[t] for t in chunk.input_taps], axis=-1)
    for chunk in plan.chunks]
  u = jnp.stack(per_chunk)
  return u.reshape(u.shape[0], -1, *u.shape[-2:])


class Heads(NamedTuple):
  """A second readout of every chunk, stacked on the `chunk` axis."""

  w: Float[Array, "chunk d_model c_sum"]
  b: Float[Array, "chunk c_sum"]


def init_heads(
  key: Key[Array, ""], config: TransformerCIConfig, plan: ChunkPlan
) -> Heads:
  """Return a readout per chunk drawn as `init_chunk` draws `w_out`."""
  keys = jnp.stack(
    [jax.random.fold_in(key, i) for i in range(len(plan.chunks))])
  c_sum, d = sum(plan.c_slots), config.d_model
  return Heads(jax.vmap(lambda k: _normal(k, (d, c_sum), d, 1.0))(keys),
               jnp.zeros((len(plan.chunks), c_sum)))


def trunk(
  params: ChunkParams,
  taps: dict[str, Float[Array, "..."]],
  config: TransformerCIConfig,
  plan: ChunkPlan,
) -> Float[Array, "chunk n t d_model"]:
  """Return every chunk's final hidden states from its taps."""
  inv_freq = lax.stop_gradient(rope_inv_freq(config.head_dim))

  def forward(p, u):
    return chunk_trunk(p, u, config, inv_freq)

  if not config.remat:
    forward = jax.checkpoint(
      forward, policy=jax.checkpoint_policies.dots_saveable)
  return jax.vmap(forward)(params, chunk_inputs(plan, taps))


def readout(
  w: Float[Array, "chunk d_model c_sum"],
  b: Float[Array, "chunk c_sum"],
  h: Float[Array, "chunk n t d_model"],
  taps: dict[str, Float[Array, "..."]],
  plan: ChunkPlan,
) -> dict[str, Float[Array, "..."]]:
  """Return every site's pre-activations from the chunks' hidden states
  through the readout `(w, b)`."""
  lead = taps[plan.chunks[0].input_taps[0]].shape[:-1]
  pre = jnp.einsum("kntd,kdc->kntc", h, w) + b[:, None, None, :]
  bounds = list(itertools.accumulate(plan.c_slots))[:-1]
  out = {}
  for chunk, chunk_pre in zip(plan.chunks, pre):
    parts = jnp.split(chunk_pre, bounds, axis=-1)
    for name, part in zip(chunk.output_sites, parts):
      out[name] = part.reshape(*lead, part.shape[-1])
  return out


def apply(
  params: ChunkParams,
  taps: dict[str, Float[Array, "..."]],
  config: TransformerCIConfig,
  plan: ChunkPlan,
) -> dict[str, Float[Array, "..."]]:
  """Return every site's CI pre-activations from its chunk's taps."""
  return readout(params.w_out, params.b_out,
                 trunk(params, taps, config, plan), taps, plan)
