"""bench/steps_per_call.py: every size's call runs its steps, the table
holds one row per size with its speed-up over one step per call, and the
states after a common number of steps are bitwise equal (I57)."""

import pytest

# A bench's own run, a minute on two cores: its property (the harvest
# compiles once; k steps a call are bitwise one) has fast tests of its own
# (tests/analysis/test_harvesting.py, tests/core/test_train_step.py).
pytestmark = pytest.mark.slow

TINY = "tms_5-2+--batch_size=16+--c=6+--ci_hidden=4"


@pytest.fixture(scope="module")
def bench(load_bench):
  return load_bench("steps_per_call")


def test_each_size_times_whole_calls_and_matches_one_per_call(bench):
  run = bench.build(TINY)
  calls = bench.compile_calls(run, [1, 2, 4])
  seconds = {}
  for k, call in calls.items():
    per_step, timed = bench.time_calls(call, bench.copy_state(run.state), k,
                                       steps=3)
    assert per_step > 0
    assert timed == (3 if k == 1 else 4)  # whole calls
    seconds[k] = [per_step]
  finals = bench.final_states(run, calls, 4)
  equal = {k: bench.bitwise_equal(finals[k], finals[1]) for k in calls}
  assert equal == {1: True, 2: True, 4: True}
  lines = bench.rows(seconds, {**equal, 4: False})
  assert [line.split(" | ")[0] for line in lines] == ["| 1", "| 2", "| 4"]
  assert "| 1.00× | yes |" in lines[0] and lines[2].endswith("| NO |")


def test_the_sizes_start_with_the_baseline(bench):
  assert bench.parse_sizes(["1", "8", "64"]) == [1, 8, 64]
  for bad in (["8", "64"], ["1", "0"], ["1", "x"]):
    with pytest.raises(ValueError, match="starting with 1"):
      bench.parse_sizes(bad)
