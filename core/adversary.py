"""Adversarial mask sources: scopes, parametrizations, ascent steps (SPEC §5.6, §5.7).

A source has `C + 1` channels when the delta component is on. Its scope keeps
some leading axes full and others at size 1 so one value is shared across
them: positionless `c (1, S)` and `bc (B, S)`; positioned `c (1, 1, S)`,
`bc (B, 1, S)`, `sc (1, T, S)`, `bsc (B, T, S)`. Masks broadcast over the
size-1 axes. Every ascent ends with the parametrization's projection (I18).
"""

import dataclasses
import hashlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Key

SCOPES = ("c", "bc", "sc", "bsc")
PARAMETRIZATIONS = ("clamp", "sigmoid")
STEP_RULES = ("adam", "sign")


@dataclasses.dataclass(frozen=True)
class SourceConfig:
  """How a persistent adversary's sources are shaped, stored and stepped."""

  scope: str = "c"
  parametrization: str = "clamp"
  step_rule: str = "adam"
  b1: float = 0.5
  b2: float = 0.99
  eps: float = 1e-8

  def __post_init__(self):
    for value, allowed, what in (
      (self.scope, SCOPES, "scope"),
      (self.parametrization, PARAMETRIZATIONS, "parametrization"),
      (self.step_rule, STEP_RULES, "step rule"),
    ):
      if value not in allowed:
        raise ValueError(f"unknown source {what} {value!r}; use one of {allowed}")


class SourceState(NamedTuple):
  """One site's persistent source and its Adam moments."""

  source: Float[Array, "..."]
  m: Float[Array, "..."]
  v: Float[Array, "..."]


def scope_shape(
  scope: str, lead_shape: tuple[int, ...], channels: int
) -> tuple[int, ...]:
  """Return the source shape of `scope` for activations of `lead_shape`."""
  if scope not in SCOPES:
    raise ValueError(f"unknown source scope {scope!r}; use one of {SCOPES}")
  if len(lead_shape) == 1:
    if scope in ("sc", "bsc"):
      raise ValueError(f"scope {scope} needs positions; positionless targets "
                       "take c or bc")
    batch = lead_shape[0] if scope == "bc" else 1
    return (batch, channels)
  batch, seq = lead_shape[0], lead_shape[1]
  keep_b = scope in ("bc", "bsc")
  keep_s = scope in ("sc", "bsc")
  return (batch if keep_b else 1, seq if keep_s else 1, channels)


def site_key(key: Key[Array, ""], name: str) -> Key[Array, ""]:
  """Return `key` folded with two 32-bit words of the SHA-256 of `name`.

  A site's key then depends on its name alone, not on which other sites are
  selected nor where it stands among them (positionless toys have no draw
  path that would survive `--sites`).
  """
  digest = hashlib.sha256(name.encode()).digest()
  for start in (0, 4):
    word = int.from_bytes(digest[start:start + 4], "little")
    key = jax.random.fold_in(key, word)
  return key


def init_source(
  key: Key[Array, ""], shape: tuple[int, ...], parametrization: str
) -> SourceState:
  """Return a fresh source: `U[0,1]` for clamp, `N(0,1)` for sigmoid."""
  if parametrization == "clamp":
    source = jax.random.uniform(key, shape, jnp.float32)
  elif parametrization == "sigmoid":
    source = jax.random.normal(key, shape, jnp.float32)
  else:
    raise ValueError(f"unknown parametrization {parametrization!r}")
  # Two buffers: a donated train state must not alias m and v.
  return SourceState(source, jnp.zeros(shape, jnp.float32),
                     jnp.zeros(shape, jnp.float32))


def effective(source: Float[Array, "*s"], parametrization: str) -> Float[Array, "*s"]:
  """Return what masks consume: the source itself, or its sigmoid."""
  if parametrization == "sigmoid":
    return jax.nn.sigmoid(source)
  return source


def project(source: Float[Array, "*s"], parametrization: str) -> Float[Array, "*s"]:
  """Return the source after the parametrization's projection."""
  if parametrization == "clamp":
    return jnp.clip(source, 0.0, 1.0)
  return source


def ascend(
  state: SourceState,
  grad: Float[Array, "*s"],
  count: Array | int,
  lr: Float[Array, ""] | float,
  config: SourceConfig,
) -> SourceState:
  """Return the state after one projected ascent step (I18, I19).

  `count` is the number of ascents taken before this one; Adam bias
  correction uses `t = count + 1` and adds `eps` after the square root.
  """
  grad = grad.astype(state.m.dtype)
  if config.step_rule == "sign":
    step = jnp.sign(grad)
    m, v = state.m, state.v
  else:
    t = jnp.asarray(count, jnp.float32) + 1.0
    m = config.b1 * state.m + (1.0 - config.b1) * grad
    v = config.b2 * state.v + (1.0 - config.b2) * jnp.square(grad)
    m_hat = m / (1.0 - config.b1**t)
    v_hat = v / (1.0 - config.b2**t)
    step = m_hat / (jnp.sqrt(v_hat) + config.eps)
  source = project(state.source + lr * step, config.parametrization)
  return SourceState(source.astype(state.source.dtype), m, v)


def sign_pgd_step(
  source: Float[Array, "*s"], grad: Float[Array, "*s"], step_size: float
) -> Float[Array, "*s"]:
  """Return `clip(S + η·sign(g), 0, 1)`, the fresh-PGD ascent (§5.7)."""
  return jnp.clip(source + step_size * jnp.sign(grad), 0.0, 1.0)
