"""bench/harvest_speed.py measures a tagged harvest of the random model it
builds and its clean forward in one run."""

import pytest

# A bench's own run, a minute on two cores: its property (the harvest
# compiles once; k steps a call are bitwise one) has fast tests of its own
# (tests/analysis/test_harvesting.py, tests/core/test_train_step.py).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench(load_bench):
  return load_bench("harvest_speed")


def test_a_tagged_harvest_and_its_clean_forward_are_timed(bench):
  record = bench.measure(3, 4, 8, 4, 1, True, preset="tiny")
  assert record["batches"] == 3 and record["sites"] == 3
  assert record["harvest_batches_per_s"] > 0
  assert record["clean_batches_per_s"] > 0
  assert record["ratio_to_clean"] == pytest.approx(
    record["harvest_batches_per_s"] / record["clean_batches_per_s"])
  assert "tags" in record and record["wall_s"] > 0
