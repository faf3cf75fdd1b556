"""Training loop shared by the toy targets.

Parameters are any pytree; `fixed` is a pytree of arrays the loss reads but
the optimizer never touches (fixed embeddings, label coefficients, a frozen
identity). The loss draws its own batch from the per-step key
`fold_in(key, step)`, so a run is a pure function of `(key, params, config)`.
Steps run in `lax.scan` chunks, one jitted call per chunk; a progress callback
sees the host between chunks.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, Key

Params = Any
Fixed = Any
OptState = Any
# (params, fixed, step key) -> scalar loss.
LossFn = Callable[[Params, Fixed, Key[Array, ""]], Float[Array, ""]]
# (completed steps, mean loss over the last chunk) -> None.
Progress = Callable[[int, float], None]


@dataclasses.dataclass(frozen=True)
class TargetTraining:
  """AdamW settings of a target-training run.

  `schedule` is `constant` or `cosine` (from `lr` at step 0 to 0 at the last
  step).
  """

  steps: int
  lr: float
  weight_decay: float = 0.01
  schedule: str = "constant"
  chunk_steps: int = 1000

  def __post_init__(self):
    if self.schedule not in ("constant", "cosine"):
      raise ValueError(f"unknown schedule {self.schedule!r}")
    if self.steps <= 0 or self.chunk_steps <= 0:
      raise ValueError("steps and chunk_steps must be positive")


def optimizer(config: TargetTraining) -> optax.GradientTransformation:
  """Return the AdamW transformation of `config`."""
  if config.schedule == "cosine":
    lr = optax.cosine_decay_schedule(config.lr, max(config.steps - 1, 1))
  else:
    lr = config.lr
  return optax.adamw(lr, weight_decay=config.weight_decay)


def _run_chunk(
  params: Params,
  opt_state: OptState,
  fixed: Fixed,
  key: Key[Array, ""],
  start: Int[Array, ""],
  *,
  loss_fn: LossFn,
  opt: optax.GradientTransformation,
  n_steps: int,
) -> tuple[Params, OptState, Float[Array, " n"]]:
  def body(carry, step):
    params, opt_state = carry
    step_key = jax.random.fold_in(key, step)
    loss, grads = jax.value_and_grad(loss_fn)(params, fixed, step_key)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  steps = start + jnp.arange(n_steps, dtype=jnp.int32)
  (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), steps)
  return params, opt_state, losses


def train(
  key: Key[Array, ""],
  params: Params,
  fixed: Fixed,
  loss_fn: LossFn,
  config: TargetTraining,
  progress: Optional[Progress] = None,
) -> Params:
  """Return `params` after `config.steps` AdamW steps on `loss_fn`."""
  opt = optimizer(config)
  opt_state = opt.init(params)
  # Chunk length is static; at most two lengths (full and remainder) compile.
  run_chunk = jax.jit(
    functools.partial(_run_chunk, loss_fn=loss_fn, opt=opt),
    static_argnames="n_steps",
  )
  for start in range(0, config.steps, config.chunk_steps):
    n_steps = min(config.chunk_steps, config.steps - start)
    params, opt_state, losses = run_chunk(
      params, opt_state, fixed, key, jnp.int32(start), n_steps=n_steps
    )
    if progress is not None:
      progress(start + n_steps, float(jax.device_get(jnp.mean(losses))))
  return params
