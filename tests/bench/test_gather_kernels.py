"""bench/gather_kernels.py on tiny shapes: each form it times agrees with
the former one, and its lines say so."""

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
  return load_bench("gather_kernels")


def test_the_vocabulary_kl_forms_agree(bench):
  lines = bench.head_lines(2, 8, 16, 256)
  assert len(lines) == 3
  # On a CPU the barrier changes nothing the compiler computes.
  assert all(line.endswith("bitwise equal") for line in lines[1:]), lines


def test_the_three_window_forms_agree(bench):
  lines = bench.window_lines(2, 16, 6, k=5, before=3, after=2)
  assert len(lines) == 4
  assert all(line.endswith("bitwise equal") for line in lines[1:]), lines
