"""Step-indexed schedules for learning rates, coefficients and `p` (SPEC §6.4).

`step` counts completed optimizer steps and may be traced; `total_steps` is a
static Python int. The decay reaches `final_frac·start` exactly at
`step = total_steps − 1` (the `D − 1` denominator).

`KnotSchedule` is the piecewise form: `max_val·frac(t)` with
`t = min(step/(total_steps − 1), 1)` and `frac` interpolated between knots.
A one-segment knot schedule equals the no-warmup `Schedule` pointwise.
"""

import dataclasses
import math
from typing import Literal, Union

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

FnType = Literal["constant", "linear", "cosine"]


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A warmup-then-decay schedule; `constant` requires `final_frac = 1`."""

  start: float
  fn_type: str = "constant"  # one of FnType
  final_frac: float = 1.0
  warmup_pct: float = 0.0

  def __post_init__(self):
    if self.fn_type not in ("constant", "linear", "cosine"):
      raise ValueError(
        f"unknown schedule {self.fn_type!r}; use constant|linear|cosine"
      )
    if self.fn_type == "constant" and self.final_frac != 1.0:
      raise ValueError("a constant schedule needs final_frac = 1")
    if not 0.0 <= self.warmup_pct < 1.0:
      raise ValueError(f"warmup_pct must lie in [0, 1), got {self.warmup_pct}")


SEGMENT_SHAPES = ("linear", "cosine", "hold")


@dataclasses.dataclass(frozen=True)
class Knot:
  """A point `(at, frac)` of a knot schedule; `shape` is how the segment
  from this knot to the next one runs (ignored on the last knot)."""

  at: float
  frac: float
  shape: str = "linear"

  def __post_init__(self):
    if self.shape not in SEGMENT_SHAPES:
      raise ValueError(f"unknown knot shape {self.shape!r}; use "
                       f"{'|'.join(SEGMENT_SHAPES)}")
    if not (math.isfinite(self.at) and math.isfinite(self.frac)):
      raise ValueError(f"knot ({self.at}, {self.frac}) is not finite")
    if self.frac < 0:
      # A knot scales a learning rate, coefficient or exponent: below 0 it
      # flips the sign (a learning rate would ascend the loss).
      raise ValueError(f"knot {self.at:g}:{self.frac:g} has a negative "
                       "fraction; fractions must be >= 0")


@dataclasses.dataclass(frozen=True)
class KnotSchedule:
  """`max_val·frac(t)` through `knots`: the first at `t = 0`, the last at
  `t = 1`, positions strictly increasing, some `frac` equal to 1 (so
  `max_val` is the peak the schedule reaches)."""

  max_val: float
  knots: tuple[Knot, ...]

  def __post_init__(self):
    ats = [k.at for k in self.knots]
    if len(ats) < 2 or ats[0] != 0.0 or ats[-1] != 1.0:
      raise ValueError(f"knots must run from at=0 to at=1, got {ats}")
    if any(b <= a for a, b in zip(ats, ats[1:])):
      raise ValueError(f"knot positions must increase strictly, got {ats}")
    if not any(k.frac == 1.0 for k in self.knots):
      raise ValueError("some knot must have frac = 1 (the schedule's peak)")


def parse_knots(text: str) -> tuple[Knot, ...]:
  """Return the knots of `0:1:cosine,0.5:0.2,1:0.2` (`at:frac[:shape]`)."""
  knots = []
  for part in text.split(","):
    fields = part.strip().split(":")
    if len(fields) not in (2, 3):
      raise ValueError(f"knot {part!r} is not at:frac or at:frac:shape")
    try:
      at, frac = float(fields[0]), float(fields[1])
    except ValueError:
      raise ValueError(f"knot {part!r} has a non-number position or "
                       "fraction") from None
    knots.append(Knot(at, frac, *fields[2:]))
  return tuple(knots)


Coefficient = Union[float, Schedule, KnotSchedule]


def extreme_values(value: Coefficient) -> tuple[float, ...]:
  """Return values between which a coefficient's schedule moves (its start
  and end, or every knot; piecewise linear or cosine segments stay within
  them): a check that must hold at every step checks these."""
  if isinstance(value, Schedule):
    return (value.start, value.start * value.final_frac)
  if isinstance(value, KnotSchedule):
    return tuple(value.max_val * k.frac for k in value.knots)
  return (value,)


def _knot_value(schedule: KnotSchedule, step, total_steps: int):
  s = jnp.asarray(step, jnp.float32)
  t = jnp.clip(s / max(total_steps - 1, 1), 0.0, 1.0)
  value = jnp.full((), schedule.knots[-1].frac, jnp.float32)
  # Walking back from the last segment, each `where` lets an earlier segment
  # claim the positions before its right end, so every `t` ends up in the
  # segment that starts at or before it.
  for left, right in reversed(list(zip(schedule.knots, schedule.knots[1:]))):
    u = jnp.clip((t - left.at) / (right.at - left.at), 0.0, 1.0)
    if left.shape == "hold":
      ramp = jnp.zeros_like(u)
    elif left.shape == "linear":
      ramp = u
    else:
      ramp = 0.5 * (1.0 - jnp.cos(jnp.pi * u))
    segment = left.frac + (right.frac - left.frac) * ramp
    value = jnp.where(t < right.at, segment, value)
  return schedule.max_val * value


def schedule_value(
  schedule: Coefficient, step: Int[Array, ""] | int, total_steps: int
) -> Float[Array, ""]:
  """Return the schedule's value after `step` completed steps (fp32)."""
  if isinstance(schedule, KnotSchedule):
    return _knot_value(schedule, step, total_steps)
  if not isinstance(schedule, Schedule):
    return jnp.asarray(schedule, jnp.float32)
  s = jnp.asarray(step, jnp.float32)
  warmup = math.floor(total_steps * schedule.warmup_pct)
  decay_steps = total_steps - warmup
  start = schedule.start
  if schedule.fn_type == "constant" or decay_steps <= 1:
    decayed = jnp.full((), start, jnp.float32)
  else:
    progress = jnp.clip((s - warmup) / (decay_steps - 1), 0.0, 1.0)
    f = schedule.final_frac
    if schedule.fn_type == "linear":
      shape = 1.0 - progress
    else:
      shape = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    decayed = start * (f + (1.0 - f) * shape)
  if warmup == 0:
    return decayed
  return jnp.where(s < warmup, start * s / warmup, decayed)
