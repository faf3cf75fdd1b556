"""The component-MLP CI function's kernels (SPEC §4.2).

Each of `C` components has its own scalar MLP `1 → d_gate → 1` on its own
input `x·V[:, c]`. `component_mlp_pre` computes it with a custom VJP that
recomputes the hidden layer instead of storing `[*l, c, d_gate]`, in the
layout that suits the backend the step is lowered for:
  * `cpu_pre` for XLA's CPU backend: hidden units unrolled into `[n, c]`
    loop fusions and batch sums cut into vectorised slices;
  * `accelerator_pre` for a GPU: the plain broadcast over `[n, c, d_gate]`,
    which its compiler fuses into single reductions;
  * `tpu_pre` for a TPU: the Pallas kernel of `component_mlp_pallas`, or
    `accelerator_pre` for a shape that kernel does not tile.
`reference_pre` is the plain definition both must equal.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from decompax.core import component_mlp_pallas, fast_gelu


def _gelu(x: Float[Array, "*s"]) -> Float[Array, "*s"]:
  return jax.nn.gelu(x, approximate=False)


class PerComponentMLP(NamedTuple):
  """`C` independent one-hidden-layer MLPs with scalar output.

  `w_in` is `[C, d_gate]` for component-MLPs (scalar input) and
  `[d_in, C, d_gate]` for vector-MLPs.
  """

  w_in: Float[Array, "..."]
  b_in: Float[Array, "c h"]
  w_out: Float[Array, "c h"]
  b_out: Float[Array, " c"]


def reference_pre(
  params: PerComponentMLP, inner: Float[Array, "*l c"]
) -> Float[Array, "*l c"]:
  """Return the plain definition `Σ_g w_out·gelu(inner·w_in + b_in) +
  b_out`: the fallback for other dtypes, and the yardstick of the fast
  kernel's tests and bench."""
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


@jax.custom_vjp
def _broadcast_pre(
  params: PerComponentMLP, h: Float[Array, "n c"]
) -> Float[Array, "n c"]:
  z = h[..., None] * params.w_in + params.b_in
  return jnp.sum(params.w_out * fast_gelu.gelu(z), axis=-1) + params.b_out


def _broadcast_pre_fwd(params, h):
  return _broadcast_pre(params, h), (params, h)


def _broadcast_pre_bwd(
  residuals: tuple[PerComponentMLP, Array], g: Float[Array, "n c"]
) -> tuple[PerComponentMLP, Array]:
  # The hidden layer is recomputed, never stored: each sum below reduces
  # the broadcast `[n, c, g]`, which an accelerator's compiler fuses with
  # the elementwise work that feeds it instead of writing it out.
  params, h = residuals
  gelu, grad = fast_gelu.gelu_and_grad(
    h[..., None] * params.w_in + params.b_in)
  dh = g * jnp.sum(params.w_in * params.w_out * grad, axis=-1)
  s = g[..., None] * grad
  grads = PerComponentMLP(
    w_in=params.w_out * jnp.sum(s * h[..., None], axis=0),
    b_in=params.w_out * jnp.sum(s, axis=0),
    w_out=jnp.sum(g[..., None] * gelu, axis=0),
    b_out=jnp.sum(g, axis=0))
  return grads, dh


_broadcast_pre.defvjp(_broadcast_pre_fwd, _broadcast_pre_bwd)


def accelerator_pre(
  params: PerComponentMLP, inner: Float[Array, "*l c"]
) -> Float[Array, "*l c"]:
  """Return the component MLPs laid out for a GPU or TPU (float32).

  The plain broadcast over `[n, c, d_gate]`, which their compilers fuse
  into single reductions (`d_gate` on the vector lanes), with a custom VJP
  that recomputes the hidden layer instead of storing it. On a TPU v5e at
  ResidMLP-3's `2048 × 500 × 128` its forward and gradient together run
  1.7x as fast as `cpu_pre`'s (`bench/ci_mlp.py`), and ResidMLP-3's whole
  step 2.5x (docs/performance.md); the Pallas kernel (`tpu_pre`) is 1.17x
  faster again there. On a GPU it is the untimed default.
  """
  flat = inner.reshape(-1, inner.shape[-1])
  return _broadcast_pre(params, flat).reshape(inner.shape)


def cpu_pre(
  params: PerComponentMLP, inner: Float[Array, "*l c"]
) -> Float[Array, "*l c"]:
  """Return the component MLPs laid out for XLA's CPU backend (float32).

  Rows are folded `r` at a time into `r·c` components with tiled
  parameters (the same function; autodiff sums the tiled copies'
  gradients), so that toy-sized `C` fills whole vector registers.
  """
  c = inner.shape[-1]
  flat = inner.reshape(-1, c)
  n = flat.shape[0]
  r = _row_fold(c)
  rows = -(-n // r)
  flat = jnp.pad(flat, ((0, rows * r - n), (0, 0))).reshape(rows, r * c)
  tiled = (jnp.tile(w, (r, 1))
           for w in (params.w_in, params.b_in, params.w_out))
  pre = _mlp_rows_vjp(*tiled, jnp.tile(params.b_out, r), flat)
  return pre.reshape(rows * r, c)[:n].reshape(inner.shape)


def tpu_pre(
  params: PerComponentMLP, inner: Float[Array, "*l c"]
) -> Float[Array, "*l c"]:
  """Return the component MLPs for a TPU (float32): the Pallas kernel
  (`component_mlp_pallas.pallas_pre`) where its blocks fit the chip's
  VMEM, else `accelerator_pre`."""
  c = inner.shape[-1]
  if component_mlp_pallas.tiles(inner.size // c, c, params.w_in.shape[-1]):
    return component_mlp_pallas.pallas_pre(params, inner)
  return accelerator_pre(params, inner)


def component_mlp_pre(
  params: PerComponentMLP, inner: Float[Array, "*l c"]
) -> Float[Array, "*l c"]:
  """Return each component's MLP applied to its own scalar `x·V[:, c]`.

  The same function as `Σ_g w_out·gelu(inner·w_in + b_in) + b_out`, with a
  custom VJP that recomputes instead of storing `[*l, c, d_gate]`, laid out
  per backend and chosen when the step is lowered for its platform:
  `cpu_pre` unrolls the hidden units into `[n, c]` loop fusions for XLA's
  CPU emitter, whose fused reductions run as scalar code; `accelerator_pre`
  leaves the broadcast to a GPU's fusing compiler, where the unrolled
  form's many `[n, c]` passes and barriers cost more than they save;
  `tpu_pre` runs the Pallas kernel on a TPU. Inputs other than float32
  take the plain definition.
  """
  args = (params.w_in, params.b_in, params.w_out, params.b_out, inner)
  if inner.size == 0 or any(a.dtype != jnp.float32 for a in args):
    return reference_pre(params, inner)
  return lax.platform_dependent(params, inner, cpu=cpu_pre, tpu=tpu_pre,
                                default=accelerator_pre)
