"""recipe/hlo_flops.py: a compiled program's matmul count takes loops
times their trips, the costliest branch and GPU library calls."""

import jax
import jax.numpy as jnp

from decompax.recipe import hlo_flops


def _compiled(fn, *args):
  return jax.jit(fn).lower(*args).compile()


def test_a_loop_body_counts_its_trip_count_times():
  def layers(x, ws):
    return jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0]

  compiled = _compiled(layers, jnp.ones((8, 16)), jnp.ones((10, 16, 16)))
  counted = hlo_flops.compiled_matmul_flops(compiled.as_text())
  assert counted == hlo_flops.HloMatmuls(10 * 2 * 8 * 16 * 16, {})
  assert hlo_flops.loop_trips(compiled.as_text()) == [10]
  # XLA's own figure counts the body once.
  assert hlo_flops.xla_cost_flops(compiled) < 2 * 2 * 8 * 16 * 16


def test_a_conditional_counts_its_costliest_branch():
  def either(p, x, w):
    return jax.lax.cond(p, lambda x: x @ w, lambda x: (x @ w) @ w, x)

  compiled = _compiled(either, True, jnp.ones((8, 16)), jnp.ones((16, 16)))
  assert hlo_flops.compiled_matmul_flops(compiled.as_text()).flops == (
    2 * 2 * 8 * 16 * 16)


GPU_HLO = """HloModule gpu

%fused (p0: bf16[8,16], p1: bf16[16,32]) -> bf16[8,32] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,32]{1,0} parameter(1)
  ROOT %d = bf16[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, \
rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[8,16], b: bf16[16,32], q: bf16[2,8,4,16]) -> f32[] {
  %a = bf16[8,16]{1,0} parameter(0)
  %b = bf16[16,32]{1,0} parameter(1)
  %q = bf16[2,8,4,16]{3,2,1,0} parameter(2)
  %gemm = (bf16[8,32]{1,0}, s8[256]{0}) custom-call(%a, %b), \
custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":\
{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],\
"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],\
"rhs_batch_dimensions":[]}}}
  %triton = bf16[8,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused
  %fwd = (bf16[2,8,4,16]{3,2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), \
custom_call_target="__cudnn$fmhaSoftmax", backend_config={\
"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{\
"element_type":"BF16","dimensions":["2","4","8","8"]}}}
  %bwd = (bf16[2,8,4,16]{3,2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), \
custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={\
"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{\
"element_type":"BF16","dimensions":["2","4","8","8"]}}}
  %other = f32[] custom-call(%a), custom_call_target="some_kernel"
  ROOT %r = f32[] constant(0)
}
""".replace("\\\n", "")


def test_gpu_library_calls_are_sized_and_unknown_ones_named():
  counted = hlo_flops.compiled_matmul_flops(GPU_HLO)
  gemm = 2 * 8 * 16 * 32
  scores = 2 * (2 * 4 * 8 * 8) * 16  # one score-sized matmul
  assert counted.flops == 2 * gemm + 2 * scores + 5 * scores
  assert counted.uncounted == {"some_kernel": 1}


def test_the_measured_matmul_rate_is_positive():
  assert hlo_flops.measured_matmul_rate(n=32, repeats=2) > 0
