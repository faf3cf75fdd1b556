"""bench/ci_mlp.py: the Pallas kernels it times, and its flags."""

import pytest

from decompax.core import component_mlp_pallas


@pytest.fixture(scope="module")
def bench(load_bench):
  return load_bench("ci_mlp")


def test_each_block_size_is_a_kernel_of_its_own(bench):
  default = component_mlp_pallas.BLOCK_ROWS
  layouts = bench.pallas_layouts([128, default, 512])
  assert set(layouts) == {"pallas", "pallas@128", "pallas@512",
                          "pallas_compact", "pallas_compact@128",
                          "pallas_compact@512"}
  for name, fn in layouts.items():
    assert fn.keywords == {
      "replicated": not name.startswith("pallas_compact"),
      "block_rows": int(name.partition("@")[2] or default)}


@pytest.mark.parametrize("value", ["0", "12", "x", "-8"])
def test_a_block_size_that_is_no_multiple_of_8_is_refused(bench, value):
  with pytest.raises(ValueError, match="multiple of 8"):
    bench.block_rows([value])
  assert bench.block_rows(["8", "512"]) == [8, 512]
