"""The component-MLP CI function as a Pallas kernel for a TPU (SPEC §4.2).

The same function as `component_mlp.reference_pre`,
`Σ_g w_out·gelu(h·w_in + b_in) + b_out` per position and component, with a
custom VJP that recomputes the hidden layer instead of storing
`[n, c, d_gate]`. Components lie on the vector lanes and positions on the
sublanes: every step of the kernel is an elementwise map over an `[8, c]`
tile of `h` for one hidden unit at a time, the unit's parameters being one
row broadcast down the sublanes. So the forward evaluates one erf per
(position, component, unit) and the backward one erf and one exp, with no
cross-lane work at all:
  * the forward keeps the `[8, c]` sum over units in registers;
  * the backward keeps `dh`'s sum over units in registers and adds each
    unit's three parameter-gradient terms into `[d_gate, 8, c]`
    accumulators, one `[8, c]` tile per unit, summed over the 8 sublanes
    once, outside the kernel, so that the loop holds elementwise work
    alone.
Positions are padded to whole blocks (with zero cotangent, so they add
nothing to the gradients) and hidden units to a multiple of 8 (with zero
weights, so they add nothing to the output).

`interpret=True` runs the kernel through Pallas' interpreter on any
backend, which is how the tests check it on a CPU.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float

from decompax.core import fast_gelu

# The parameters are a `component_mlp.PerComponentMLP`, a NamedTuple; that
# module picks this kernel by platform, so this one cannot import it.
ComponentMLPParams = tuple

# A TPU vector register holds 8 sublanes × 128 lanes of float32.
_SUBLANES = 8
_LANES = 128
# Positions per grid step: enough to amortise a step's overhead, few enough
# that the double-buffered `h`, cotangent and output blocks stay small.
BLOCK_ROWS = 256
# VMEM the kernel may plan for (the limit it asks the compiler for, which
# grants 16 MiB unless told otherwise). ResidMLP-3's blocks plan 27 MiB,
# which the TPU v5e it was measured on granted.
VMEM_BUDGET = 64 << 20
_F32 = 4


class Plan(NamedTuple):
  """How one `[n, c]` input with `d_gate` hidden units is cut into blocks."""

  rows: int          # positions per grid step (a multiple of 8)
  lanes: int         # components per grid step (c, or a multiple of 128)
  units: int         # hidden units padded to a multiple of 8
  replicated: bool   # each unit's parameter row stored down 8 sublanes
  vmem_bytes: int    # the backward's VMEM footprint, double-buffered


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _footprint(rows: int, lanes: int, units: int, replicated: bool) -> int:
  # Double-buffered blocks of the backward, the larger of the two passes:
  # `h`, cotangent and `dh` ([rows, lanes]), three parameter rows
  # ([units, lanes], or `[units, 8, lanes]` replicated) and three
  # `[units, 8, lanes]` accumulators. Lanes are padded to whole vector
  # registers in VMEM.
  width = _round_up(lanes, _LANES)
  blocks = 3 * rows + 3 * units * (_SUBLANES if replicated else 1)
  blocks += 3 * units * _SUBLANES
  return 2 * _F32 * width * blocks


def plan(n: int, c: int, d_gate: int, *, block_rows: int = BLOCK_ROWS,
         vmem_budget: int = VMEM_BUDGET, replicated: bool = True) -> Plan:
  """Return the blocks for `n` positions of `c` components with `d_gate`
  hidden units, or raise `ValueError` saying why the shape does not tile.

  `replicated` stores each hidden unit's parameter row down all 8
  sublanes, so the kernel reads it as a whole `[8, lanes]` tile (8x the
  parameters' VMEM, no sublane broadcast); otherwise 8 units share a tile
  and each row is broadcast as it is read.

  All `c` components go in one block when they fit the budget; otherwise
  `c` must be a multiple of 128, cut into the widest fitting blocks of
  whole vector registers.
  """
  if min(n, c, d_gate) < 1:
    raise ValueError(f"component-MLP Pallas kernel: empty shape n={n}, "
                     f"c={c}, d_gate={d_gate}")
  if block_rows < _SUBLANES or block_rows % _SUBLANES:
    raise ValueError(f"component-MLP Pallas kernel: block_rows={block_rows}"
                     f" must be a positive multiple of {_SUBLANES}")
  rows = min(block_rows, _round_up(n, _SUBLANES))
  units = _round_up(d_gate, _SUBLANES)
  widths = [c]
  if c % _LANES == 0:
    widths += [w for w in range(c - _LANES, 0, -_LANES) if c % w == 0]
  for lanes in widths:
    need = _footprint(rows, lanes, units, replicated)
    if need <= vmem_budget:
      return Plan(rows, lanes, units, replicated, need)
  least = _footprint(rows, widths[-1], units, replicated)
  fix = ("a multiple of 128 components can be cut into narrower blocks"
         if c % _LANES else "fewer hidden units would fit")
  raise ValueError(
    f"component-MLP Pallas kernel: c={c}, d_gate={d_gate} needs "
    f"{least / 2**20:.3g} MiB of VMEM per block, over the "
    f"{vmem_budget / 2**20:.3g} MiB budget; {fix}, or use "
    "component_mlp.accelerator_pre")


def tiles(n: int, c: int, d_gate: int) -> bool:
  """Return whether `plan` accepts the shape with its defaults."""
  try:
    plan(n, c, d_gate)
  except ValueError:
    return False
  return True


def _unit_rows(
  w: Float[Array, "c g"], plan_: Plan
) -> Float[Array, "k 8 c"]:
  # `[c, g]` → one row per hidden unit (zero for the padding): replicated,
  # `[units, 8, c]`, a whole tile per unit; else `[units/8, 8, c]`, 8 units
  # to a tile, a unit's row read by a dynamic index on the leading axis and
  # a static one on the sublanes.
  c, d_gate = w.shape
  w = jnp.pad(w.T, ((0, plan_.units - d_gate), (0, 0)))
  if plan_.replicated:
    return jnp.broadcast_to(w[:, None, :], (plan_.units, _SUBLANES, c))
  return w.reshape(plan_.units // _SUBLANES, _SUBLANES, c)


def _unit_row(ref, k, r: int, replicated: bool):
  # Unit `8k + r`'s parameters, to multiply an `[8, lanes]` tile.
  if replicated:
    return ref[k * _SUBLANES + r]
  return ref[k, r:r + 1, :]


def _compiler_params(plan_: Plan, semantics: tuple[str, ...]):
  # A margin over the planned blocks for the compiler's own scratch.
  limit = max(plan_.vmem_bytes + (8 << 20), 16 << 20)
  return pltpu.CompilerParams(dimension_semantics=semantics,
                              vmem_limit_bytes=limit)


def _row_tiles(rows: int):
  # `fori_loop` body index → the `[8, lanes]` tile of the block it reads.
  return lambda i: pl.ds(pl.multiple_of(i * _SUBLANES, _SUBLANES), _SUBLANES)


def _forward_kernel(h_ref, wi_ref, bi_ref, wo_ref, bo_ref, out_ref, *,
                    replicated: bool):
  tile = _row_tiles(h_ref.shape[0])
  row = functools.partial(_unit_row, replicated=replicated)
  groups = wi_ref.shape[0] // (_SUBLANES if replicated else 1)

  def per_tile(i, carry):
    h = h_ref[tile(i), :]

    def per_group(k, acc):
      for r in range(_SUBLANES):
        z = h * row(wi_ref, k, r) + row(bi_ref, k, r)
        acc = acc + row(wo_ref, k, r) * fast_gelu.gelu(z)
      return acc

    start = jnp.broadcast_to(bo_ref[...], h.shape)
    out_ref[tile(i), :] = lax.fori_loop(0, groups, per_group, start)
    return carry

  lax.fori_loop(0, h_ref.shape[0] // _SUBLANES, per_tile, 0)


def _backward_kernel(h_ref, g_ref, wi_ref, bi_ref, wiwo_ref,
                     dh_ref, dwi_ref, dbi_ref, dwo_ref, *, replicated: bool):
  # The grid's second axis walks the positions; the parameter-gradient
  # accumulators stay put along it and start at zero.
  @pl.when(pl.program_id(1) == 0)
  def _():
    for ref in (dwi_ref, dbi_ref, dwo_ref):
      ref[...] = jnp.zeros(ref.shape, ref.dtype)

  tile = _row_tiles(h_ref.shape[0])
  row = functools.partial(_unit_row, replicated=replicated)
  groups = dwi_ref.shape[0] // _SUBLANES

  def per_tile(i, carry):
    h, g = h_ref[tile(i), :], g_ref[tile(i), :]

    def per_group(k, acc):
      for r in range(_SUBLANES):
        z = h * row(wi_ref, k, r) + row(bi_ref, k, r)
        gelu, grad = fast_gelu.gelu_and_grad(z)
        acc = acc + row(wiwo_ref, k, r) * grad
        s = g * grad
        unit = k * _SUBLANES + r
        dwi_ref[unit] += s * h
        dbi_ref[unit] += s
        dwo_ref[unit] += g * gelu
      return acc

    acc = lax.fori_loop(0, groups, per_group, jnp.zeros_like(h))
    dh_ref[tile(i), :] = g * acc
    return carry

  lax.fori_loop(0, h_ref.shape[0] // _SUBLANES, per_tile, 0)


def _specs(plan_: Plan):
  rows = pl.BlockSpec(block_shape=(plan_.rows, plan_.lanes),
                      index_map=lambda j, i: (i, j))
  tiles_ = plan_.units // (1 if plan_.replicated else _SUBLANES)
  units = pl.BlockSpec(
    block_shape=(tiles_, _SUBLANES, plan_.lanes),
    index_map=lambda j, i: (0, 0, j))
  sums = pl.BlockSpec(block_shape=(plan_.units, _SUBLANES, plan_.lanes),
                      index_map=lambda j, i: (0, 0, j))
  bias = pl.BlockSpec(block_shape=(1, plan_.lanes),
                      index_map=lambda j, i: (0, j))
  return rows, units, sums, bias


def _padded_rows(x: Float[Array, "n c"], plan_: Plan) -> Array:
  n = x.shape[0]
  return jnp.pad(x, ((0, _round_up(n, plan_.rows) - n), (0, 0)))


def _grid(n_padded: int, c: int, plan_: Plan) -> tuple[int, int]:
  return (c // plan_.lanes, n_padded // plan_.rows)


def _forward(params: ComponentMLPParams, h: Float[Array, "n c"], plan_: Plan,
             interpret: bool) -> Float[Array, "n c"]:
  n, c = h.shape
  hp = _padded_rows(h, plan_)
  rows, units, _, bias = _specs(plan_)
  out = pl.pallas_call(
    functools.partial(_forward_kernel, replicated=plan_.replicated),
    out_shape=jax.ShapeDtypeStruct(hp.shape, jnp.float32),
    grid=_grid(hp.shape[0], c, plan_),
    in_specs=[rows, units, units, units, bias],
    out_specs=rows,
    compiler_params=_compiler_params(plan_, ("parallel", "parallel")),
    interpret=interpret,
  )(hp, *(_unit_rows(w, plan_)
          for w in (params.w_in, params.b_in, params.w_out)),
    params.b_out.reshape(1, c))
  return out[:n]


def _backward(params: ComponentMLPParams, h: Float[Array, "n c"],
              g: Float[Array, "n c"], plan_: Plan, interpret: bool
              ) -> tuple[ComponentMLPParams, Float[Array, "n c"]]:
  n, c = h.shape
  d_gate = params.w_in.shape[1]
  hp, gp = _padded_rows(h, plan_), _padded_rows(g, plan_)
  rows, units, sums, _ = _specs(plan_)
  partial = jax.ShapeDtypeStruct((plan_.units, _SUBLANES, c), jnp.float32)
  dh, *parts = pl.pallas_call(
    functools.partial(_backward_kernel, replicated=plan_.replicated),
    out_shape=(jax.ShapeDtypeStruct(hp.shape, jnp.float32),
               partial, partial, partial),
    grid=_grid(hp.shape[0], c, plan_),
    in_specs=[rows, rows, units, units, units],
    out_specs=(rows, sums, sums, sums),
    compiler_params=_compiler_params(plan_, ("parallel", "arbitrary")),
    interpret=interpret,
  )(hp, gp, *(_unit_rows(w, plan_)
              for w in (params.w_in, params.b_in,
                        params.w_in * params.w_out)))
  s_w, s_b, d_w_out = (jnp.sum(p, axis=1)[:d_gate].T for p in parts)
  grads = params._replace(
    w_in=params.w_out * s_w, b_in=params.w_out * s_b, w_out=d_w_out,
    b_out=jnp.sum(g, axis=0))
  return grads, dh[:n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _pre(params: ComponentMLPParams, h: Float[Array, "n c"], plan_: Plan,
         interpret: bool) -> Float[Array, "n c"]:
  return _forward(params, h, plan_, interpret)


def _pre_fwd(params, h, plan_, interpret):
  return _forward(params, h, plan_, interpret), (params, h)


def _pre_bwd(plan_, interpret, residuals, g):
  params, h = residuals
  return _backward(params, h, g, plan_, interpret)


_pre.defvjp(_pre_fwd, _pre_bwd)


def pallas_pre(
  params: ComponentMLPParams, inner: Float[Array, "*l c"], *,
  interpret: bool = False, block_rows: int = BLOCK_ROWS,
  vmem_budget: int = VMEM_BUDGET, replicated: bool = True,
) -> Float[Array, "*l c"]:
  """Return the component MLPs as a Pallas TPU kernel (float32).

  Raises `ValueError` when the shape does not tile (`plan`). With
  `interpret=True` it runs on any backend through Pallas' interpreter.
  """
  c = inner.shape[-1]
  flat = inner.reshape(-1, c)
  plan_ = plan(flat.shape[0], c, params.w_in.shape[-1],
               block_rows=block_rows, vmem_budget=vmem_budget,
               replicated=replicated)
  return _pre(params, flat, plan_, interpret).reshape(inner.shape)
