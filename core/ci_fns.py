"""MLP causal-importance functions for toy targets (SPEC §4.2).

Every CI function maps clean taps (the key of a site's name is that site's
input `[*L, d_in]`) to per-site pre-activations `[*L, C_s]`. Hidden
activations are exact-erf GELU; weights are `N(0,1)·gain/√fan_in` with gain
`√2` into a hidden layer and `1` into the output; biases start at zero. Site
`i` (canonical order) initialises from `fold_in(key, i)`. `make_ci_fn` also
builds the LM chunkwise transformer of `ci_transformer` (SPEC §4.3).
"""

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Key

from decompax.core import ci_transformer, fast_gelu
from decompax.core.sites import Components, SiteSpec, site_factors

CIKind = Literal[
  "component_mlp", "vector_mlp", "site_mlp", "global_mlp", "transformer"]
CI_KINDS = ("component_mlp", "vector_mlp", "site_mlp", "global_mlp",
            "transformer")


@dataclasses.dataclass(frozen=True)
class CIConfig:
  """Which CI function, and its hidden widths.

  `component_mlp` and `vector_mlp` take exactly one hidden width (`d_gate`);
  `site_mlp` and `global_mlp` take any number, including none. `transformer`
  ignores `hidden` and reads its sizes and chunks from `transformer`.
  """

  kind: str = "component_mlp"  # one of CI_KINDS
  hidden: tuple[int, ...] = (16,)
  transformer: ci_transformer.TransformerCIConfig = (
    ci_transformer.TransformerCIConfig())

  def __post_init__(self):
    if self.kind not in CI_KINDS:
      raise ValueError(f"unknown CI function {self.kind!r}; use one of {CI_KINDS}")
    if self.kind in ("component_mlp", "vector_mlp") and len(self.hidden) != 1:
      raise ValueError(f"{self.kind} takes one hidden width, got {self.hidden}")
    if any(h <= 0 for h in self.hidden):
      raise ValueError(f"CI hidden widths must be positive, got {self.hidden}")


class Dense(NamedTuple):
  """One affine layer `x @ w + b`."""

  w: Float[Array, "d_in d_out"]
  b: Float[Array, " d_out"]


class PerComponentMLP(NamedTuple):
  """`C` independent one-hidden-layer MLPs with scalar output.

  `w_in` is `[C, d_gate]` for component-MLPs (scalar input) and
  `[d_in, C, d_gate]` for vector-MLPs.
  """

  w_in: Float[Array, "..."]
  b_in: Float[Array, "c h"]
  w_out: Float[Array, "c h"]
  b_out: Float[Array, " c"]


class CIFn(NamedTuple):
  """A CI function as a pure `(init, apply)` pair plus the taps it reads."""

  input_taps: tuple[str, ...]
  init: Callable[[Key[Array, ""]], object]
  apply: Callable[[object, dict[str, Array], Components], dict[str, Array]]


def _normal(key, shape, fan_in: int, gain: float) -> Array:
  return jax.random.normal(key, shape, jnp.float32) * (gain / math.sqrt(fan_in))


def _gelu(x: Float[Array, "*s"]) -> Float[Array, "*s"]:
  return jax.nn.gelu(x, approximate=False)


def init_mlp(key: Key[Array, ""], widths: tuple[int, ...]) -> tuple[Dense, ...]:
  """Return dense layers `widths[0] → … → widths[-1]`, last one linear."""
  keys = jax.random.split(key, len(widths) - 1)
  layers = []
  for i, (d_in, d_out) in enumerate(zip(widths[:-1], widths[1:])):
    gain = 1.0 if i == len(widths) - 2 else math.sqrt(2.0)
    layers.append(
      Dense(_normal(keys[i], (d_in, d_out), d_in, gain), jnp.zeros((d_out,)))
    )
  return tuple(layers)


def apply_mlp(
  layers: tuple[Dense, ...], x: Float[Array, "*l d_in"]
) -> Float[Array, "*l d_out"]:
  """Run the MLP with GELU between layers."""
  for layer in layers[:-1]:
    x = _gelu(x @ layer.w + layer.b)
  return x @ layers[-1].w + layers[-1].b


def init_component_mlp(
  key: Key[Array, ""], c: int, d_gate: int
) -> PerComponentMLP:
  """Return `C` scalar MLPs `1 → d_gate → 1`."""
  k_in, k_out = jax.random.split(key)
  return PerComponentMLP(
    w_in=_normal(k_in, (c, d_gate), 1, math.sqrt(2.0)),
    b_in=jnp.zeros((c, d_gate)),
    w_out=_normal(k_out, (c, d_gate), d_gate, 1.0),
    b_out=jnp.zeros((c,)),
  )


def _component_mlp_pre_reference(
  params: PerComponentMLP, inner: Float[Array, "*l c"]
) -> Float[Array, "*l c"]:
  # The plain definition: the fallback for other dtypes, and the yardstick of
  # tests/core/test_component_mlp_fast.py and bench/ci_mlp.py.
  hidden = _gelu(inner[..., None] * params.w_in + params.b_in)
  return jnp.sum(hidden * params.w_out, axis=-1) + params.b_out


# The batch is cut into this many slices, added elementwise inside one fusion
# before a small final reduction: enough to keep the partial sums
# `[g, n/k, c]` small, few enough to keep the fusions short.
_BATCH_SLICES = 16
# Hidden units summed per loop fusion in `_hidden_sum`.
_UNROLL = 8
# XLA's CPU loop emitter vectorises the innermost axis 8 lanes at a time.
_LANES = 8


def _g_major(*ws: Float[Array, "c g"]) -> tuple[Float[Array, " gc"], ...]:
  # `w.T` alone becomes a free relayout that leaves a stride-g gather in every
  # `[n, c]` loop; a flat copy pins one contiguous `[c]` row per hidden unit
  # (10x faster loops). The barrier keeps XLA from fusing the copy back in
  # (barriers block fusion on CPU, though not CSE).
  return lax.optimization_barrier(tuple(w.T.reshape(-1) for w in ws))


def _hidden_sum(
  fn: Callable[[Array], Array],
  weight: Float[Array, "c g"],
  w_in: Float[Array, "c g"],
  b_in: Float[Array, "c g"],
  h: Float[Array, "n c"],
) -> Float[Array, "n c"]:
  # `Σ_g weight·fn(h·w_in + b_in)`, unrolled over g so the whole sum is one
  # loop fusion over `[n, c]` with no `[n, c, g]` intermediate.
  c, d_gate = w_in.shape
  w, wi, bi = _g_major(weight, w_in, b_in)
  acc = None
  for j in range(d_gate):
    row = slice(j * c, (j + 1) * c)
    term = w[row] * fn(h * wi[row] + bi[row])
    acc = term if acc is None else acc + term
    if (j + 1) % _UNROLL == 0 and j + 1 < d_gate:
      # Longer loop bodies run slower (5x at d_gate = 128, 10% at 16), so
      # the sum is cut into fusions of `_UNROLL` hidden units.
      (acc,) = lax.optimization_barrier((acc,))
  return acc


def _batch_sums(
  fn: Callable[[Array, Array, Array], tuple[Array, ...]],
  w_in: Float[Array, "c g"],
  b_in: Float[Array, "c g"],
  h: Float[Array, "n c"],
  g: Float[Array, "n c"],
  slices: int,
) -> tuple[Float[Array, "c g"], ...]:
  # `Σ_n fn(z, h, g)` for `z = h·w_in + b_in`, one or two sums. XLA CPU runs
  # a reduction fused with elementwise work as scalar code, so the batch is
  # cut into slices added in one vectorised loop fusion; only `[g, n/k, c]`
  # partials go through a real reduction. Two sums travel as one complex64
  # array, the only way to get two outputs from one CPU loop fusion. Slice
  # `i` takes every k-th row, so a batch sharded over devices stays sharded
  # on the partials' row axis (contiguous slices would each live on one
  # device and be gathered whole).
  n, c = h.shape
  d_gate = w_in.shape[1]
  k = min(slices, n)
  rows = -(-n // k)
  pad = ((0, k * rows - n), (0, 0))
  hs, gs = (jnp.pad(x, pad).reshape(rows, k, c) for x in (h, g))
  wi, bi = (w.reshape(d_gate, 1, c) for w in _g_major(w_in, b_in))
  acc = None
  for i in range(k):
    terms = fn(hs[:, i] * wi + bi, hs[:, i], gs[:, i])
    acc = terms if acc is None else tuple(a + t for a, t in zip(acc, terms))
  packed = acc[0] if len(acc) == 1 else lax.complex(*acc)
  # Without the barrier XLA splits the sum into many small fusions.
  (packed,) = lax.optimization_barrier((packed,))
  parts = (packed,) if len(acc) == 1 else (packed.real, packed.imag)
  return tuple(jnp.sum(p, axis=1).T for p in parts)


def _mlp_rows(
  w_in: Float[Array, "c g"],
  b_in: Float[Array, "c g"],
  w_out: Float[Array, "c g"],
  b_out: Float[Array, " c"],
  h: Float[Array, "n c"],
) -> Float[Array, "n c"]:
  pre = b_out + _hidden_sum(fast_gelu.gelu, w_out, w_in, b_in, h)
  # `pre` usually has several consumers; without the barrier XLA keeps each
  # hidden unit's erf as a stored array instead of storing `pre` once.
  (pre,) = lax.optimization_barrier((pre,))
  return pre


_Residuals = tuple[Array, Array, Array, Array]


def _mlp_rows_fwd(
  w_in: Float[Array, "c g"],
  b_in: Float[Array, "c g"],
  w_out: Float[Array, "c g"],
  b_out: Float[Array, " c"],
  h: Float[Array, "n c"],
) -> tuple[Float[Array, "n c"], _Residuals]:
  return _mlp_rows(w_in, b_in, w_out, b_out, h), (w_in, b_in, w_out, h)


def _mlp_rows_bwd(
  residuals: _Residuals, g: Float[Array, "n c"]
) -> tuple[Array, Array, Array, Array, Array]:
  # Recompute z in three passes, one loop fusion each, instead of keeping a
  # `[n, c, g]` residual: gelu' summed over g for dh; gelu' summed over the
  # batch, twice, for the input-side grads; gelu summed over the batch.
  w_in, b_in, w_out, h = residuals
  dh = g * _hidden_sum(fast_gelu.gelu_grad, w_in * w_out, w_in, b_in, h)

  def input_side(z, h_, g_):
    s = g_ * fast_gelu.gelu_grad(z)
    return s, s * h_

  s_b, s_w = _batch_sums(input_side, w_in, b_in, h, g, 2 * _BATCH_SLICES)
  (d_w_out,) = _batch_sums(
    lambda z, h_, g_: (g_ * fast_gelu.gelu(z),),
    w_in, b_in, h, g, _BATCH_SLICES)
  return w_out * s_w, w_out * s_b, d_w_out, jnp.sum(g, axis=0), dh


_mlp_rows_vjp = jax.custom_vjp(_mlp_rows)
_mlp_rows_vjp.defvjp(_mlp_rows_fwd, _mlp_rows_bwd)


def _row_fold(c: int) -> int:
  # Batch rows folded into one, so that the innermost axis fills whole vector
  # registers: the toy models' 5-40 components waste most lanes otherwise.
  r = 1
  while (r * c) % _LANES or r * c < 8 * _LANES:
    r *= 2
  return r


def component_mlp_pre(
  params: PerComponentMLP, inner: Float[Array, "*l c"]
) -> Float[Array, "*l c"]:
  """Return each component's MLP applied to its own scalar `x·V[:, c]`.

  The same function as `Σ_g w_out·gelu(inner·w_in + b_in) + b_out`, laid out
  for XLA's CPU backend: hidden units unrolled into `[n, c]` loop fusions and
  a custom VJP that recomputes instead of storing `[*l, c, d_gate]`. Rows are
  folded `r` at a time into `r·c` components with tiled parameters (the same
  function; autodiff sums the tiled copies' gradients). Inputs other than
  float32 take the plain definition.
  """
  args = (params.w_in, params.b_in, params.w_out, params.b_out, inner)
  if inner.size == 0 or any(a.dtype != jnp.float32 for a in args):
    return _component_mlp_pre_reference(params, inner)
  c = inner.shape[-1]
  flat = inner.reshape(-1, c)
  n = flat.shape[0]
  r = _row_fold(c)
  rows = -(-n // r)
  flat = jnp.pad(flat, ((0, rows * r - n), (0, 0))).reshape(rows, r * c)
  tiled = (jnp.tile(w, (r, 1)) for w in args[:3])
  pre = _mlp_rows_vjp(*tiled, jnp.tile(params.b_out, r), flat)
  return pre.reshape(rows * r, c)[:n].reshape(inner.shape)


def init_vector_mlp(
  key: Key[Array, ""], d_in: int, c: int, hidden: int
) -> PerComponentMLP:
  """Return `C` MLPs `d_in → hidden → 1`, each reading the whole input."""
  k_in, k_out = jax.random.split(key)
  return PerComponentMLP(
    w_in=_normal(k_in, (d_in, c, hidden), d_in, math.sqrt(2.0)),
    b_in=jnp.zeros((c, hidden)),
    w_out=_normal(k_out, (c, hidden), hidden, 1.0),
    b_out=jnp.zeros((c,)),
  )


def vector_mlp_pre(
  params: PerComponentMLP, x: Float[Array, "*l d_in"]
) -> Float[Array, "*l c"]:
  """Return each component's MLP applied to the full site input."""
  z = jnp.einsum("...i,ich->...ch", x, params.w_in) + params.b_in
  return jnp.sum(_gelu(z) * params.w_out, axis=-1) + params.b_out


def _site_keys(key, sites):
  return [jax.random.fold_in(key, i) for i in range(len(sites))]


def make_ci_fn(config: CIConfig, sites: tuple[SiteSpec, ...]) -> CIFn:
  """Return the `(init, apply)` pair of `config` over `sites`."""
  if config.kind == "transformer":
    return _make_transformer_ci_fn(config.transformer, sites)
  taps = tuple(s.name for s in sites)
  (width,) = config.hidden if len(config.hidden) == 1 else (None,)

  if config.kind == "component_mlp":

    def init(key):
      return {
        s.name: init_component_mlp(k, s.c, width)
        for s, k in zip(sites, _site_keys(key, sites))
      }

    def apply(params, tap_values, components):
      out = {}
      for s in sites:
        v, _ = site_factors(components, s)
        out[s.name] = component_mlp_pre(params[s.name], tap_values[s.name] @ v)
      return out

  elif config.kind == "vector_mlp":

    def init(key):
      return {
        s.name: init_vector_mlp(k, s.d_in, s.c, width)
        for s, k in zip(sites, _site_keys(key, sites))
      }

    def apply(params, tap_values, components):
      del components
      return {s.name: vector_mlp_pre(params[s.name], tap_values[s.name])
              for s in sites}

  elif config.kind == "site_mlp":

    def init(key):
      return {
        s.name: init_mlp(k, (s.d_in, *config.hidden, s.c))
        for s, k in zip(sites, _site_keys(key, sites))
      }

    def apply(params, tap_values, components):
      del components
      return {s.name: apply_mlp(params[s.name], tap_values[s.name])
              for s in sites}

  else:
    d_in = sum(s.d_in for s in sites)
    d_out = sum(s.c for s in sites)

    def init(key):
      return init_mlp(key, (d_in, *config.hidden, d_out))

    def apply(params, tap_values, components):
      del components
      x = jnp.concatenate([tap_values[s.name] for s in sites], axis=-1)
      pre = apply_mlp(params, x)
      bounds = list(itertools.accumulate(s.c for s in sites))[:-1]
      parts = jnp.split(pre, bounds, axis=-1)
      return {s.name: p for s, p in zip(sites, parts)}

  return CIFn(input_taps=taps, init=init, apply=apply)


def _make_transformer_ci_fn(
  config: ci_transformer.TransformerCIConfig, sites: tuple[SiteSpec, ...]
) -> CIFn:
  # Chunks are resolved and checked here, before any parameter exists (I7).
  plan = ci_transformer.plan_chunks(config, sites)

  def init(key):
    return ci_transformer.init_params(key, config, plan)

  def apply(params, tap_values, components):
    del components
    pre = ci_transformer.apply(params, tap_values, config, plan)
    return {s.name: pre[s.name] for s in sites}

  return CIFn(input_taps=plan.taps, init=init, apply=apply)
