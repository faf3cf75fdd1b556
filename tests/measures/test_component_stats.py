"""The per-batch statistics of `measures/component_stats.py` against direct
computation."""

import jax
import numpy as np
import pytest

from decompax.measures import component_stats


def direct_windows(tokens, ci, flat_index, before, after):
  """Each window by Python loops over components, top positions and
  offsets."""
  b, t = tokens.shape
  c, k = flat_index.shape
  w = before + after + 1
  window = np.full((c, k, w), component_stats.NO_TOKEN, tokens.dtype)
  window_ci = np.zeros((c, k, w), np.float32)
  for i in range(c):
    for j in range(k):
      row, column = divmod(int(flat_index[i, j]), t)
      for o in range(w):
        at = column - before + o
        if 0 <= at < t:
          window[i, j, o] = tokens[row, at]
          window_ci[i, j, o] = ci[row, at, i]
  return window, window_ci


@pytest.mark.parametrize("windows", [
  component_stats.token_windows, component_stats.sliced_windows,
  component_stats.selected_windows])
@pytest.mark.parametrize("before, after", [(3, 2), (0, 0), (7, 0), (0, 9)])
def test_token_windows_match_direct_computation_at_the_sequence_ends(
    windows, before, after):
  """Each platform's computation, called directly: the CPU runs only its
  own through `token_windows`."""
  rng = np.random.default_rng(before * 10 + after)
  b, t, c, k = 3, 8, 5, 4
  tokens = rng.integers(0, 50, (b, t)).astype(np.int32)
  ci = rng.random((b, t, c)).astype(np.float32)
  # Every first and last position of a sequence among the top positions,
  # where windows run past the ends.
  ends = np.array([0, t - 1, t, 2 * t - 1, 2 * t, b * t - 1])
  flat_index = np.stack([rng.permutation(np.concatenate(
    [ends, rng.integers(0, b * t, 4)]))[:k] for _ in range(c)])
  got = jax.jit(windows, static_argnums=(3, 4))(
    tokens, ci, flat_index.astype(np.int32), before, after)
  want = direct_windows(tokens, ci, flat_index, before, after)
  np.testing.assert_array_equal(np.asarray(got[0]), want[0])
  np.testing.assert_array_equal(np.asarray(got[1]), want[1])
