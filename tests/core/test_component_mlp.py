"""Fast component-MLP CI function against its plain form (SPEC §4.2)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import component_mlp, fast_gelu

_erf = np.vectorize(math.erf)


def _params(seed, c, d_gate, scale=1.0):
  # NumPy draws: jax.random would compile a kernel per shape, the bulk of
  # these tests' time.
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


def test_gelu_and_derivative_match_float64_on_a_dense_grid():
  z = np.linspace(-12.0, 12.0, 240_001, dtype=np.float32)
  z64 = z.astype(np.float64)
  cdf = 0.5 * (1.0 + _erf(z64 / math.sqrt(2.0)))
  pdf = np.exp(-0.5 * z64 * z64) / math.sqrt(2.0 * math.pi)
  pairs = jax.jit(lambda x: ((fast_gelu.gelu(x), fast_gelu.gelu_grad(x)),
                             fast_gelu.gelu_and_grad(x)))(z)
  for gelu, grad in pairs:
    assert np.max(np.abs(gelu - z64 * cdf) / np.maximum(1.0,
                                                        np.abs(z64))) < 3e-7
    assert np.max(np.abs(grad - (cdf + z64 * pdf))) < 2.5e-7


def test_gelu_saturates_far_from_zero():
  # gelu exactly (no z·ε leak for huge |z|); gelu' to its 6e-8 clamp error,
  # or exactly from the erf-and-exp pair.
  z = jnp.array([-1e4, -50.0, 50.0, 1e4], jnp.float32)
  np.testing.assert_array_equal(fast_gelu.gelu(z), [0.0, 0.0, 50.0, 1e4])
  np.testing.assert_allclose(
    fast_gelu.gelu_grad(z), [0.0, 0.0, 1.0, 1.0], rtol=0, atol=1e-7)
  gelu, grad = fast_gelu.gelu_and_grad(z)
  np.testing.assert_array_equal(gelu, [0.0, 0.0, 50.0, 1e4])
  np.testing.assert_array_equal(grad, [0.0, 0.0, 1.0, 1.0])


# Both layouts run here whatever the backend: each is a plain function of
# its inputs; only `component_mlp_pre` picks one by platform.
_LAYOUTS = pytest.mark.parametrize(
  "pre_fn", [component_mlp.cpu_pre, component_mlp.accelerator_pre],
  ids=["cpu", "accelerator"])


@_LAYOUTS
@pytest.mark.parametrize("lead,c,d_gate", [
  ((7,), 3, 4),      # ragged c: rows folded and padded
  ((2, 5), 8, 3),    # 2-D leading shape
  ((40,), 20, 16),   # slices of the batch padded
])
def test_values_and_all_grads_match_reference(pre_fn, lead, c, d_gate):
  params = _params(0, c, d_gate)
  inner, cotangent = _normal(1, (*lead, c)), _normal(2, (*lead, c))
  fast = _value_and_grads(pre_fn, params, inner, cotangent)
  ref = _value_and_grads(
    component_mlp.reference_pre, params, inner, cotangent)
  _assert_close(fast, ref, rtol=2e-6)


@_LAYOUTS
def test_saturated_hidden_units_match_reference(pre_fn):
  # |z| up to ~15: erf is ±1 and gelu' is 0 or 1 in fp32.
  params = _params(3, 6, 5, scale=3.0)
  inner, cotangent = _normal(4, (9, 6), scale=3.0), _normal(5, (9, 6))
  z = inner[..., None] * params.w_in + params.b_in
  assert float(jnp.max(jnp.abs(z))) > 10.0
  fast = _value_and_grads(pre_fn, params, inner, cotangent)
  ref = _value_and_grads(
    component_mlp.reference_pre, params, inner, cotangent)
  _assert_close(fast, ref, rtol=2e-6)


def test_non_float32_inputs_use_the_reference():
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _params(6, 3, 2))
  inner = jnp.ones((4, 3), jnp.bfloat16)
  pre = component_mlp.component_mlp_pre(params, inner)
  assert pre.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
    pre, component_mlp.reference_pre(params, inner))


@pytest.mark.parametrize("platform,cpu_layout", [
  ("cpu", True), ("tpu", False), ("cuda", False)])
def test_the_layout_follows_the_platform_the_step_is_lowered_for(
    platform, cpu_layout):
  # Only the CPU layout uses optimization barriers (to keep its loop
  # fusions apart), so their presence in the lowered gradient says which
  # layout a platform got. Lowering needs no such device present.
  params = _params(7, 5, 4)
  inner = _normal(8, (8, 5))
  grad = jax.jit(jax.grad(
    lambda p, h: jnp.sum(component_mlp.component_mlp_pre(p, h)),
    argnums=(0, 1)))
  module = jax.export.export(grad, platforms=[platform])(
    params, inner).mlir_module()
  assert ("optimization_barrier" in module) == cpu_layout
