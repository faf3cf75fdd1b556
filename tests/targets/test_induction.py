"""The induction toy: its data, its registry entry, and (slow) its training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.targets import glu_weights, induction, registry

CONFIG = induction.InductionConfig()


def test_predictable_tokens_continue_an_earlier_occurrence():
  tokens, predictable = jax.jit(
    lambda k: induction.induction_batch(k, CONFIG, 64))(jax.random.key(0))
  tokens, predictable = np.asarray(tokens), np.asarray(predictable)
  assert tokens.shape == (64, CONFIG.seq_len) and tokens.dtype == np.int32
  counts = predictable.sum(axis=1)
  assert counts.min() >= CONFIG.min_repeat - 2
  assert counts.max() <= CONFIG.max_repeat - 1
  for row, mask in zip(tokens, predictable):
    for t in np.flatnonzero(mask):
      earlier = [s for s in range(t) if row[s] == row[t]
                 and row[s + 1] == row[t + 1]]
      assert earlier, (row, t)


@pytest.fixture(scope="module")
def toy():
  return registry.get("induction")


def test_registry_entry_and_subset_layout(toy):
  weights = jax.jit(toy.init)(jax.random.key(0))
  assert toy.missing_features(weights) == (0,)  # untrained: no copying
  tokens = toy.sample_inputs(jax.random.key(1), 3)
  assert tokens.shape == (3, CONFIG.seq_len)
  specs = toy.sites(8)
  assert len(specs) == 7 * CONFIG.model.n_layers
  subset = tuple(s for s in specs if s.name.startswith("layers.1.mlp"))
  fns = registry.fns_for(toy, 8, subset)
  assert [s.row for s in fns.sites] == [0, 0, 0]
  split = registry.weights_for(toy, weights, subset)
  assert split.prefix.ln1.shape[0] == 1 and split.tail is None
  full = toy.fns(8)

  @jax.jit
  def run():
    return (full.clean_forward(weights, tokens, ())[0],
            fns.clean_forward(split, tokens, ())[0])

  a, b = run()
  np.testing.assert_allclose(a, b, atol=1e-5)
  restored = toy.weights_from_arrays(toy.weights_to_arrays(weights))
  assert all(jax.tree.leaves(jax.tree.map(jnp.array_equal, restored,
                                          weights)))
  assert glu_weights.site_name(1, "q") in {s.name for s in specs}


@pytest.mark.slow
def test_default_seed_learns_to_copy(toy):
  weights = toy.train(toy.default_seed)
  assert induction.accuracy(weights, CONFIG) >= CONFIG.min_accuracy
