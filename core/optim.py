"""Optimizers of the components and the CI function (SPEC §6.3, I30, I31).

Built on optax. The learning rate of the update taken after `s` completed
steps is `schedule(s)`; optax's update count equals `s` because the optimizer
is initialised fresh when training starts.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from decompax.core.schedules import KnotSchedule, Schedule, schedule_value

CLIP_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
  """AdamW settings; weight decay is 0 unless set (libraries differ)."""

  lr: Schedule | KnotSchedule
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


NS_COEFFS = (3.4445, -4.7750, 2.0315)


@dataclasses.dataclass(frozen=True)
class MuonConfig:
  """Muon for matrix leaves (SPEC §6.5); other leaves take Adam."""

  lr: Schedule | KnotSchedule
  beta: float = 0.95
  nesterov: bool = True
  ns_steps: int = 5
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  clip_max_norm: Optional[float] = None


def newton_schulz(g: jax.Array, steps: int = 5) -> jax.Array:
  """Return the approximate orthogonalisation of each trailing matrix.

  `X₀ = G/‖G‖_F` (transposed when rows > cols), then `X ← aX + (bA + cA²)X`
  with `A = XXᵀ`; batched over leading axes.
  """
  a, b, c = NS_COEFFS
  tall = g.shape[-2] > g.shape[-1]
  x = jnp.swapaxes(g, -1, -2) if tall else g
  x = x.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
  x = x / jnp.where(norm > 0, norm, 1.0)
  for _ in range(steps):
    gram = x @ jnp.swapaxes(x, -1, -2)
    x = a * x + (b * gram + c * gram @ gram) @ x
  return jnp.swapaxes(x, -1, -2) if tall else x


class MuonState(NamedTuple):
  """Momentum of every leaf (matrix leaves use it) and Adam's state."""

  momentum: optax.Updates
  adam: optax.OptState


def _unconstrained(role: str, tree):
  del role
  return tree


def _own_dims(path, leaf) -> tuple[int, int]:
  del path
  return tuple(leaf.shape[-2:])


def scale_by_muon(
  config: MuonConfig, constrain: Callable = _unconstrained,
  dims: Callable = _own_dims,
) -> optax.GradientTransformation:
  """Orthogonalised momentum for ≥2-D leaves, Adam directions for the rest.

  `constrain("muon", tree)` places the Newton–Schulz work (SPEC §8).
  `dims(path, leaf)` is a leaf's real `(rows, cols)`: a stack held with pad
  slots (`core.slots`) scales its update by its real shape, as it would
  unpadded (its zero rows and columns leave the orthogonalisation's real
  block as it is).
  """
  adam = optax.scale_by_adam(config.adam_b1, config.adam_b2, config.eps)

  def init_fn(params):
    return MuonState(jax.tree.map(jnp.zeros_like, params), adam.init(params))

  def update_fn(updates, state, params=None):
    adam_updates, adam_state = adam.update(updates, state.adam, params)
    momentum = jax.tree.map(lambda m, g: config.beta * m + g,
                            state.momentum, updates)

    def direction(path, g, blended, adam_u):
      if g.ndim < 2:
        return adam_u
      rows, cols = dims(path, g)
      scale = max(1.0, cols / rows) ** 0.5
      return (scale * newton_schulz(blended, config.ns_steps)).astype(g.dtype)

    blended = constrain("muon", jax.tree.map(
      lambda g, m: g + config.beta * m if config.nesterov else m,
      updates, momentum))
    out = jax.tree_util.tree_map_with_path(direction, updates, blended,
                                           adam_updates)
    return out, MuonState(momentum, adam_state)

  return optax.GradientTransformation(init_fn, update_fn)


def muon(
  config: MuonConfig, total_steps: int, constrain: Callable = _unconstrained,
  dims: Callable = _own_dims,
) -> optax.GradientTransformation:
  """Return clip (if configured) → Muon → decoupled decay → `−lr(s)`."""
  parts = []
  if config.clip_max_norm is not None:
    parts.append(clip_by_global_norm(config.clip_max_norm))
  parts.append(scale_by_muon(config, constrain, dims))
  if config.weight_decay:
    parts.append(optax.add_decayed_weights(config.weight_decay))
  parts.append(optax.scale_by_schedule(
    lambda count: -schedule_value(config.lr, count, total_steps)))
  return optax.chain(*parts)


def make_optimizer(
  config: "AdamWConfig | MuonConfig", total_steps: int,
  constrain: Callable = _unconstrained, dims: Callable = _own_dims,
) -> optax.GradientTransformation:
  """Return the optimizer a config describes (`constrain`, `dims`: see
  Muon)."""
  if isinstance(config, MuonConfig):
    return muon(config, total_steps, constrain, dims)
  return adamw(config, total_steps)
