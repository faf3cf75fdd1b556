"""A harvest's running totals: the components that fired on a batch, the
ablation sums over the positions where each fires, and chunks padded to
one compiled size."""

import types

import numpy as np

from decompax.analysis import explore, harvest_accumulate
from decompax.core import sites as sites_lib

SITES = (sites_lib.SiteSpec("a", "a", 0, 2, 2, 3),
         sites_lib.SiteSpec("b", "b", 0, 2, 2, 2))
# Only the site table is read: the rest of a run stays unset.
RUN = explore.LoadedRun(None, types.SimpleNamespace(sites=SITES), None, None,
                        None, None)
CI = {"a": np.array([[0.0, 0.9, 0.0], [0.0, 0.2, 0.7]]),
      "b": np.array([[0.0, 0.0], [0.0, 0.0]])}


def test_fired_components_are_those_above_threshold_somewhere():
  site_of, index_of = harvest_accumulate.fired_components(RUN, CI, 0.5)
  np.testing.assert_array_equal(site_of, [0, 0])
  np.testing.assert_array_equal(index_of, [1, 2])


def test_an_ablation_adds_its_divergence_where_its_component_fires():
  sums = harvest_accumulate.empty_ablation(RUN)
  assert set(sums) == {"a", "b"}
  divergence = np.array([[1.0, 2.0], [3.0, 4.0]])  # per listed component
  harvest_accumulate.add_ablation(sums, RUN, np.array([0, 0]),
                                  np.array([1, 2]), divergence, CI, 0.5)
  # Component 1 fires at position 0 only, component 2 at position 1 only.
  np.testing.assert_array_equal(sums["a"]["ablation_sum"], [0.0, 1.0, 4.0])
  np.testing.assert_array_equal(sums["a"]["ablation_count"], [0, 1, 1])
  np.testing.assert_array_equal(sums["b"]["ablation_count"], [0, 0])


def test_a_chunk_pads_with_its_last_entry():
  np.testing.assert_array_equal(
    harvest_accumulate.padded(np.array([4, 7]), 5), [4, 7, 7, 7, 7])
  np.testing.assert_array_equal(
    harvest_accumulate.padded(np.array([4, 7]), 2), [4, 7])
