"""The faithfulness warmup (`core.warmup`): chunks change nothing, and the
host may end it between chunks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import warmup
from decompax.core.sites import Factors


def _loss(components, w_stacks):
  f = components["k"]
  return jnp.mean((f.v @ f.u - w_stacks["k"]) ** 2)


@pytest.fixture(scope="module")
def problem():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  components = {"k": Factors(jax.random.normal(k1, (2, 6, 4)),
                             jax.random.normal(k2, (2, 4, 5)))}
  return components, {"k": jax.random.normal(k3, (2, 6, 5))}


def _warm(problem, n_steps, between=None):
  components, w_stacks = problem
  return warmup.faithfulness_warmup(_loss, components, w_stacks, n_steps,
                                    1e-2, 0.0, between)


def test_chunks_give_the_one_loop_result_bit_for_bit(problem):
  whole, losses = _warm(problem, 23)
  lengths = iter([2, 1, 7, 3, 100])
  seen = []

  def between(done, seconds):
    assert seconds >= 0
    seen.append(done)
    return next(lengths)

  chunked, chunk_losses = _warm(problem, 23, between)
  assert seen == [1, 3, 4, 11, 14]  # the first chunk is one step
  jax.tree.map(np.testing.assert_array_equal, chunked, whole)
  np.testing.assert_array_equal(chunk_losses, losses)
  assert losses.shape == (23,) and losses[-1] < losses[0]


def test_the_host_ends_the_warmup_at_a_step_boundary(problem):
  class Stop(Exception):
    pass

  def between(done, seconds):
    del seconds
    if done >= 4:
      raise Stop(done)
    return 1

  with pytest.raises(Stop, match="4"):
    _warm(problem, 10**6, between)


@pytest.mark.parametrize("seconds, length", [(0.01, 8), (0.4, 4), (3.0, 2)])
def test_chunks_grow_while_short_and_shrink_while_long(seconds, length):
  assert warmup.next_chunk(4, seconds, target=0.5) == length
  assert warmup.next_chunk(1, 10.0) == 1
