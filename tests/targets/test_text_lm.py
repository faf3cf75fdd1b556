"""targets/text_lm: the text LM trainer's optimizer (I58) and its
schedule, down to one step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decompax.targets import text_lm

PRESET = text_lm.LmPreset("t", n_layers=1, d_model=4, d_ff=8, n_heads=2,
                          vocab_size=7, seq_len=3, batch_size=2,
                          num_steps=10, lr=0.1, warmup_steps=1,
                          weight_decay=0.5)
TINY = text_lm.PRESETS["tiny"]


def test_weight_decay_shrinks_stacked_leaves_and_spares_the_final_norm():
  """Two zero-gradient updates: Adam's part is 0, so only the decay moves
  the weights, at the second step's learning rate (the first's is 0 by
  the warmup). A matrix, and a per-layer norm (stacked `[layer, d]`),
  shrink by `1 − lr·wd`; the final norm keeps its scale."""
  weights = text_lm.init(jax.random.key(0), PRESET)
  opt = text_lm.optimizer(PRESET)
  zeros = jax.tree.map(jnp.zeros_like, weights)
  _, state = opt.update(zeros, opt.init(weights), weights)
  updates, _ = opt.update(zeros, state, weights)
  after = optax.apply_updates(weights, updates)
  shrink = 1 - PRESET.lr * PRESET.weight_decay
  np.testing.assert_allclose(after.embed, weights.embed * shrink, rtol=1e-6)
  np.testing.assert_allclose(after.span.q, weights.span.q * shrink,
                             rtol=1e-6)
  np.testing.assert_array_equal(after.norm, weights.norm)
  np.testing.assert_allclose(after.span.ln1, weights.span.ln1 * shrink,
                             rtol=1e-6)


@pytest.mark.parametrize("num_steps", [1, 2, 40])
def test_the_schedule_starts_at_zero_unless_one_step_is_all(num_steps):
  preset = dataclasses.replace(
    TINY, num_steps=num_steps,
    warmup_steps=min(TINY.warmup_steps, num_steps - 1))
  state = text_lm.init_state(jax.random.key(0), preset)
  window = jnp.asarray(np.arange(2 * 33).reshape(2, 33) % 300, jnp.int32)
  after, loss = jax.jit(text_lm.make_train_step(preset))(state, window)
  assert np.isfinite(float(loss))
  moved = not np.allclose(after.weights.embed, state.weights.embed)
  # A warmup's first update is at lr 0; a one-step run's one step trains.
  assert moved == (num_steps == 1)
