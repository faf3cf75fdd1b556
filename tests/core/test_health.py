"""The finiteness record and the step's handling of non-finite updates."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, health, optim, sites as sites_lib
from decompax.core import step_records, train_step
from decompax.core.schedules import Schedule
from decompax.core.masks import SiteMask

NAN_AT = 2  # the 1-based step whose loss the poisoned term makes NaN


def test_all_finite_looks_at_float_leaves_only():
  assert bool(health.all_finite({"a": jnp.ones(3), "n": jnp.arange(2)}))
  assert not bool(health.all_finite({"a": jnp.array([1.0, jnp.inf])}))
  assert not bool(health.all_finite((jnp.ones(2), jnp.array(jnp.nan))))
  assert bool(health.all_finite((jax.random.key(0), None)))
  assert bool(health.all_finite(()))
  # Compiled as in the step: XLA must not fold the x·0 it relies on.
  compiled = jax.jit(health.all_finite)
  for bad in (jnp.inf, -jnp.inf, jnp.nan):
    assert not bool(compiled({"a": jnp.array([1.0, bad, 2.0])}))
  assert bool(compiled({"a": jnp.array([3e38, -3e38, 1.0])}))


def test_record_keeps_the_first_bad_step_and_part():
  h = health.healthy()
  ok, nan = jnp.ones(2), jnp.array([1.0, jnp.nan])
  finite, h = health.record(h, (ok, ok), jnp.array(1))
  assert bool(finite) and int(h.nonfinite_steps) == 0
  assert int(h.first_step) == -1 and int(h.first_part) == -1
  finite, h = health.record(h, (ok, nan), jnp.array(5))
  assert not bool(finite)
  finite, h = health.record(h, (nan, ok), jnp.array(6))
  assert (int(h.nonfinite_steps), int(h.first_step), int(h.first_part),
          int(h.streak)) == (2, 5, 1, 2)
  _, h = health.record(h, (ok, ok), jnp.array(7))
  assert int(h.streak) == 0 and int(h.nonfinite_steps) == 2
  names = health.part_names(("recon",))
  assert names[:2] == ("loss/recon", "components")
  assert health.describe(h, names) == (
    "step 5 (first non-finite value: components)")


def test_keep_if_selects_whole_trees_keys_included():
  new = {"x": jnp.ones(2), "k": jax.random.key(1)}
  old = {"x": jnp.zeros(2), "k": jax.random.key(2)}
  kept = health.keep_if(jnp.array(False), new, old)
  np.testing.assert_array_equal(kept["x"], old["x"])
  np.testing.assert_array_equal(jax.random.key_data(kept["k"]),
                                jax.random.key_data(old["k"]))
  taken = health.keep_if(jnp.array(True), new, old)
  np.testing.assert_array_equal(taken["x"], new["x"])


def _poisoned_term():
  """A recon-like term whose value turns NaN at step NAN_AT alone."""

  def fn(ctx, key):
    del key
    out = ctx.masked_forward(
      {s.name: SiteMask(ctx.ci.lower[s.name]) for s in ctx.target.sites})
    value = jnp.mean(jnp.square(out - ctx.clean_output))
    # A NaN factor, unlike a NaN branch of `where`, reaches the gradients.
    return value * jnp.where(ctx.step + 1 == NAN_AT, jnp.nan, 1.0)

  return step_records.simple_term("recon", 1.0, fn)


@pytest.fixture(scope="module", params=["stop", "skip"])
def poisoned_run(request, chain):
  target, weights = chain
  ci = ci_fns.make_ci_fn(ci_fns.CIConfig("component_mlp", (4,)), target.sites)
  config = step_records.StepConfig(
    total_steps=10,
    components_opt=optim.AdamWConfig(Schedule(1e-2)),
    ci_opt=optim.AdamWConfig(Schedule(1e-2)),
    on_nonfinite=request.param)
  built = train_step.make_train_step(target, ci, (_poisoned_term(),), config)
  state = built.init(
    sites_lib.init_components(jax.random.key(0), target.sites),
    ci.init(jax.random.key(1)), jax.random.key(2))
  x = jax.random.normal(jax.random.key(3), (8, 4))
  states, metrics = [state], []
  for _ in range(3):
    copy = jax.tree.map(jnp.copy, states[-1])  # the step donates its state
    state, m = built.step(copy, weights, x)
    states.append(state)
    metrics.append(jax.device_get(m))
  return request.param, states, metrics


def test_a_nonfinite_step_is_recorded_in_either_mode(poisoned_run):
  mode, states, metrics = poisoned_run
  # Under stop the NaN stays in the state, so every later step is bad too.
  later = 2 if mode == "stop" else 1
  assert [int(m["nonfinite/steps"]) for m in metrics] == [0, 1, later]
  h = states[-1].health
  assert (int(h.first_step), int(h.first_part), int(h.streak)) == (
    NAN_AT, 0, later - 1 + (mode == "stop"))


def _finite(state):
  return bool(health.all_finite(state))


def test_skip_drops_the_update_and_stop_applies_it(poisoned_run):
  mode, states, _ = poisoned_run
  before, bad = states[NAN_AT - 1], states[NAN_AT]
  assert int(bad.step) == NAN_AT
  if mode == "stop":
    assert not _finite(bad)
    return
  for field in health.STATE_PARTS:
    chex_equal = jax.tree.map(
      lambda a, b: bool(jnp.array_equal(a, b)), getattr(bad, field),
      getattr(before, field))
    assert all(jax.tree.leaves(chex_equal)), field
  # The next, finite step trains on from the kept state.
  after = states[NAN_AT + 1]
  assert _finite(after)
  assert not np.allclose(after.components["sq"].v, bad.components["sq"].v)


def test_an_unknown_policy_is_refused(chain):
  target, _ = chain
  ci = ci_fns.make_ci_fn(ci_fns.CIConfig("component_mlp", (4,)), target.sites)
  config = step_records.StepConfig(
    total_steps=10, components_opt=optim.AdamWConfig(Schedule(1e-2)),
    ci_opt=optim.AdamWConfig(Schedule(1e-2)))
  with pytest.raises(ValueError, match="stop or skip"):
    train_step.make_train_step(target, ci, (), dataclasses.replace(
      config, on_nonfinite="ignore"))
