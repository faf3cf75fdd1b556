"""Compile-option presets and `xla_option=value` lists."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.placement import compiler


def test_presets_are_copies_of_their_options():
  assert compiler.options("bare") == {}
  assert compiler.options("cpu512") == {"xla_cpu_prefer_vector_width": 512}
  assert compiler.options("tuned-v1")[
    "xla_gpu_enable_latency_hiding_scheduler"] is True
  compiler.options(compiler.DEFAULT)["extra"] = 1
  assert "extra" not in compiler.PRESETS[compiler.DEFAULT]


def test_option_lists_parse_their_values():
  assert compiler.options(
    "xla_gpu_enable_triton_gemm=false, xla_gpu_all_reduce_combine_threshold_"
    "bytes=1024,xla_cpu_max_isa=AVX2,xla_x=0.5") == {
      "xla_gpu_enable_triton_gemm": False,
      "xla_gpu_all_reduce_combine_threshold_bytes": 1024,
      "xla_cpu_max_isa": "AVX2", "xla_x": 0.5}


@pytest.mark.parametrize("text", ["fast", "xla_a=1,b=2", "xla_a"])
def test_anything_else_names_the_presets(text):
  with pytest.raises(ValueError, match=r"use bare, cpu512, tuned-v1 or "
                     r"xla_option=value pairs") as info:
    compiler.options(text)
  assert "\n" not in str(info.value)


def test_wide_vectors_compute_the_same_function():
  """The default preset changes code generation only: an elementwise loop
  and a reduction agree with the bare compile to rounding."""
  x = jax.random.normal(jax.random.key(0), (1000, 37))

  def f(x):
    return jnp.sum(jax.nn.gelu(x, approximate=False) * x, axis=0)

  lowered = jax.jit(f).lower(x)
  bare = lowered.compile(compiler.options("bare"))(x)
  wide = lowered.compile(compiler.options(compiler.DEFAULT))(x)
  np.testing.assert_allclose(np.asarray(wide), np.asarray(bare),
                             rtol=1e-5, atol=1e-5)
