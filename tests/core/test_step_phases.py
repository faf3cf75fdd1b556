"""The train step's phases, each on its own (core/train_step.py), and the
step's one-trace guarantee (`max_traces`, `chex.assert_max_traces`)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, optim, sites as sites_lib, squash, train_step
from decompax.core import step_records
from decompax.core.masks import SiteMask
from decompax.core.schedules import Schedule
from decompax.core.step_records import StreamSpec

TWO_STREAMS = (StreamSpec("a"), StreamSpec("b", delta_pin=True,
                                            loss_positions=(0,)))


def _recon(name="recon", stream=""):
  def fn(ctx, key):
    del key
    out = ctx.masked_forward(
      {s.name: SiteMask(ctx.ci.lower[s.name]) for s in ctx.target.sites})
    return jnp.mean(jnp.square(out - ctx.clean_output))

  return step_records.simple_term(name, 1.0, fn)._replace(stream=stream)


def _counter(name, finish=True):
  """A stateful term: `prepare` adds 1 to its state and hands the state on
  as its input; `finish` stores 10 × the state it is handed."""

  def fn(ctx, key, inputs):
    del ctx, key
    return inputs * 0.0, None

  def prepare(ctx, key, state):
    del ctx, key
    return state + 1.0, state + 1.0

  def done(ctx, key, state, inputs, grads, aux):
    del ctx, key, inputs, grads, aux
    return state * 10.0

  return step_records.LossTerm(
    name, 1.0, fn, init_state=lambda key, lead: jnp.zeros(()),
    prepare=prepare, finish=done if finish else None)


def _config(**kwargs):
  return step_records.StepConfig(
    total_steps=10, components_opt=optim.AdamWConfig(Schedule(1e-2)),
    ci_opt=optim.AdamWConfig(Schedule(1e-2)), **kwargs)


def _plan(chain, terms, **kwargs):
  target, _ = chain
  ci = ci_fns.make_ci_fn(ci_fns.CIConfig("component_mlp", (4,)), target.sites)
  return train_step.step_plan(target, ci, terms, _config(**kwargs))


def _state(chain, plan, lead=(8,)):
  target, _ = chain
  comps = sites_lib.init_components(jax.random.key(0), target.sites)
  init = train_step.make_init(plan.terms, plan.config)
  leads = {s.name: lead for s in plan.config.streams} or lead
  return init(comps, plan.ci_fn.init(jax.random.key(1)), jax.random.key(2),
              leads)


X = jax.random.normal(jax.random.key(3), (8, 4))


def _contexts(chain, plan, state):
  _, weights = chain
  cleans = train_step.clean_passes(plan, weights, {"": X})
  prepared = train_step.prepare_passes(
    plan, cleans, (state.components, state.ci_params))
  return train_step.pass_contexts(plan, state.step, weights, {"": X}, cleans,
                                  prepared)


def test_clean_passes_keep_the_planned_taps_and_pass_no_gradient(chain):
  _, weights = chain
  plan = _plan(chain, (_recon(),))
  ((_, taps),) = train_step.clean_passes(plan, weights, {"": X})
  assert plan.clean_taps[0] == ("l0", "l1", "head")
  assert set(taps) == set(plan.clean_taps[0])
  grads = jax.grad(lambda w: jnp.sum(
    train_step.clean_passes(plan, w, {"": X})[0][0]))(weights)
  assert all(not np.any(g) for g in jax.tree.leaves(grads))


def test_prepare_passes_give_each_stream_its_own_ci_and_a_compute_copy(
    chain):
  _, weights = chain
  plan = _plan(chain, (_recon("a_r", "a"), _recon("b_r", "b")),
               streams=TWO_STREAMS, compute_dtype="bfloat16")
  state = _state(chain, plan)
  batches = {"a": X, "b": 2.0 * X}
  cleans = train_step.clean_passes(plan, weights, batches)
  prepared = train_step.prepare_passes(
    plan, cleans, (state.components, state.ci_params))
  assert len(prepared) == 2 and all(len(own) == 3 for own in prepared)
  assert prepared[0][2]["sq"].v.dtype == jnp.bfloat16
  assert prepared[0][0]["sq"].v.dtype == jnp.float32
  # Each stream's CI reads its own batch's taps.
  assert not np.allclose(prepared[0][1].lower["l0"],
                         prepared[1][1].lower["l0"])


def test_pass_contexts_carry_their_streams_pin_and_positions(chain):
  _, weights = chain
  plan = _plan(chain, (_recon("a_r", "a"), _recon("b_r", "b")),
               streams=TWO_STREAMS)
  state = _state(chain, plan)
  batches = {"a": X, "b": 2.0 * X}
  cleans = train_step.clean_passes(plan, weights, batches)
  prepared = train_step.prepare_passes(
    plan, cleans, (state.components, state.ci_params))
  ctxs = train_step.pass_contexts(plan, state.step, weights, batches, cleans,
                                  prepared)
  assert [c.delta_pin for c in ctxs] == [False, True]
  assert [c.loss_positions for c in ctxs] == [None, (0,)]
  assert ctxs[1].inputs is batches["b"]
  assert ctxs[1].ci is prepared[1][1]


def test_prepare_terms_update_stateful_terms_only_and_copy_the_dict(chain):
  plan = _plan(chain, (_recon(), _counter("count")))
  ctxs = _contexts(chain, plan, _state(chain, plan))
  states = {"count": jnp.asarray(4.0)}
  keys = [jax.random.key(0)] * 2
  new, inputs = train_step.prepare_terms(plan.terms, ctxs, keys,
                                         plan.passes, states)
  assert inputs[0] is None and float(inputs[1]) == 5.0
  assert float(new["count"]) == 5.0 and float(states["count"]) == 4.0


def test_finish_terms_hand_each_its_prepared_state(chain):
  plan = _plan(chain, (_counter("kept", finish=False), _counter("done")))
  ctxs = _contexts(chain, plan, _state(chain, plan))
  prepared = {"kept": jnp.asarray(2.0), "done": jnp.asarray(3.0)}
  keys = [jax.random.key(0)] * 2
  out = train_step.finish_terms(plan.terms, ctxs, keys, plan.passes,
                                prepared, (None, None), (None, None),
                                (None, None))
  assert float(out["kept"]) == 2.0 and float(out["done"]) == 30.0


def test_apply_updates_decay_unused_components_by_the_frozen_ci(chain):
  """Zero gradients leave AdamW's update at 0: what moves the components
  is the CI-scaled decay alone, read from every pass's CI."""
  _, weights = chain
  plan = _plan(chain, (_recon(),), ci_scaled_decay=0.5)
  state = _state(chain, plan)
  cleans = train_step.clean_passes(plan, weights, {"": X})
  prepared = train_step.prepare_passes(
    plan, cleans, (state.components, state.ci_params))
  zeros = jax.tree.map(jnp.zeros_like, (state.components, state.ci_params))
  out = train_step.apply_updates(plan, state, *zeros, prepared)
  np.testing.assert_array_equal(out.ci_params["l0"].w_in,
                                state.ci_params["l0"].w_in)
  expected = train_step.ci_scaled_decay(
    state.components, train_step.max_ci_per_component(
      plan.target.sites, [prepared[0][1].lower]), 1e-2, 0.5)
  np.testing.assert_allclose(out.components["sq"].v, expected["sq"].v,
                             rtol=1e-6)
  assert not np.allclose(out.components["sq"].v, state.components["sq"].v)


def test_step_metrics_name_each_stream_and_term(chain):
  plan = _plan(chain, (_recon("a_r", "a"), _recon("b_r", "b")),
               streams=TWO_STREAMS)
  ci = squash.squash({"l0": jnp.zeros((8, 5)),
                                 "l1": jnp.zeros((8, 5)),
                                 "head": jnp.ones((8, 5))})
  frozen = ((None, ci), (None, ci))
  one = jnp.ones(())
  grads = _state(chain, plan).components
  metrics = train_step.step_metrics(
    plan, one, {"a_r": one, "b_r": one}, (None, None), frozen, grads, one)
  assert {"a/loss/r", "b/loss/r", "a/ci_l0/head", "b/ci_l0/l0",
          "loss/total", "grad_norm/components",
          "lr/components"} <= set(metrics)
  assert float(metrics["b/ci_l0/head"]) == 5.0
  assert float(metrics["a/ci_l0/l0"]) == 0.0


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_next_state_drops_a_nonfinite_update_only_when_skipping(chain,
                                                                policy):
  plan = _plan(chain, (_recon(),), on_nonfinite=policy)
  state = _state(chain, plan)
  moved = jax.tree.map(lambda a: a + 1.0, state.components)
  updated = (moved, state.ci_params, state.components_opt, state.ci_opt)
  new = train_step.next_state(plan, state, {"recon": jnp.asarray(jnp.nan)},
                              updated, state.term_states)
  assert int(new.step) == 1 and int(new.health.nonfinite_steps) == 1
  kept = new.components["sq"].v
  want = state.components if policy == "skip" else moved
  np.testing.assert_array_equal(kept, want["sq"].v)


class RunStepTest(chex.TestCase):
  """`run_step`, and two pure functions of it, agree with and without jit
  (`chex.variants`): nothing in them depends on tracing."""

  @pytest.fixture(autouse=True)
  def _chain(self, chain):
    self.chain = chain

  @chex.variants(with_jit=True, without_jit=True)
  def test_run_step_agrees_with_and_without_jit(self):
    _, weights = self.chain
    plan = _plan(self.chain, (_recon(), _counter("count")),
                 ci_scaled_decay=0.1)
    state = _state(self.chain, plan)
    new, metrics = self.variant(
      lambda s, w, x: train_step.run_step(plan, s, w, x))(state, weights, X)
    ref, ref_metrics = jax.jit(
      lambda s, w, x: train_step.run_step(plan, s, w, x))(state, weights, X)
    chex.assert_trees_all_close((new._replace(rng=None), metrics),
                                (ref._replace(rng=None), ref_metrics),
                                rtol=1e-6, atol=1e-7)
    assert int(new.step) == 1 and float(new.term_states["count"]) == 10.0

  @chex.variants(with_jit=True, without_jit=True)
  def test_ci_l0_and_scaled_decay_agree_with_and_without_jit(self):
    target, _ = self.chain
    comps = sites_lib.init_components(jax.random.key(0), target.sites)
    lower = {s.name: jax.random.uniform(jax.random.key(i), (8, s.c))
             for i, s in enumerate(target.sites)}
    peak = train_step.max_ci_per_component(target.sites, [lower])
    decayed = self.variant(train_step.ci_scaled_decay,
                           static_argnums=3)(comps, peak, 0.1, 0.5)
    counts = self.variant(train_step.ci_l0, static_argnums=1)(lower, 0.5)
    chex.assert_trees_all_close(
      (decayed, counts),
      (train_step.ci_scaled_decay(comps, peak, 0.1, 0.5),
       train_step.ci_l0(lower, 0.5)), rtol=1e-6)


def _traced_step(chain, sample=False):
  target, _ = chain
  ci = ci_fns.make_ci_fn(ci_fns.CIConfig("component_mlp", (4,)), target.sites)
  terms = (_recon(), _counter("count"))
  sample_inputs = (lambda key: jax.random.normal(key, (8, 4))) if sample \
    else None
  chex.clear_trace_counter()
  built = train_step.make_train_step(target, ci, terms, _config(),
                                     sample_inputs=sample_inputs,
                                     max_traces=1)
  comps = sites_lib.init_components(jax.random.key(0), target.sites)
  return built, built.init(comps, ci.init(jax.random.key(1)),
                           jax.random.key(2), (8,))


@pytest.mark.parametrize("sample", [False, True])
def test_a_run_traces_its_step_once(chain, sample):
  """Several steps, each fed the state the last returned (as a run's loop
  feeds it): one trace, or `max_traces=1` raises."""
  _, weights = chain
  built, state = _traced_step(chain, sample)
  for s in range(3):
    inputs = jax.random.key(7) if sample else X + s
    state, _ = built.step(state, weights, inputs)
  assert int(state.step) == 3


def test_a_retrace_fails_the_guarantee(chain):
  _, weights = chain
  built, state = _traced_step(chain)
  state, _ = built.step(state, weights, X)
  with pytest.raises(AssertionError, match="traced > 1 times"):
    built.step(state, weights, X[:4])
