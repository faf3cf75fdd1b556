"""bench/cluster_time.py: its synthetic firing has the groups it claims, and
clustering it finds them."""

import numpy as np
import pytest

from decompax.analysis import clustering


@pytest.fixture(scope="module")
def bench(load_bench):
  return load_bench("cluster_time")


def test_the_synthetic_groups_are_found(bench):
  fired, group = bench.synthetic_firing(0, 40, 20_000)
  assert fired.shape == (20_000, 40) and group.shape == (40,)
  found = clustering.cluster_site(clustering.counts_from_firing(fired))
  assert bench.scores(found, group)[1] == 1.0
  # The one mixed cluster joins two components that fire a handful of
  # times: too rare for their firing to say they are apart (§15.1).
  counts = fired.sum(axis=0)
  mixed = [c for c in found.clusters if len(set(group[list(c)])) > 1]
  assert len(mixed) == 1 and counts[list(mixed[0])].max() <= 5


def test_scores_count_split_and_mixed_groups(bench):
  group = np.asarray([0, 0, 1, 1])
  split = clustering.SiteClusters(((0,), (1,), (2, 3)), (1.0,) * 3, (), 0, 0)
  mixed = clustering.SiteClusters(((0, 2), (1, 3)), (1.0,) * 2, (), 0, 0)
  assert bench.scores(split, group) == (1.0, 0.5)
  assert bench.scores(mixed, group) == (0.0, 0.0)
