"""The component-MLP CI's Pallas kernel against its plain form (SPEC §4.2),
run through Pallas' interpreter so that it is checked on a CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import component_mlp, component_mlp_pallas


def _params(seed, c, d_gate, scale=1.0):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return component_mlp.PerComponentMLP(
    w_in=scale * 1.4 * normal(c, d_gate),
    b_in=scale * normal(c, d_gate),
    w_out=0.5 * normal(c, d_gate),
    b_out=normal(c),
  )


def _normal(seed, shape, scale=1.0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def _value_and_grads(pre_fn, params, inner, cotangent):
  def loss(p, h):
    return jnp.sum(pre_fn(p, h) * cotangent)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, inner)


def _assert_close(fast, ref, rtol):
  for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(ref)):
    scale = float(np.max(np.abs(b)))
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


def _check(params, inner, cotangent, **options):
  pallas = functools.partial(
    component_mlp_pallas.pallas_pre, interpret=True, **options)
  fast = _value_and_grads(pallas, params, inner, cotangent)
  ref = _value_and_grads(
    component_mlp.reference_pre, params, inner, cotangent)
  _assert_close(fast, ref, rtol=1e-6)


@pytest.mark.parametrize("lead,c,d_gate,options", [
  # ragged positions and units: one block of 8 rows, units padded to 8
  ((7,), 3, 4, {}),
  # 2-D leading shape, the parameter rows 8 to a tile
  ((2, 5), 8, 3, {"replicated": False}),
  # three blocks of positions, so the gradient sums cross grid steps
  ((40,), 20, 16, {"block_rows": 16}),
  # 256 components cut into two 128-lane blocks by a small VMEM budget
  ((12,), 256, 9, {"block_rows": 8, "vmem_budget": 1_000_000}),
], ids=["ragged", "compact", "row_blocks", "lane_blocks"])
def test_values_and_all_grads_match_the_plain_form(lead, c, d_gate, options):
  n = int(np.prod(lead))
  plan = component_mlp_pallas.plan(n, c, d_gate, **options)
  if "vmem_budget" in options:
    assert plan.lanes == 128
  params = _params(0, c, d_gate)
  _check(params, _normal(1, (*lead, c)), _normal(2, (*lead, c)), **options)


def test_saturated_hidden_units_match_the_plain_form():
  # |z| up to ~15: erf is ±1 and gelu' is 0 or 1 in fp32.
  params = _params(3, 6, 5, scale=3.0)
  inner, cotangent = _normal(4, (9, 6), scale=3.0), _normal(5, (9, 6))
  z = inner[..., None] * params.w_in + params.b_in
  assert float(jnp.max(jnp.abs(z))) > 10.0
  _check(params, inner, cotangent)


@pytest.mark.parametrize("n,c,d_gate,options,message", [
  (64, 300, 16, {"vmem_budget": 100_000},
   "c=300, d_gate=16 needs .* MiB of VMEM per block, over the 0.0954 MiB "
   "budget; a multiple of 128 components can be cut"),
  (64, 256, 4096, {},
   "c=256, d_gate=4096 needs .* fewer hidden units would fit"),
  (64, 8, 4, {"block_rows": 12}, "block_rows=12 must be a positive multiple"),
])
def test_shapes_that_do_not_tile_are_refused(n, c, d_gate, options, message):
  with pytest.raises(ValueError, match=message):
    component_mlp_pallas.plan(n, c, d_gate, **options)
  assert not component_mlp_pallas.tiles(n, c, d_gate) or options


def test_pallas_pre_refuses_before_tracing_a_kernel():
  params = _params(6, 300, 16)
  with pytest.raises(ValueError, match="over the 0.0954 MiB budget"):
    component_mlp_pallas.pallas_pre(
      params, jnp.ones((64, 300), jnp.float32), interpret=True,
      vmem_budget=100_000)


def _lowered_grad(platform, c, d_gate, n=16):
  # Lowering needs no such device present, nor the arrays themselves.
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  params = component_mlp.PerComponentMLP(
    spec(c, d_gate), spec(c, d_gate), spec(c, d_gate), spec(c))
  grad = jax.jit(jax.value_and_grad(
    lambda p, h: jnp.sum(component_mlp.component_mlp_pre(p, h)),
    argnums=(0, 1)))
  return jax.export.export(grad, platforms=[platform])(
    params, spec(n, c)).mlir_module()


@pytest.mark.parametrize("platform,kernel", [
  ("tpu", True), ("cpu", False), ("cuda", False)])
def test_a_tpu_step_gets_the_pallas_kernel(platform, kernel):
  # The forward and the backward are one Mosaic custom call each.
  module = _lowered_grad(platform, 5, 4)
  assert module.count("tpu_custom_call") == (2 if kernel else 0)


def test_a_tpu_step_whose_shape_does_not_tile_gets_the_accelerator_layout():
  assert not component_mlp_pallas.tiles(16, 30001, 2)
  module = _lowered_grad("tpu", 30001, 2)
  assert "tpu_custom_call" not in module
