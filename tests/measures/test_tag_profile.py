"""Tag statistics equal direct sums over positions, add across batches and
keep what a document bootstrap needs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.measures import tag_profile

N_TAGS, N_CLASSES, N_GROUPS = 7, 3, 2
COARSE_OF = np.asarray([0, 0, 1, 1, 2, 2, 2], np.int32)


def _case(seed: int, b: int = 2, t: int = 5, u: int = 4):
  rng = np.random.default_rng(seed)
  activity = rng.uniform(0, 1, (b, t, u)) * (rng.uniform(size=(b, t, u)) > .4)
  tags = rng.integers(0, N_TAGS, (b, t))
  previous = rng.integers(0, N_TAGS, (b, t))
  group = rng.integers(0, N_GROUPS, (b, t))
  return (activity.astype(np.float32), tags.astype(np.int32),
          previous.astype(np.int32), group.astype(np.int32))


def _direct(activity, tags, previous, group):
  """The statistics by a loop over positions."""
  u = activity.shape[-1]
  want = tag_profile.zero_tag_stats(u, N_TAGS, N_CLASSES, N_GROUPS)
  fine, coarse, bigram, base_fine, base_coarse = (x.copy() for x in want)
  for p in np.ndindex(tags.shape):
    t, c, g = tags[p], COARSE_OF[tags[p]], group[p]
    fine[:, t] += activity[p]
    coarse[g, :, c] += activity[p]
    bigram[:, COARSE_OF[previous[p]], c] += activity[p]
    base_fine[t] += 1
    base_coarse[g, c] += 1
  return tag_profile.TagStats(fine, coarse, bigram, base_fine, base_coarse)


def _batch(activity, tags, previous, group, dense=None):
  fn = jax.jit(tag_profile.batch_tag_stats, static_argnums=(5, 6, 7))
  return fn(jnp.asarray(activity), jnp.asarray(tags), jnp.asarray(previous),
            jnp.asarray(group), jnp.asarray(COARSE_OF), N_CLASSES, N_GROUPS,
            dense)


# The sums by scatter (a CPU's choice) and by one-hot products (an
# accelerator's, `tag_profile.dense_sums`), both run here.
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_batch_statistics_equal_the_direct_sums(seed, dense):
  case = _case(seed)
  got, want = _batch(*case, dense=dense), _direct(*case)
  for name, g, w in zip(tag_profile.TagStats._fields, got, want):
    assert g.shape == w.shape, name
    np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-6,
                               err_msg=name)
  assert got.base_fine.dtype == jnp.int32


def test_batches_add_up_to_the_whole():
  case = _case(2, b=4)
  whole = _direct(*case)
  total = tag_profile.zero_tag_stats(4, N_TAGS, N_CLASSES, N_GROUPS)
  for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):
    total = tag_profile.add_tag_stats(
      total, _batch(*(x[rows] for x in case)))
  for name, t, w in zip(tag_profile.TagStats._fields, total, whole):
    assert t.dtype == (np.int64 if name.startswith("base") else np.float64)
    np.testing.assert_allclose(t, w, rtol=1e-6, atol=1e-6, err_msg=name)


def test_mass_and_class_counts_are_the_fine_sums_folded():
  stats = _direct(*_case(3))
  np.testing.assert_allclose(tag_profile.unit_mass(stats),
                             stats.fine.sum(1))
  folded = np.stack([stats.fine[:, COARSE_OF == c].sum(1)
                     for c in range(N_CLASSES)], axis=1)
  np.testing.assert_allclose(tag_profile.class_counts(stats), folded)
  np.testing.assert_allclose(stats.bigram.sum(1), folded)


def test_concat_and_select_units():
  case = _case(4)
  a = _direct(case[0][..., :2], *case[1:])
  b = _direct(case[0][..., 2:], *case[1:])
  both = tag_profile.concat_units([a, b])
  whole = _direct(*case)
  for g, w in zip(both, whole):
    np.testing.assert_allclose(g, w)
  picked = tag_profile.select_units(whole, np.asarray([False, True, True,
                                                       False]))
  np.testing.assert_allclose(picked.coarse, whole.coarse[:, 1:3])
  np.testing.assert_allclose(picked.bigram, whole.bigram[1:3])
  other = _direct(*_case(5))
  with pytest.raises(ValueError, match="different positions"):
    tag_profile.concat_units([a, other])


def test_position_tags_and_groups_read_the_stream():
  stream = np.asarray([5, 1, 2, 0, 3, 4, 0], np.uint16)
  index = np.asarray([[0, 1, 2], [4, 5, 6]])
  tags, prev = tag_profile.position_tags(stream, index, before_start=0)
  np.testing.assert_array_equal(tags, [[5, 1, 2], [3, 4, 0]])
  np.testing.assert_array_equal(prev, [[0, 5, 1], [0, 3, 4]])
  starts = np.asarray([0, 4, 6])  # three documents
  np.testing.assert_array_equal(
    tag_profile.position_groups(starts, index, 2), [[0, 0, 0], [1, 1, 0]])
  np.testing.assert_array_equal(
    tag_profile.position_groups(starts, index, 8), [[0, 0, 0], [1, 1, 2]])
