"""The eval passes' and the persistent adversary's phases, each on its own
(evals/eval_step.py, losses/adversarial.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import adversary, ci_fns, optim, sites as sites_lib
from decompax.core import step_records, train_step
from decompax.core.schedules import Schedule
from decompax.evals import eval_step
from decompax.losses import adversarial, recon

X = jax.random.normal(jax.random.key(3), (8, 4))


def _ci(target):
  return ci_fns.make_ci_fn(ci_fns.CIConfig("site_mlp", (4,)), target.sites)


def _state(target, ci, terms=()):
  adam = optim.AdamWConfig(Schedule(1e-2))
  init = train_step.make_init(terms, step_records.StepConfig(10, adam, adam))
  comps = sites_lib.init_components(jax.random.key(0), target.sites)
  return init(comps, ci.init(jax.random.key(1)), jax.random.key(2), (8,))


def test_eval_plan_reads_hidden_points_only_for_a_dual_role_ci(chain):
  target, _ = chain
  config = eval_step.EvalConfig(n_batches=1, total_steps=10,
                                hidden_points=("l1.out",))
  plan = eval_step.eval_plan(target, _ci(target), (), config, None)
  assert plan.hidden_points == () and "l1.out" not in plan.fast_taps
  # The slow tier keeps every site's output for the hidden-activation
  # errors.
  assert {"l0.out", "l1.out", "head.out"} <= set(plan.slow_taps)
  with pytest.raises(ValueError, match="at least one batch"):
    eval_step.eval_plan(target, _ci(target), (),
                        eval_step.EvalConfig(0, 10), None)


def test_eval_contexts_carry_the_stream_and_one_role_when_asked(chain):
  target, weights = chain
  ci = _ci(target)
  stream = step_records.StreamSpec("b", delta_pin=True)
  plan = eval_step.eval_plan(target, ci, (), eval_step.EvalConfig(1, 10),
                             None, stream=stream)
  state = _state(target, ci)
  ctxs = eval_step.eval_contexts(plan, state, weights, X, plan.fast_taps,
                                 every_role=False)
  assert len(ctxs) == 1 and ctxs[0].delta_pin
  assert set(ctxs[0].clean_taps) == set(plan.fast_taps)


def test_fast_batch_draws_its_batch_from_the_data_key(chain):
  target, weights = chain
  ci = _ci(target)

  def sample(key):
    return jax.random.normal(key, (8, 4))

  plan = eval_step.eval_plan(
    target, ci, (), eval_step.EvalConfig(1, 10, pgd_steps=0), sample)
  key = jax.random.key(9)
  scalars, stats, batch = eval_step.fast_batch(
    plan, _state(target, ci), weights, key, None)
  np.testing.assert_array_equal(batch, sample(jax.random.fold_in(key, 0)))
  assert int(stats["positions"]) == 8
  assert {"ci_l0/l0", "recon/ci_masked", "recon/unmasked"} <= set(scalars)


def _persistent(target, n_warmup=2, start_frac=0.0):
  config = adversarial.PersistentConfig(
    adversary.SourceConfig(scope="c"), Schedule(0.05), n_warmup=n_warmup,
    start_frac=start_frac)
  return adversarial.PersistentTerm(
    recon.all_sites_plan(target.sites, "uniform_k", 1), config,
    target.sites, with_delta=True)


@pytest.mark.parametrize("start_frac,ascents", [(0.0, 2), (0.5, 0)])
def test_persistent_prepare_ascends_only_once_the_adversary_runs(
    chain, start_frac, ascents):
  target, weights = chain
  term = _persistent(target, start_frac=start_frac)
  state = adversarial.persistent_init(term, jax.random.key(0), (8,))
  assert all(s.source.shape == (1, site.c + 1)
             for site, s in zip(target.sites, state.sources.values()))
  plan = train_step.step_plan(
    target, _ci(target), (), step_records.StepConfig(
      10, optim.AdamWConfig(Schedule(1e-2)),
      optim.AdamWConfig(Schedule(1e-2))))
  train_state = _state(target, plan.ci_fn)
  cleans = train_step.clean_passes(plan, weights, {"": X})
  prepared = train_step.prepare_passes(
    plan, cleans, (train_state.components, train_state.ci_params))
  (ctx,) = train_step.pass_contexts(plan, train_state.step, weights,
                                    {"": X}, cleans, prepared)
  after, raw = adversarial.persistent_prepare(term, ctx, jax.random.key(1),
                                              state)
  assert int(after.count) == ascents
  moved = any(not np.array_equal(raw[k], state.sources[k].source)
              for k in raw)
  assert moved == bool(ascents)
  value, _ = adversarial.persistent_value(term, ctx, jax.random.key(1), raw)
  assert (float(value) > 0) == bool(ascents)
