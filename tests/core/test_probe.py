"""Toy recovery metrics (SPEC §10, §11)."""

import numpy as np

from decompax.core import probe


def _permuted_identity():
  ci = np.zeros((4, 7))
  cols = [5, 2, 6, 0]
  for row, col in enumerate(cols):
    ci[row, col] = 1.0
  return ci, cols


def test_identity_permutation_recovers_columns_then_rest():
  ci, cols = _permuted_identity()
  order = probe.identity_permutation(ci)
  assert order[:4] == cols and sorted(order) == list(range(7))


def test_identity_error_is_zero_for_identity_and_counts_breaks():
  ci, _ = _permuted_identity()
  assert probe.identity_ci_error(ci) == 0
  broken = ci.copy()
  broken[0, 1] = 0.5   # an extra active component
  broken[3, 0] = 0.7   # a weak diagonal entry
  assert probe.identity_ci_error(broken) == 2


def test_dense_error():
  ci = np.zeros((3, 5))
  ci[:, 2] = 1.0
  assert probe.dense_ci_error(ci, k=1) == 0
  assert probe.dense_ci_error(ci, k=2) == 1
  ci[1, 4] = 0.3
  assert probe.dense_ci_error(ci, k=1) == 1


def test_alive_and_active_features():
  ci, cols = _permuted_identity()
  assert probe.alive_components(ci) == sorted(cols)
  assert probe.active_features(ci)[5] == [0]


def test_permutation_recovers_permuted_identity_with_dead_columns():
  n, c = 4, 7
  rng = np.random.default_rng(0)
  perm = rng.permutation(c)
  ci = np.zeros((n, c), np.float32)
  ci[np.arange(n), perm[:n]] = 1.0
  order = probe.identity_permutation(ci)
  assert order[:n] == [int(p) for p in perm[:n]]
  assert sorted(order) == list(range(c))
  np.testing.assert_array_equal(ci[:, order][:, :n], np.eye(n))


def test_permutation_puts_leftovers_by_descending_max():
  ci = np.array([[0.9, 0.0, 0.2, 0.5]], np.float32)
  assert probe.identity_permutation(ci) == [0, 3, 2, 1]


def test_permutation_more_rows_than_columns():
  ci = np.eye(5, 3, dtype=np.float32)
  assert probe.identity_permutation(ci) == [0, 1, 2]
