"""A transcoder's evaluation: its latents' unit statistics are the tag
sums and token-implied class mix of their activity, batches add up, and
the results table shows each layer's row and the whole model's line."""

import jax.numpy as jnp
import numpy as np

from decompax.analysis import transcoder_eval
from decompax.targets import brown_tags

N_TAGS = len(brown_tags.COARSE) + 2
N_CLASSES = len(brown_tags.COARSE)
# Token 0 is always class 0, token 1 class 1 half the time.
MIX = jnp.zeros((2, N_CLASSES)).at[0, 0].set(1.0).at[1, :2].set(0.5)


def test_a_latents_fine_sums_are_its_activity_per_tag():
  activity = jnp.asarray([[[1.0, 0.0], [2.0, 3.0], [0.5, 0.0]]])
  tags = jnp.asarray([[0, 1, 0]])
  coarse_of = jnp.arange(N_TAGS) % len(brown_tags.COARSE)
  stats = transcoder_eval.unit_statistics(
    activity, (tags, tags, jnp.zeros_like(tags)), coarse_of, 1, tags, MIX)
  fine = np.asarray(stats.tags.fine)
  np.testing.assert_allclose(fine[:, 0], [1.5, 0.0])
  np.testing.assert_allclose(fine[:, 1], [2.0, 3.0])
  np.testing.assert_array_equal(fine[:, 2:], 0.0)
  np.testing.assert_array_equal(stats.context.on, [3, 1])
  # Each unit's activity times its tokens' class mix, summed.
  np.testing.assert_allclose(np.asarray(stats.context.implied)[:, :2],
                             [[1.5 + 1.0, 1.0], [1.5, 1.5]])


def test_batches_add_to_their_sum():
  zero = transcoder_eval.zero_units(2, N_TAGS, 1)
  assert zero.tags.fine.shape == (2, N_TAGS)
  activity = jnp.asarray([[[1.0, 2.0]]])
  tags = jnp.asarray([[1]])
  coarse_of = jnp.arange(N_TAGS) % len(brown_tags.COARSE)
  batch = transcoder_eval.unit_statistics(
    activity, (tags, tags, jnp.zeros_like(tags)), coarse_of, 1, tags, MIX)
  twice = transcoder_eval.add_units(
    transcoder_eval.add_units(zero, batch), batch)
  np.testing.assert_allclose(twice.tags.fine, 2 * np.asarray(batch.tags.fine))
  np.testing.assert_allclose(twice.context.implied,
                             2 * np.asarray(batch.context.implied))


def test_the_table_has_a_row_per_layer_and_the_models_line():
  record = {
    "layers": {3: {"k": 8, "ci_l0": 7.5, "latent_l0": 8.0, "fvu": 0.125,
                   "ce_spliced": 3.25, "ce_diff": 0.25}},
    "ce": {"clean": 3.0, "all": 3.5}, "positions": 64}
  table = transcoder_eval.results_table(record)
  row = "| 3 | 8 | 7.50 | 8.00 | 0.125 | 3.2500 | +0.2500 | — / — / — |"
  assert row in table
  assert ("Clean CE 3.0000; every layer's transcoder at once 3.5000 "
          "(+0.5000); the decomposition under its CI masks not measured, "
          "over 64 positions.") in table
