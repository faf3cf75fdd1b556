"""Arithmetic toy: a two-layer GLU transformer trained here on `a ± b mod P`.

Two data streams share one model. The target stream is prompts of exactly
five tokens `[a, op, b, =, c]` with `c = (a op b) mod P`; the non-target
stream is the induction toy's copying sequences over the whole vocabulary
(`induction.induction_batch`), so a targeted decomposition finds both an
arithmetic circuit and an induction circuit in one model.

Vocabulary layout (fixed): ids `0 .. P-1` are the numbers, `P` is `+`,
`P+1` is `-`, `P+2` is `=`, and ids from `P+3` up to `vocab_size` are extra
tokens that only the copying stream uses (`token_strings` names them).
Position `i` of a forward predicts token `i+1`, so the answer `c` (token 4)
is the prediction at `ANSWER_POSITION = 3`, the `=` token.

The model is the GLU decoder of `glu_lm` at toy size, fp32, every layer in
the span stack, with the same site and weight functions as the induction
toy. Training is a pure function of the seed.
"""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Key

from decompax.core import sites, target
from decompax.targets import (
  glu_arrays, glu_config, glu_lm, glu_sites, glu_weights, induction)
from decompax.targets import toy_training as train_lib

OPERATORS = ("+", "-")
PROMPT_LENGTH = 5
# Position `i` predicts token `i+1`: the `=` at 3 predicts the answer at 4.
ANSWER_POSITION = 3
# Extra tokens past `=`: the first two are the tokenizer's unknown and
# end-of-sequence tokens, the rest fillers `<x0>`, `<x1>`, ...
_EXTRA_NAMES = ("<unk>", "<eos>")


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
  """Model, data and target-training settings of the arithmetic toy.

  `batch_size` prompts and `other_batch_size` copying sequences of
  `seq_len` tokens make one training step.
  """

  modulus: int = 23
  model: glu_config.GluConfig = glu_config.GluConfig(
    n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16, d_ff=128,
    vocab_size=32, rope_theta=10000.0, rms_eps=1e-6, tied=False,
    qk_norm=False, family="toy", max_position=64)
  seq_len: int = 32
  min_repeat: int = 4
  max_repeat: int = 12
  batch_size: int = 128
  other_batch_size: int = 32
  # Seed 0 reaches answer accuracy 1.00 and copying accuracy 0.92 in these
  # 2000 steps (about a minute on two shared CPU cores).
  training: train_lib.TargetTraining = train_lib.TargetTraining(
    steps=2000, lr=3e-3, schedule="cosine", chunk_steps=500)
  # Accuracy bars a trained target must reach: answers over every prompt,
  # next tokens at the copying stream's predictable positions.
  min_answer_accuracy: float = 0.95
  min_induction_accuracy: float = 0.9

  def __post_init__(self):
    if self.modulus < 2:
      raise ValueError(f"modulus must be at least 2, got {self.modulus}")
    if self.model.vocab_size < self.modulus + 3:
      raise ValueError(
        f"vocab_size {self.model.vocab_size} cannot hold {self.modulus} "
        f"numbers, {len(OPERATORS)} operators and '='")
    if self.model.max_position < max(self.seq_len, PROMPT_LENGTH):
      raise ValueError("max_position must cover seq_len")
    # Building the copying stream's settings checks them.
    _ = self.copying

  @property
  def copying(self) -> induction.InductionConfig:
    """Return the copying stream's settings over this model and vocab."""
    return induction.InductionConfig(
      model=self.model, seq_len=self.seq_len, min_repeat=self.min_repeat,
      max_repeat=self.max_repeat, batch_size=self.other_batch_size,
      min_accuracy=self.min_induction_accuracy)


def operator_token(config: ArithmeticConfig, op_index: int) -> int:
  """Return the token id of `OPERATORS[op_index]`."""
  return config.modulus + op_index


def equals_token(config: ArithmeticConfig) -> int:
  """Return the token id of `=`."""
  return config.modulus + len(OPERATORS)


def token_strings(config: ArithmeticConfig) -> tuple[str, ...]:
  """Return the string of every token id, in id order."""
  numbers = tuple(str(i) for i in range(config.modulus))
  n_extra = config.model.vocab_size - config.modulus - len(OPERATORS) - 1
  fillers = n_extra - len(_EXTRA_NAMES)
  extras = (*_EXTRA_NAMES, *(f"<x{i}>" for i in range(fillers)))
  return (*numbers, *OPERATORS, "=", *extras[:n_extra])


def prompts(
  a: Int[Array, "*n"], op_index: Int[Array, "*n"], b: Int[Array, "*n"],
  config: ArithmeticConfig,
) -> Int[Array, "*n 5"]:
  """Return the prompts `[a, op, b, =, c]` of operands and operator indices."""
  p = config.modulus
  c = jnp.where(op_index == 0, a + b, a - b) % p
  eq = jnp.full_like(a, equals_token(config))
  return jnp.stack([a, p + op_index, b, eq, c], axis=-1).astype(jnp.int32)


def task_batch(
  key: Key[Array, ""], config: ArithmeticConfig, batch_size: int
) -> Int[Array, "b 5"]:
  """Return prompts with `a`, `b` and the operator drawn uniformly."""
  a_key, op_key, b_key = jax.random.split(key, 3)
  p = config.modulus
  a = jax.random.randint(a_key, (batch_size,), 0, p)
  op = jax.random.randint(op_key, (batch_size,), 0, len(OPERATORS))
  b = jax.random.randint(b_key, (batch_size,), 0, p)
  return prompts(a, op, b, config)


def operands(
  tokens: Int[Array, "*n 5"], config: ArithmeticConfig
) -> tuple[Int[Array, "*n"], Int[Array, "*n"], Int[Array, "*n"]]:
  """Return `(a, op_index, b)` of prompts."""
  return tokens[..., 0], tokens[..., 1] - config.modulus, tokens[..., 2]


def answers(tokens: Int[Array, "*n 5"]) -> Int[Array, "*n"]:
  """Return the answer token `c` of prompts."""
  return tokens[..., ANSWER_POSITION + 1]


def grid_prompts(config: ArithmeticConfig) -> Int[Array, "n 5"]:
  """Return every prompt once, operator-major, then `a`, then `b`.

  Row `(op_index · P + a) · P + b` holds `a OPERATORS[op_index] b`.
  """
  p = config.modulus
  op, a, b = jnp.meshgrid(jnp.arange(len(OPERATORS)), jnp.arange(p),
                          jnp.arange(p), indexing="ij")
  return prompts(a.ravel(), op.ravel(), b.ravel(), config)


def other_batch(
  key: Key[Array, ""], config: ArithmeticConfig, batch_size: int
) -> Int[Array, "b t"]:
  """Return non-target sequences: induction copying over the vocabulary."""
  return induction.induction_batch(key, config.copying, batch_size)[0]


def sample_inputs(
  key: Key[Array, ""], config: ArithmeticConfig, batch_size: int
) -> Int[Array, "b 5"]:
  """Return a batch of task prompts (the decomposition's inputs)."""
  return task_batch(key, config, batch_size)


def init(key: Key[Array, ""],
         config: ArithmeticConfig) -> glu_weights.GluWeights:
  """Return untrained weights, every layer in the span stack."""
  return induction.init(key, config.copying)


def _logits(
  weights: glu_weights.GluWeights, tokens: Int[Array, "b t"],
  config: ArithmeticConfig,
) -> Float[Array, "b t vocab"]:
  n = config.model.n_layers
  spec = glu_lm.ForwardSpec(config.model, glu_weights.Segments(n, 0, n),
                            remat=False, unroll=True)
  return glu_lm.forward(weights, tokens, (), spec)[0]


def _nll(
  logits: Float[Array, "*n vocab"], labels: Int[Array, "*n"]
) -> Float[Array, "*n"]:
  log_p = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.take_along_axis(log_p, labels[..., None], axis=-1)[..., 0]


def _loss(
  params: glu_weights.GluWeights, fixed: None, key: Key[Array, ""],
  config: ArithmeticConfig,
) -> Float[Array, ""]:
  del fixed
  task_key, other_key = jax.random.split(key)
  task = task_batch(task_key, config, config.batch_size)
  answer_logits = _logits(params, task, config)[:, ANSWER_POSITION]
  answer_loss = jnp.mean(_nll(answer_logits, answers(task)))
  tokens, predictable = induction.induction_batch(
    other_key, config.copying, config.other_batch_size)
  # The last position's label wraps around; it is never predictable.
  labels = jnp.roll(tokens, -1, axis=1)
  nll = _nll(_logits(params, tokens, config), labels)
  copy_loss = jnp.sum(nll * predictable) / jnp.sum(predictable)
  # Every other position is scored too, so the model is calibrated where
  # the next token is random and the copying stream's cross entropy means
  # what a language model's loss means.
  calibration = jnp.mean(nll[:, :-1])
  return answer_loss + copy_loss + calibration


def train(
  key: Key[Array, ""], config: ArithmeticConfig,
  progress: Optional[train_lib.Progress] = None,
) -> glu_weights.GluWeights:
  """Return weights trained on answer CE plus copying CE."""
  init_key, data_key = jax.random.split(key)
  return train_lib.train(
    data_key, init(init_key, config), None,
    lambda p, f, k: _loss(p, f, k, config), config.training, progress)


def answer_accuracy(
  weights: glu_weights.GluWeights, config: ArithmeticConfig
) -> float:
  """Return the fraction of all prompts whose answer is the argmax."""
  grid = grid_prompts(config)
  spec = glu_lm.ForwardSpec(config.model, _segments_of(weights, config),
                            remat=False)
  logits = jax.jit(lambda w: glu_lm.forward(w, grid, (), spec)[0])(weights)
  hit = jnp.argmax(logits[:, ANSWER_POSITION], axis=-1) == answers(grid)
  return float(jnp.mean(hit))


def accuracy(
  weights: glu_weights.GluWeights, config: ArithmeticConfig
) -> tuple[float, float]:
  """Return `(answer accuracy over every prompt, copying accuracy)`."""
  return (answer_accuracy(weights, config),
          induction.accuracy(weights, config.copying))


def _segments_of(
  weights: glu_weights.GluWeights, config: ArithmeticConfig
) -> glu_weights.Segments:
  n = [0 if s is None else s.ln1.shape[0]
       for s in (weights.prefix, weights.span, weights.tail)]
  return glu_weights.Segments(config.model.n_layers, n[0], n[0] + n[1])


def missing_features(
  weights: glu_weights.GluWeights, config: ArithmeticConfig
) -> tuple[int, ...]:
  """Return `()` when both accuracies reach their bars, else `(0,)`."""
  answer, copy = accuracy(weights, config)
  passed = (answer >= config.min_answer_accuracy
            and copy >= config.min_induction_accuracy)
  return () if passed else (0,)


def site_specs(
  config: ArithmeticConfig, c: glu_sites.CPerSite
) -> tuple[sites.SiteSpec, ...]:
  """Return every matrix of the model as a site."""
  return induction.site_specs(config.copying, c)


def target_fns(
  config: ArithmeticConfig, c: glu_sites.CPerSite
) -> target.TargetFns:
  """Return the function table decomposing every matrix."""
  return induction.target_fns(config.copying, c)


def fns_for_sites(
  config: ArithmeticConfig, specs: tuple[sites.SiteSpec, ...]
) -> target.TargetFns:
  """Return the function table of a site subset (rows renumbered)."""
  return induction.fns_for_sites(config.copying, specs)


def weights_for_sites(
  weights: glu_weights.GluWeights, config: ArithmeticConfig,
  specs: tuple[sites.SiteSpec, ...],
) -> glu_weights.GluWeights:
  """Return the weights re-split into the stacks of a site subset's span."""
  return induction.weights_for_sites(weights, config.copying, specs)


def weights_to_arrays(weights: glu_weights.GluWeights) -> dict[str, np.ndarray]:
  """Return the weights as host arrays (layers concatenated)."""
  return glu_arrays.weights_to_arrays(weights)


def weights_from_arrays(
  arrays: dict[str, np.ndarray], config: ArithmeticConfig
) -> glu_weights.GluWeights:
  """Return weights from `weights_to_arrays` output, all layers in the span."""
  return induction.weights_from_arrays(arrays, config.copying)
