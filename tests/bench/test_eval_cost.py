"""bench/eval_cost.py times every way of one recipe and the passes alone."""

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
  return load_bench("eval_cost")


@pytest.mark.slow
def test_a_short_run_reports_every_column(bench):
  record = bench.bench_recipe("tms_5-2", steps=20, every=10, slow_every=20,
                              rounds=3, repeats=1)
  for key in ("fast", "fast+slow", "loop", "fast_calls", "slow_calls",
              "loop_calls", "step_s", "fast_pass_s", "slow_pass_s",
              "fast_cost_s", "slow_cost_s"):
    median, low, high = record[key]
    assert low <= median <= high, key
  assert record["step_s"][0] > 0 and record["fast_pass_s"][0] > 0
  # Each evaluate call runs the passes it is compared with, and more.
  assert record["fast_calls"][0] > 0.5 and record["slow_calls"][0] > 0.5
  assert record["render_s"] > 0
  assert 0 < bench.figure_share(record, 20) <= record["share"] == 0.05
  assert bench.projected_ratio(record, 1000, 10000) > 0
