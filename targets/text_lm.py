"""Training a Llama-architecture language model on text, from scratch.

The model is the GLU decoder of `glu_lm` (family `llama`, tied embeddings,
no QK-norm), every layer in the span stack. A preset fixes its shape and
its training: AdamW with linear warmup, cosine decay to a tenth of the
peak and global-norm clipping. The loss is the mean next-token cross
entropy (nats) of a `[b, t + 1]` window batch: positions `0..t-1` predict
`1..t`. The step is one pure function of `(state, batch)`; the data order
lives with the caller (`io.tokens.read_batch`), so a resumed run repeats
exactly the batches an uninterrupted one would have seen.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, Key

from decompax.core.stable_softmax import log_softmax
from decompax.targets import glu_config, glu_lm, glu_weights


@dataclasses.dataclass(frozen=True)
class LmPreset:
  """Shape and training schedule of a text language model."""

  name: str
  n_layers: int
  d_model: int
  d_ff: int
  n_heads: int
  vocab_size: int
  seq_len: int
  batch_size: int
  num_steps: int
  lr: float
  warmup_steps: int
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  init_std: float = 0.02
  rope_theta: float = 10000.0

  def __post_init__(self):
    for name in ("n_layers", "d_model", "d_ff", "n_heads", "vocab_size",
                 "seq_len", "batch_size", "num_steps"):
      if getattr(self, name) <= 0:
        raise ValueError(f"preset {self.name}: {name} must be positive")
    if self.d_model % self.n_heads:
      raise ValueError(f"preset {self.name}: d_model {self.d_model} is not"
                       f" a multiple of n_heads {self.n_heads}")
    if not 0 <= self.warmup_steps < self.num_steps:
      raise ValueError(f"preset {self.name}: warmup_steps must be in [0,"
                       f" num_steps)")


PRESETS = {
  # Two CPU cores, at most 20 minutes: 900 steps of 8 x 256 tokens (1.8 M
  # tokens, 1.2 passes over the split). The batch and lr were chosen over
  # seven variants of the same token budget on a validation carve of the
  # training split (docs/brown.md), never on the held-out split.
  "brown-s": LmPreset("brown-s", n_layers=4, d_model=256, d_ff=1024,
                      n_heads=4, vocab_size=4096, seq_len=256,
                      batch_size=8, num_steps=900, lr=2e-3,
                      warmup_steps=60),
  # One TPU v5e chip, at most 10 minutes: 800 steps of 16 x 512 tokens,
  # 6.6 M tokens, about five passes over the split's 1.37 M. The data
  # bounds it: 32 windows a step (ten passes) overfit, and fewer steps
  # underfit, on the same validation carve (docs/brown.md).
  "brown-m": LmPreset("brown-m", n_layers=8, d_model=512, d_ff=2048,
                      n_heads=8, vocab_size=8192, seq_len=512,
                      batch_size=16, num_steps=800, lr=1e-3,
                      warmup_steps=80),
  # A smoke-test model for token files of a 300-entry BPE: seconds on CPU.
  "tiny": LmPreset("tiny", n_layers=2, d_model=32, d_ff=64, n_heads=2,
                   vocab_size=300, seq_len=32, batch_size=8, num_steps=40,
                   lr=1e-2, warmup_steps=4),
}


def model_config(preset: LmPreset) -> glu_config.GluConfig:
  """Return the decoder shape of a preset (a Llama config's content)."""
  return glu_config.GluConfig(
    n_layers=preset.n_layers, d_model=preset.d_model,
    n_heads=preset.n_heads, n_kv_heads=preset.n_heads,
    head_dim=preset.d_model // preset.n_heads, d_ff=preset.d_ff,
    vocab_size=preset.vocab_size, rope_theta=preset.rope_theta,
    rms_eps=1e-5, tied=True, qk_norm=False, family="llama",
    max_position=preset.seq_len)


def forward_spec(config: glu_config.GluConfig) -> glu_lm.ForwardSpec:
  """Return the training forward: all layers one span, no remat."""
  n = config.n_layers
  return glu_lm.ForwardSpec(config, glu_weights.Segments(n, 0, n), remat=False)


def init(key: Key[Array, ""], preset: LmPreset) -> glu_weights.GluWeights:
  """Return fresh weights: `N(0, std²)` matrices and embeddings, the
  residual writers (`o`, `down`) shrunk by `1/√(2·n_layers)` so the
  residual's scale does not grow with depth; norms one."""
  config = model_config(preset)
  e_key, s_key = jax.random.split(key)
  std, n = preset.init_std, config.n_layers
  stack = glu_weights.init_stack(s_key, config, n)
  out_scale = std / np.sqrt(2 * n)

  def rescale(name, a):
    if name in ("ln1", "ln2"):
      return jnp.ones_like(a)
    # init_stack draws N(0, 1/d_in); bring each to the wanted std.
    scale = out_scale if name in ("o", "down") else std
    return a * np.sqrt(a.shape[1]) * scale

  stack = glu_weights.LayerStack(**{
    name: rescale(name, getattr(stack, name))
    for name in ("ln1", "q", "k", "v", "o", "ln2", "gate", "up", "down")})
  return glu_weights.GluWeights(
    embed=std * jax.random.normal(e_key, (config.vocab_size, config.d_model),
                                  jnp.float32),
    prefix=None, span=stack, tail=None,
    norm=jnp.ones((config.d_model,), jnp.float32))


def logits(
  weights: glu_weights.GluWeights, tokens: Int[Array, "b t"],
  config: glu_config.GluConfig,
) -> Float[Array, "b t vocab"]:
  """Return the model's next-token logits."""
  return glu_lm.forward(weights, tokens, (), forward_spec(config))[0]


def token_losses(
  weights: glu_weights.GluWeights, window: Int[Array, "b t1"],
  config: glu_config.GluConfig,
) -> Float[Array, "b t"]:
  """Return −log p of each next token of a `[b, t + 1]` window."""
  inputs, labels = window[:, :-1], window[:, 1:]
  log_p = log_softmax(logits(weights, inputs, config).astype(jnp.float32))
  return -jnp.take_along_axis(log_p, labels[..., None], axis=-1)[..., 0]


def loss(
  weights: glu_weights.GluWeights, window: Int[Array, "b t1"],
  config: glu_config.GluConfig,
) -> Float[Array, ""]:
  """Return the mean next-token cross entropy of a window batch."""
  return jnp.mean(token_losses(weights, window, config))


def optimizer(preset: LmPreset) -> optax.GradientTransformation:
  """Return clipped AdamW on warmup-cosine of `preset`."""
  # At least one warmup step (the first update starts from lr 0), but a
  # one-step run takes its one step at the peak: optax's cosine needs a
  # step after the warmup.
  warmup = min(max(preset.warmup_steps, 1), preset.num_steps - 1)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, preset.lr, warmup, preset.num_steps, end_value=preset.lr / 10)
  # Decay by rank: 1-D leaves (the final norm) are spared it, stacked
  # leaves decay, the per-layer norms ([layer, d]) among them. Every
  # Brown model docs/brown.md measures was trained so; sparing those
  # norms too would train other models than the ones its tables name.
  decay = lambda w: jax.tree.map(lambda a: a.ndim > 1, w)  # noqa: E731
  return optax.chain(
    optax.clip_by_global_norm(preset.clip_norm),
    optax.adamw(schedule, b1=0.9, b2=0.95,
                weight_decay=preset.weight_decay, mask=decay))


class TrainState(NamedTuple):
  """Weights, optimizer state and the number of completed steps."""

  weights: glu_weights.GluWeights
  opt_state: Any
  step: Int[Array, ""]


def init_state(key: Key[Array, ""], preset: LmPreset) -> TrainState:
  """Return the state before the first step."""
  weights = init(key, preset)
  return TrainState(weights, optimizer(preset).init(weights),
                    jnp.zeros((), jnp.int32))


def make_train_step(
  preset: LmPreset,
) -> Callable[[TrainState, Int[Array, "b t1"]],
              tuple[TrainState, Float[Array, ""]]]:
  """Return `step(state, window) -> (state, loss)` (not jitted)."""
  config = model_config(preset)
  opt = optimizer(preset)

  def step(state, window):
    value, grads = jax.value_and_grad(loss)(state.weights, window, config)
    updates, opt_state = opt.update(grads, state.opt_state, state.weights)
    weights = optax.apply_updates(state.weights, updates)
    return TrainState(weights, opt_state, state.step + 1), value

  return step
