"""The arithmetic toy: its vocabulary, prompts, grid, registry entry and
(slow) its training."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.targets import arithmetic, glu_config, registry
from decompax.targets import toy_training as train_lib

CONFIG = arithmetic.ArithmeticConfig()
P = CONFIG.modulus


def test_vocabulary_layout():
  strings = arithmetic.token_strings(CONFIG)
  assert len(strings) == CONFIG.model.vocab_size == 32
  assert strings[:P] == tuple(str(i) for i in range(P))
  assert strings[P:P + 3] == ("+", "-", "=")
  assert [arithmetic.operator_token(CONFIG, i) for i in (0, 1)] == [P, P + 1]
  assert arithmetic.equals_token(CONFIG) == P + 2
  assert strings[P + 3:P + 5] == ("<unk>", "<eos>")
  assert len(set(strings)) == len(strings)


def test_config_refuses_a_vocabulary_too_small():
  small = dataclasses.replace(CONFIG.model, vocab_size=P + 2)
  with pytest.raises(ValueError, match="vocab_size"):
    arithmetic.ArithmeticConfig(model=small)
  exact = dataclasses.replace(CONFIG.model, vocab_size=P + 3)
  config = arithmetic.ArithmeticConfig(model=exact)
  assert arithmetic.token_strings(config)[-1] == "="


def test_task_batch_answers_modulo_p():
  batch = jax.jit(
    lambda k: arithmetic.task_batch(k, CONFIG, 256))(jax.random.key(0))
  a, op, b = map(np.asarray, arithmetic.operands(batch, CONFIG))
  tokens = np.asarray(batch)
  assert tokens.shape == (256, arithmetic.PROMPT_LENGTH)
  assert tokens.dtype == np.int32
  assert set(np.unique(op)) == {0, 1}
  assert a.min() >= 0 and a.max() < P and b.min() >= 0 and b.max() < P
  assert (tokens[:, 3] == P + 2).all()
  want = np.where(op == 0, a + b, a - b) % P
  np.testing.assert_array_equal(arithmetic.answers(batch), want)
  assert tokens[:, 4].max() < P


def test_grid_is_operator_major_then_a_then_b():
  grid = np.asarray(arithmetic.grid_prompts(CONFIG))
  assert grid.shape == (2 * P * P, 5)
  assert len({tuple(r) for r in grid}) == 2 * P * P
  for op, a, b in [(0, 0, 0), (0, 3, 4), (1, 3, 4), (1, 0, 5), (1, 22, 22)]:
    row = grid[(op * P + a) * P + b]
    c = (a + b) % P if op == 0 else (a - b) % P
    np.testing.assert_array_equal(row, [a, P + op, b, P + 2, c])


def test_other_batch_copies_over_the_vocabulary():
  tokens = arithmetic.other_batch(jax.random.key(1), CONFIG, 16)
  assert tokens.shape == (16, CONFIG.seq_len)
  assert int(tokens.max()) >= P + 3  # extra tokens occur
  assert CONFIG.copying.model == CONFIG.model


@pytest.fixture(scope="module")
def toy():
  return registry.get("addsub")


def test_registry_entry_and_subset_layout(toy):
  assert "addsub" in registry.toy_names()
  weights = jax.jit(toy.init)(jax.random.key(0))
  assert toy.missing_features(weights) == (0,)  # untrained: no answers
  tokens = toy.sample_inputs(jax.random.key(1), 3)
  assert tokens.shape == (3, arithmetic.PROMPT_LENGTH)
  specs = toy.sites(8)
  assert len(specs) == 7 * CONFIG.model.n_layers
  subset = tuple(s for s in specs if s.name.startswith("layers.1."))
  fns = registry.fns_for(toy, 8, subset)
  split = registry.weights_for(toy, weights, subset)
  assert split.prefix.ln1.shape[0] == 1 and split.tail is None

  @jax.jit
  def run():
    return (toy.fns(8).clean_forward(weights, tokens, ())[0],
            fns.clean_forward(split, tokens, ())[0])

  a, b = run()
  np.testing.assert_allclose(a, b, atol=1e-5)
  restored = toy.weights_from_arrays(toy.weights_to_arrays(weights))
  assert all(jax.tree.leaves(jax.tree.map(jnp.array_equal, restored,
                                          weights)))


def test_a_few_training_steps_lower_the_loss():
  # A narrow model: compile time, not width, is what this costs.
  model = glu_config.GluConfig(
    n_layers=1, d_model=16, n_heads=2, n_kv_heads=2, head_dim=8, d_ff=16,
    vocab_size=8, rope_theta=10000.0, rms_eps=1e-6, tied=False,
    qk_norm=False, family="toy", max_position=16)
  config = arithmetic.ArithmeticConfig(
    modulus=5, model=model, seq_len=8, min_repeat=2, max_repeat=4,
    batch_size=16, other_batch_size=4,
    training=train_lib.TargetTraining(steps=8, lr=1e-2, chunk_steps=4))
  losses = []
  arithmetic.train(jax.random.key(0), config,
                   lambda step, loss: losses.append(loss))
  assert len(losses) == 2 and np.isfinite(losses).all()
  assert losses[1] < losses[0]


@pytest.mark.slow
def test_default_seed_reaches_both_bars(toy):
  weights = toy.train(toy.default_seed)
  answer, copy = arithmetic.accuracy(weights, CONFIG)
  assert answer >= CONFIG.min_answer_accuracy
  assert copy >= CONFIG.min_induction_accuracy
