"""Optimizers of the components and the CI function (SPEC §6.3, I30, I31).

Built on optax. The learning rate of the update taken after `s` completed
steps is `schedule(s)`; optax's update count equals `s` because the optimizer
is initialised fresh when training starts.
"""

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from decompax.core.schedules import Schedule, schedule_value

CLIP_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
  """AdamW settings; weight decay is 0 unless set (libraries differ)."""

  lr: Schedule
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  clip_max_norm: Optional[float] = None


class ClipState(NamedTuple):
  """Stateless."""


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """Scale updates by `min(1, max_norm / (‖g‖ + 1e-6))` (fp32 norm)."""

  def init_fn(params):
    del params
    return ClipState()

  def update_fn(updates, state, params=None):
    del params
    leaves = jax.tree.leaves(updates)
    sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves)
    scale = jnp.minimum(1.0, max_norm / (jnp.sqrt(sq) + CLIP_EPS))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates), state

  return optax.GradientTransformation(init_fn, update_fn)


def adamw(config: AdamWConfig, total_steps: int) -> optax.GradientTransformation:
  """Return clip (if configured) → Adam → decoupled decay → `−lr(s)`."""
  parts = []
  if config.clip_max_norm is not None:
    parts.append(clip_by_global_norm(config.clip_max_norm))
  parts.append(optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps))
  if config.weight_decay:
    parts.append(optax.add_decayed_weights(config.weight_decay))
  parts.append(
    optax.scale_by_schedule(
      lambda count: -schedule_value(config.lr, count, total_steps)
    )
  )
  return optax.chain(*parts)
