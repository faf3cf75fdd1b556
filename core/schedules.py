"""Step-indexed schedules for learning rates, coefficients and `p` (SPEC §6.4).

`step` counts completed optimizer steps and may be traced; `total_steps` is a
static Python int. The decay reaches `final_frac·start` exactly at
`step = total_steps − 1` (the `D − 1` denominator).
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


Coefficient = Union[float, Schedule]


def schedule_value(
  schedule: Coefficient, step: Int[Array, ""] | int, total_steps: int
) -> Float[Array, ""]:
  """Return the schedule's value after `step` completed steps (fp32)."""
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
