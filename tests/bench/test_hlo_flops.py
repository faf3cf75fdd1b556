"""bench/hlo_flops.py: a compiled program's matmul count takes loops
times their trips, the costliest branch and GPU library calls."""

import pathlib

import jax
import jax.numpy as jnp

from bench import hlo_flops


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
  %topk = (bf16[8,2]{1,0}, s32[8,2]{1,0}) custom-call(%a), \
custom_call_target="TopK"
  ROOT %r = f32[] constant(0)
}
""".replace("\\\n", "")


def test_gpu_library_calls_are_sized_and_unknown_ones_named():
  # A CPU's top-k (a mixture of experts' routing) holds no matmul.
  counted = hlo_flops.compiled_matmul_flops(GPU_HLO)
  gemm = 2 * 8 * 16 * 32
  scores = 2 * (2 * 4 * 8 * 8) * 16  # one score-sized matmul
  assert counted.flops == 2 * gemm + 2 * scores + 5 * scores
  assert counted.uncounted == {"some_kernel": 1}


def test_the_measured_matmul_rate_is_positive():
  assert hlo_flops.measured_matmul_rate(n=32, repeats=2) > 0


FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "tpu_hlo"


def test_a_tpu_batched_matmul_written_as_a_convolution_counts_as_its_dot():
  # The batch axes are window axes over dilated input: one tap is real.
  text = (FIXTURES / "batched.hlo.txt").read_text()
  assert "lhs_dilate=2x4" in text
  counted = hlo_flops.compiled_matmul_flops(text)
  assert counted == hlo_flops.HloMatmuls(2 * 2 * 4 * 128 * 128 * 64, {})


def test_a_tpu_loop_reads_its_trip_count_from_its_condition():
  text = (FIXTURES / "scan.hlo.txt").read_text()
  assert "known_trip_count" not in text
  assert hlo_flops.loop_trips(text) == [10]
  assert hlo_flops.compiled_matmul_flops(text).flops == (
    10 * 2 * 128 * 256 * 256)


# TPU-style convolutions as XLA writes them, built by hand: a plain dot; a
# projection to heads whose head axis is a window over padding (the input
# axis is 1 wide); a feature-grouped one; a data-only custom call; and
# XLA's rematerialised clone of a fusion.
TPU_HLO = """HloModule tpu

%fused (p0: bf16[16,64], p1: bf16[64,32]) -> bf16[16,32] {
  %p0 = bf16[16,64]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[64,32]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %convolution.1 = bf16[16,32]{1,0:T(8,128)(2,1)} \
convolution(%p0, %p1), dim_labels=bf_io->bf
}

ENTRY %main (a: bf16[16,64], w: bf16[64,32], x: bf16[16,64,1], \
h: bf16[4,8,64]) -> f32[] {
  %a = bf16[16,64]{1,0:T(8,128)(2,1)} parameter(0)
  %w = bf16[64,32]{1,0:T(8,128)(2,1)} parameter(1)
  %x = bf16[16,64,1]{1,0,2:T(8,128)(2,1)} parameter(2)
  %h = bf16[4,8,64]{2,1,0:T(8,128)(2,1)} parameter(3)
  %fusion.7 = bf16[16,32]{1,0:T(8,128)(2,1)} fusion(%a, %w), kind=kOutput, \
calls=%fused
  %fusion.7.remat2 = bf16[16,32]{1,0:T(8,128)(2,1)} fusion(%a, %w), \
kind=kOutput, calls=%fused
  %convolution.2 = bf16[16,4,8]{0,2,1:T(8,128)(2,1)} convolution(%x, %h), \
window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=bf0_0oi->b0f
  %convolution.3 = bf16[16,32]{1,0:T(8,128)(2,1)} convolution(%a, %w), \
dim_labels=bf_io->bf, feature_group_count=2
  %buffer = bf16[16,32]{1,0} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %r = f32[] constant(0)
}
""".replace("\\\n", "")


def test_tpu_convolutions_count_their_real_taps_and_xla_remat_apart():
  counted = hlo_flops.compiled_matmul_flops(TPU_HLO)
  dot = 2 * 16 * 64 * 32
  heads = 2 * 16 * 4 * 8 * 64  # one real tap of the 4-wide window
  grouped = 2 * 16 * 32 * 64  # the kernel's i is one group's features
  assert counted == hlo_flops.HloMatmuls(2 * dot + heads + grouped, {}, dot)


def test_a_convolution_counts_only_taps_that_land_on_input():
  # Two dilated batch axes (as in the fixture), then a real 1-d window of
  # 3 taps over 5 positions padded 1 each side: 3 + 3 + 3 + 2 + 2 = 13
  # real taps, the edges losing one each.
  assert hlo_flops.convolution_flops(
    [2, 4, 3, 5], [2, 4, 5, 5], [2, 4, 3, 5], "01bf_01oi->01bf",
    "size=2x4 stride=1x3 lhs_dilate=2x4") == 2 * 2 * 4 * 3 * 5 * 5
  assert hlo_flops.convolution_flops(
    [2, 6, 5], [3, 6, 4], [2, 4, 5], "bf0_0io->bf0",
    "size=3 pad=1_1") == 2 * 2 * 4 * 6 * 13
