"""Token-implied purity and its excess: streamed sums equal the direct
computation, a context-selective unit scores a high excess and a
token-identity unit none."""

import jax.numpy as jnp
import numpy as np
import pytest

from decompax.measures import tag_context

N_CLASSES = 3


@pytest.fixture(scope="module")
def stream():
  """Token ids and classes: token 0 is a noun (class 0) or a verb (class
  1) half the time each; tokens 1 and 2 always class 2."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 3, size=400)
  classes = np.where(tokens == 0, rng.integers(0, 2, size=400), 2)
  return tokens, classes


def test_a_context_selective_unit_has_excess_and_a_token_unit_none(stream):
  tokens, classes = stream
  selective = ((tokens == 0) & (classes == 0)).astype(np.float64)
  identity = (tokens == 0).astype(np.float64)
  got = tag_context.unit_context_purity(
    np.stack([selective, identity], axis=1), tokens, classes, N_CLASSES)
  share = np.mean(classes[tokens == 0] == 0)  # token 0's noun share
  np.testing.assert_allclose(got.purity, [1.0, max(share, 1 - share)])
  np.testing.assert_allclose(got.implied_purity, max(share, 1 - share))
  assert got.excess[0] > 0.4
  assert abs(got.excess[1]) < 1e-12


def test_a_dead_unit_scores_nan(stream):
  tokens, classes = stream
  got = tag_context.unit_context_purity(np.zeros((len(tokens), 1)), tokens,
                                        classes, N_CLASSES)
  assert np.isnan(got.purity).all() and np.isnan(got.excess).all()


def test_streamed_batches_sum_to_the_direct_token_implied_profile(stream):
  tokens, classes = stream
  activity = np.random.default_rng(1).uniform(size=(len(tokens), 4))
  activity[activity < 0.5] = 0
  mix = tag_context.class_given_token(tag_context.token_class_counts(
    tokens, classes, 5, N_CLASSES))
  total = tag_context.zero_context_stats(4, N_CLASSES)
  for part in np.split(np.arange(len(tokens)), 4):
    batch = tag_context.batch_context_stats(
      jnp.asarray(activity[part].reshape(10, 10, 4), jnp.float32),
      jnp.asarray(tokens[part].reshape(10, 10)), jnp.asarray(mix))
    total = tag_context.add_context_stats(total, batch)
  want = np.zeros((4, N_CLASSES))
  for p in range(len(tokens)):
    for c in range(N_CLASSES):
      share = np.mean(classes[tokens == tokens[p]] == c)
      want[:, c] += activity[p] * share
  np.testing.assert_allclose(total.implied, want, rtol=1e-5)
  np.testing.assert_array_equal(total.on, (activity > 0).sum(axis=0))
  assert total.on.dtype == np.int64 and total.implied.dtype == np.float64
  direct = tag_context.unit_context_purity(activity, tokens, classes,
                                           N_CLASSES)
  counts = np.stack([activity[classes == c].sum(axis=0)
                     for c in range(N_CLASSES)], axis=1)
  streamed = tag_context.context_purity(counts, total.implied)
  np.testing.assert_allclose(streamed.excess, direct.excess, atol=1e-6)


def test_an_unseen_token_has_no_class_mix():
  mix = tag_context.class_given_token(tag_context.token_class_counts(
    np.array([0, 0, 2]), np.array([1, 0, 2]), 4, N_CLASSES))
  np.testing.assert_allclose(mix, [[0.5, 0.5, 0], [0, 0, 0], [0, 0, 1],
                                   [0, 0, 0]])
