"""The batches a harvest streams from a token file: spread windows tile the
file without overlap, an older harvest's windows are drawn by seed and
batch, and a batch's positions run along each window."""

import dataclasses

import numpy as np

from decompax.analysis import harvest_batches, harvest_settings

SETTINGS = harvest_settings.Settings(
  data_path="tokens", n_batches=3, batch_size=4, seq_len=5, top_k=2,
  before=1, after=1, threshold=0.0, ablation_batches=0, seed=7,
  decomposition_step=10, windows=harvest_settings.SPREAD)
NUM_TOKENS = 100


def test_spread_windows_tile_the_file_without_overlap():
  starts = np.concatenate([
    harvest_batches.window_starts(SETTINGS, i, NUM_TOKENS)
    for i in range(SETTINGS.n_batches)])
  assert len(starts) == SETTINGS.n_batches * SETTINGS.batch_size
  ordered = np.sort(starts)
  assert np.all(np.diff(ordered) >= SETTINGS.seq_len)
  assert ordered[0] >= 0 and ordered[-1] + SETTINGS.seq_len <= NUM_TOKENS


def test_older_windows_are_drawn_by_seed_and_batch():
  older = dataclasses.replace(SETTINGS, windows="")
  first = harvest_batches.window_starts(older, 0, NUM_TOKENS)
  np.testing.assert_array_equal(
    first, harvest_batches.window_starts(older, 0, NUM_TOKENS))
  assert not np.array_equal(
    first, harvest_batches.window_starts(older, 1, NUM_TOKENS))
  assert np.all(first + SETTINGS.seq_len <= NUM_TOKENS)


def test_a_batchs_positions_run_along_its_windows():
  positions = harvest_batches.window_positions(SETTINGS, 1, NUM_TOKENS)
  starts = harvest_batches.window_starts(SETTINGS, 1, NUM_TOKENS)
  assert positions.shape == (SETTINGS.batch_size, SETTINGS.seq_len)
  np.testing.assert_array_equal(positions,
                                starts[:, None] + np.arange(5)[None])
