"""Schedules (SPEC §6.4, I32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import schedules
from decompax.core.schedules import Schedule, schedule_value


@pytest.mark.parametrize("fn_type", ["linear", "cosine"])
def test_i32_decay_reaches_final_at_last_step(fn_type):
  sched = Schedule(2.0, fn_type, final_frac=0.2)
  assert float(schedule_value(sched, 0, 11)) == pytest.approx(2.0)
  assert float(schedule_value(sched, 10, 11)) == pytest.approx(0.4)
  assert float(schedule_value(sched, 5, 11)) == pytest.approx(1.2)


def test_i32_warmup_starts_at_zero_and_ramps():
  sched = Schedule(1.0, "cosine", final_frac=0.0, warmup_pct=0.1)
  values = [float(schedule_value(sched, s, 100)) for s in (0, 5, 10, 99)]
  assert values == pytest.approx([0.0, 0.5, 1.0, 0.0], abs=1e-6)


def test_constant_and_float_coefficients():
  assert float(schedule_value(Schedule(3.0), 7, 10)) == 3.0
  assert float(schedule_value(0.5, 7, 10)) == 0.5


def test_schedule_traces_inside_jit():
  sched = Schedule(1.0, "linear", final_frac=0.0)
  f = jax.jit(lambda s: schedule_value(sched, s, 5))
  got = [float(f(jnp.int32(s))) for s in range(5)]
  np.testing.assert_allclose(got, [1.0, 0.75, 0.5, 0.25, 0.0], atol=1e-7)


def test_invalid_schedules_are_refused():
  with pytest.raises(ValueError, match="final_frac"):
    Schedule(1.0, "constant", final_frac=0.5)
  with pytest.raises(ValueError, match="unknown schedule"):
    Schedule(1.0, "exponential")


@pytest.mark.parametrize("fn_type", ["linear", "cosine"])
def test_one_segment_knots_equal_the_decay_pointwise(fn_type):
  total, final = 37, 0.2
  decay = schedules.Schedule(3.0, fn_type, final)
  knots = schedules.KnotSchedule(3.0, (
    schedules.Knot(0.0, 1.0, fn_type), schedules.Knot(1.0, final, "hold")))
  for step in range(total + 3):
    np.testing.assert_allclose(
      schedules.schedule_value(knots, step, total),
      schedules.schedule_value(decay, step, total), rtol=1e-6)


def test_knots_hold_ramp_and_end_at_their_final_fraction():
  # Hold the peak for the first half, then fall linearly to 0.1 at t = 0.75
  # and stay there.
  schedule = schedules.KnotSchedule(2.0, schedules.parse_knots(
    "0:1:hold,0.5:1,0.75:0.1:hold,1:0.1"))
  total = 101  # t = step / 100
  value = lambda s: float(schedules.schedule_value(schedule, s, total))
  assert value(0) == value(49) == 2.0
  np.testing.assert_allclose(value(50), 2.0, rtol=1e-6)
  np.testing.assert_allclose(value(60), 2.0 * (1 - 0.9 * 0.4), rtol=1e-5)
  np.testing.assert_allclose([value(75), value(100), value(500)],
                             [0.2, 0.2, 0.2], rtol=1e-5)


def test_knots_trace_inside_jit():
  schedule = schedules.KnotSchedule(1.0, schedules.parse_knots(
    "0:0:cosine,0.5:1:cosine,1:0"))
  f = jax.jit(lambda s: schedules.schedule_value(schedule, s, 11))
  np.testing.assert_allclose([f(0), f(5), f(10)], [0.0, 1.0, 0.0], atol=1e-6)
  np.testing.assert_allclose(f(2), 0.5 * (1 - np.cos(np.pi * 0.4)),
                             rtol=1e-5)


@pytest.mark.parametrize("text, message", [
  ("0.1:1,1:0", "from at=0 to at=1"),
  ("0:1,0.5:0.5,0.5:0.2,1:0", "increase strictly"),
  ("0:0.5,1:0.2", "frac = 1"),
  ("0:1:spline,1:0", "unknown knot shape"),
  ("0:1,1", "at:frac"),
  ("0:one,1:0", "non-number"),
  ("0:1,1:nan", "not finite"),
  ("0:1,0.5:-0.2,1:0", "knot 0.5:-0.2 has a negative fraction"),
])
def test_bad_knots_are_refused(text, message):
  with pytest.raises(ValueError, match=message):
    schedules.KnotSchedule(1.0, schedules.parse_knots(text))
