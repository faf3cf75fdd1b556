"""bin/train_lm's held-out evaluation (I58): which windows it scores, and
the mean cross entropy it reports of them.

`bin/train_lm` defines flags whose names `bin/train` defines too, so it is
imported in a child process of its own, which answers in JSON.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.io import tokens
from decompax.targets import text_lm

PRESET = text_lm.LmPreset("t", n_layers=1, d_model=8, d_ff=16, n_heads=2,
                          vocab_size=11, seq_len=4, batch_size=2,
                          num_steps=2, lr=1e-2, warmup_steps=0)
LIMITS = (0, 4, 10, 64)

CHILD = """
import json, sys
import jax
import jax.numpy as jnp
import numpy as np
from decompax.bin import train_lm
from decompax.io import tokens
from decompax.targets import text_lm

ask = json.load(sys.stdin)
held_out = tokens.open_tokens(ask["tokens"])
starts = {limit: train_lm.eval_windows(held_out, 2, limit)[:, 0].tolist()
          for limit in ask["limits"]}
preset = text_lm.LmPreset(**ask["preset"])
weights = text_lm.init(jax.random.key(0), preset)
windows = np.asarray(ask["windows"], np.int32)
score = train_lm.make_scorer(preset, 2)(weights, windows)
print(json.dumps({"starts": starts, "score": score}))
"""


def _windows():
  """Three random `[seq_len + 1]` windows: one full forward and one short."""
  return np.random.default_rng(0).integers(
    0, PRESET.vocab_size, (3, PRESET.seq_len + 1))


@pytest.fixture(scope="module")
def answer(tmp_path_factory):
  # One held-out document 0..19 then EOS 20: ids equal offsets, so a
  # window's first id is where it starts.
  path = tmp_path_factory.mktemp("held_out") / "held_out.bin"
  tokens.write_tokens(path, [np.arange(20)], 32, 20, "test")
  ask = {"tokens": str(path), "limits": LIMITS,
         "preset": dataclasses.asdict(PRESET), "windows": _windows().tolist()}
  done = subprocess.run(
    [sys.executable, "-P", "-c", CHILD], input=json.dumps(ask),
    capture_output=True, text=True, timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-2000:]
  return json.loads(done.stdout.splitlines()[-1])


def test_limited_eval_windows_are_spread_over_the_held_out_split(answer):
  # 21 tokens hold 10 windows of 2 + 1 (starts 0, 2, …, 18); a limit of 4
  # takes windows ⌊i·10/4⌋ = 0, 2, 5, 7, not the first four.
  every = list(range(0, 20, 2))
  assert answer["starts"] == {"0": every, "4": [0, 4, 10, 14],
                              "10": every, "64": every}


def test_the_scorer_is_the_training_loss_on_the_same_windows(answer):
  # The mean over every predicted token: t per [t + 1] window, whatever
  # the batching (here 2 + 1 windows).
  weights = text_lm.init(jax.random.key(0), PRESET)
  want = text_lm.loss(weights, jnp.asarray(_windows(), jnp.int32),
                      text_lm.model_config(PRESET))
  assert answer["score"] == pytest.approx(float(want), rel=1e-5)
