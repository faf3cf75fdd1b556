"""CI counts on cases with known answers (SPEC §11)."""

import jax.numpy as jnp
import numpy as np

from decompax.measures import ci_counts


def test_firing_counts_count_positions_above_threshold():
  ci = jnp.array([[[0.0, 0.2], [0.5, 0.1]], [[0.11, 1.0], [0.0, 0.0]]])
  np.testing.assert_array_equal(ci_counts.firing_counts(ci, 0.1), [2, 2])


def test_histograms_add_up_exactly_over_batches():
  rng = np.random.default_rng(0)
  batches = [rng.normal(0.3, 2.0, size=(7, 5)).astype(np.float32)
             for _ in range(4)]
  batches[0][0, :3] = [ci_counts.PRE_EDGES[0], ci_counts.PRE_EDGES[-1], 100.0]
  edges = ci_counts.PRE_EDGES
  total = sum(np.asarray(ci_counts.histogram_counts(jnp.asarray(b), edges),
                         np.int64) for b in batches)
  everything = np.concatenate([b.reshape(-1) for b in batches])
  inside, _ = np.histogram(everything, edges)
  np.testing.assert_array_equal(total[1:-1], inside)
  assert total[0] == np.sum(everything < edges[0])
  assert total[-1] == np.sum(everything > edges[-1])
  assert total.sum() == everything.size


def test_lower_histogram_puts_one_in_the_last_bin():
  counts = ci_counts.histogram_counts(jnp.array([0.0, 1.0, 1.0, 0.5]),
                                      ci_counts.LOWER_EDGES)
  assert int(counts[0]) == 0 and int(counts[-1]) == 0
  assert int(counts[1]) == 1 and int(counts[-2]) == 2


def test_log_density_bands():
  ci = jnp.array([[0.0, 1.0], [1e-10, 0.5], [1e-5, 1e-9]])
  counts = np.asarray(ci_counts.log_density_counts(ci, n_bins=9))
  # Component 0: two below 1e-9, one in the band [1e-5, 1e-4).
  assert counts[0, 0] == 2 and counts[0, 1 + 4] == 1
  # Component 1: 1 and 0.5 in the top band, 1e-9 in the bottom one.
  assert counts[1, 9] == 2 and counts[1, 1] == 1
  assert counts.sum() == ci.size


def test_top_positions_are_each_components_largest():
  ci = jnp.array([[[0.1, 0.9], [0.7, 0.2]], [[0.3, 0.0], [0.8, 0.95]]])
  values, index = ci_counts.top_positions(ci, 2)
  np.testing.assert_allclose(values, [[0.8, 0.7], [0.95, 0.9]])
  np.testing.assert_array_equal(index, [[3, 1], [3, 0]])
