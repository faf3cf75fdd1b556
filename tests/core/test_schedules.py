"""Schedules (SPEC §6.4, I32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
