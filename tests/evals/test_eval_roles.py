"""Both eval tiers of a dual-role CI function (evals/eval_step.py, SPEC §6.6).

On the tiny three-site chain: a dual-role fast eval adds the hidden role's
CI-L0, its CI-masked hidden recon and its terms' values, and its slow eval
the hidden role's CI distributions, each the number a direct computation
from the hidden role's CI gives; its output-role stats are those of the
one-role function sharing its trunk and output head, whose eval keeps its
key set.
"""

import types

import jax
import numpy as np
import pytest

from decompax.core import ci_fns, optim, sites as sites_lib
from decompax.core import step_objective, step_records, step_streams, train_step
from decompax.core.masks import VARIANTS, SiteMask
from decompax.core.schedules import Schedule
from decompax.evals import eval_step
from decompax.losses import hidden, recon
from decompax.losses import loss_terms as terms
from decompax.measures import ci_counts

BATCH = 8
POINTS = ("l1.out",)
VECTOR = ci_fns.CIConfig("vector_mlp", (4,))


def _output_terms(sites):
  return (
    terms.importance_minimality_term(1e-3, 1.0),
    terms.stochastic_recon_term("stochastic_recon", 1.0,
                                recon.all_sites_plan(sites), False),
  )


def _hidden_copies(output_terms):
  return tuple(t._replace(name=f"{t.name}_hidden", role=ci_fns.HIDDEN)
               for t in output_terms)


def _fast(target, weights, ci_fn, loss_terms, ci_params, hidden_points=()):
  """Return the state, the fast tier's per-batch output and batches, and
  the eval passes."""
  components = sites_lib.init_components(jax.random.key(1), target.sites)
  adam = optim.AdamWConfig(Schedule(1e-3))
  state = train_step.make_init(loss_terms, step_records.StepConfig(
    10, adam, adam, hidden_points=hidden_points))(
      components, ci_params, jax.random.key(0), (BATCH,))

  def sample(key):
    return jax.random.normal(key, (BATCH, 4))

  config = eval_step.EvalConfig(n_batches=2, total_steps=10, pgd_steps=0,
                                hidden_points=hidden_points)
  fns = eval_step.make_eval_step(target, ci_fn, loss_terms, config, sample)
  output, batches = fns.fast(state, weights, jax.random.key(5))
  return state, jax.device_get(output), batches, fns


@pytest.fixture(scope="module")
def evals(chain):
  target, weights = chain
  dual = ci_fns.make_ci_fn(ci_fns.CIConfig(
    "vector_mlp", (4,), roles=ci_fns.ROLES), target.sites)
  output_terms = _output_terms(target.sites)
  dual_terms = output_terms + _hidden_copies(output_terms)
  state, dual_out, batches, dual_fns = _fast(
    target, weights, dual, dual_terms, dual.init(jax.random.key(2)), POINTS)
  one = ci_fns.make_ci_fn(VECTOR, target.sites)
  one_state, one_out, _, one_fns = _fast(target, weights, one, output_terms,
                                         state.ci_params.shared)
  return types.SimpleNamespace(
    target=target, weights=weights, dual=dual, dual_terms=dual_terms,
    state=state, dual_out=dual_out, batches=batches, dual_fns=dual_fns,
    one_state=one_state, one_out=one_out, one_fns=one_fns)


def test_a_one_role_eval_keeps_its_key_set(chain, evals):
  target = chain[0]
  one_out = evals.one_out
  assert set(one_out.scalars) == {
    *(f"ci_l0/{s.name}" for s in target.sites),
    *(f"recon/{v}" for v in VARIANTS),
    "loss/importance_minimality", "loss/stochastic_recon", "loss/total"}


def test_the_dual_role_eval_adds_the_hidden_role_to_the_output_one(evals):
  target, dual_out, one_out = evals.target, evals.dual_out, evals.one_out
  added = set(dual_out.scalars) - set(one_out.scalars)
  assert added == {
    *(f"ci_l0_hidden/{s.name}" for s in target.sites),
    "recon/hidden_ci_masked", "loss/importance_minimality_hidden",
    "loss/stochastic_recon_hidden"}
  assert set(one_out.scalars) <= set(dual_out.scalars)
  # The output role is the one-role function: same trunk, same head, same
  # keys, so the same numbers; only the total also counts the hidden terms.
  for key, value in one_out.scalars.items():
    if key != "loss/total":
      np.testing.assert_allclose(dual_out.scalars[key], value, rtol=1e-5,
                                 err_msg=key)
  summary = eval_step.summarize(dual_out)
  for site in target.sites:
    np.testing.assert_allclose(
      summary.scalars[f"ci_l0_hidden/{site.name}"],
      np.mean(dual_out.scalars[f"ci_l0_hidden/{site.name}"]))


def test_hidden_scalars_are_those_of_a_direct_hidden_pass(evals):
  """Batch 0's hidden scalars against the hidden role's CI and a context
  built here: the hidden terms score the relative error at the hidden
  points, not the output."""
  target, weights, dual = evals.target, evals.weights, evals.dual
  dual_terms, state, dual_out = evals.dual_terms, evals.state, evals.dual_out
  inputs = evals.batches[0]
  wanted = (*step_streams.clean_tap_keys(dual, target, dual_terms), *POINTS)
  clean, taps = target.clean_forward(weights, inputs, wanted)
  own = step_objective.prepare_roles(state.components, state.ci_params, taps,
                                     dual, None)[1]
  ctx = step_objective.with_prepared(step_records.StepContext(
    state.step, 10, target, weights, inputs, clean, *own[:2],
    clean_taps=taps, hidden_points=POINTS), own)
  lower = ctx.ci.lower
  for site, l0 in train_step.ci_l0(lower, 0.1).items():
    np.testing.assert_allclose(dual_out.scalars[f"ci_l0_hidden/{site}"][0],
                               l0, rtol=1e-6)
  _, masked = ctx.masked_forward_with_taps(
    {s: SiteMask(ci) for s, ci in lower.items()}, POINTS)
  np.testing.assert_allclose(
    dual_out.scalars["recon/hidden_ci_masked"][0],
    hidden.relative_error(masked, taps, POINTS), rtol=1e-5)
  # Batch 0's term key, as the fast tier derives it.
  term_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(5), 0), 2)
  for j, term in enumerate(dual_terms):
    if term.role != ci_fns.HIDDEN:
      continue
    value, _ = term.fn(ctx, jax.random.fold_in(term_key, 1 + j), None)
    np.testing.assert_allclose(dual_out.scalars[f"loss/{term.name}"][0],
                               value, rtol=1e-5, err_msg=term.name)
  assert not np.allclose(dual_out.scalars["loss/stochastic_recon_hidden"],
                         dual_out.scalars["loss/stochastic_recon"])


@pytest.fixture(scope="module")
def slow(evals):
  """Return the dual-role and the one-role slow tier's stats, fetched."""
  key = jax.random.key(5)
  dual = evals.dual_fns.slow(evals.state, evals.weights, key, evals.batches)
  one = evals.one_fns.slow(evals.one_state, evals.weights, key,
                           evals.batches)
  return jax.device_get(dual), jax.device_get(one)


def _merged(output, slow_stats):
  """`eval_step.merge_slow` on host arrays."""
  return output._replace(stats={**output.stats, **slow_stats})


def _role_keys(sites, suffix):
  return {f"{stat}{suffix}/{s.name}" for stat in eval_step.CI_DISTRIBUTIONS
          for s in sites}


def test_a_one_role_slow_eval_keeps_its_key_set(evals, slow):
  sites = evals.target.sites
  assert set(slow[1]) == _role_keys(sites, "") | {
    f"hidden_{n}/{v}/{s.name}" for n in ("err", "n")
    for v in ("ci_masked", "stochastic") for s in sites}
  summary = eval_step.summarize(_merged(evals.one_out, slow[1]))
  assert set(summary.arrays) == {"density", "mean_ci", "hist_lower",
                                 "hist_pre", "log_density"}


def test_the_dual_role_slow_eval_adds_the_hidden_roles_ci_distributions(
    evals, slow):
  dual, one = slow
  assert set(dual) - set(one) == _role_keys(evals.target.sites, "_hidden")
  assert set(one) <= set(dual)
  # The output role's are the one-role function's, as in the fast tier.
  for key, value in one.items():
    np.testing.assert_allclose(dual[key], value, rtol=1e-5, err_msg=key)


def test_hidden_ci_distributions_are_those_of_the_hidden_roles_ci(evals,
                                                                  slow):
  """Per batch, against the hidden role's CI computed here: numpy
  histograms of lower and pre CI, per-component sums and log-band counts;
  then the host sums of `summarize`."""
  target, dual = evals.target, slow[0]
  c = {s.name: s.c for s in target.sites}
  for b, inputs in enumerate(evals.batches):
    _, taps = target.clean_forward(evals.weights, inputs,
                                   evals.dual.input_taps)
    ci = step_objective.prepare_roles(evals.state.components,
                                      evals.state.ci_params, taps, evals.dual,
                                      None)[1][1]
    for site in c:
      lower = np.asarray(ci.lower[site])
      pre = np.asarray(ci.pre[site])
      for name, x, edges in (("lower", lower, ci_counts.LOWER_EDGES),
                             ("pre", pre, ci_counts.PRE_EDGES)):
        edges = edges.astype(np.float32)
        want = [np.sum(x < edges[0]), *np.histogram(x, edges)[0],
                np.sum(x > edges[-1])]
        np.testing.assert_array_equal(dual[f"hist_{name}_hidden/{site}"][b],
                                      want, err_msg=f"{name} {site}")
      np.testing.assert_allclose(dual[f"ci_sum_hidden/{site}"][b],
                                 lower.reshape(-1, c[site]).sum(0),
                                 rtol=1e-5)
      np.testing.assert_array_equal(
        dual[f"log_density_hidden/{site}"][b],
        ci_counts.log_density_counts(ci.lower[site]))
      assert not np.allclose(dual[f"ci_sum_hidden/{site}"][b],
                             dual[f"ci_sum/{site}"][b])
  summary = eval_step.summarize(_merged(evals.dual_out, dual))
  positions = BATCH * len(evals.batches)
  for site in c:
    for name in ("hist_lower", "hist_pre", "log_density"):
      np.testing.assert_array_equal(
        summary.arrays[f"{name}_hidden"][site],
        dual[f"{name}_hidden/{site}"].sum(0))
    np.testing.assert_allclose(summary.arrays["mean_ci_hidden"][site],
                               dual[f"ci_sum_hidden/{site}"].sum(0)
                               / positions, rtol=1e-6)
  assert "density_hidden" not in summary.arrays


def test_hidden_terms_need_a_hidden_role_and_hidden_points(chain):
  target = chain[0]
  hidden_terms = _hidden_copies(_output_terms(target.sites))
  config = eval_step.EvalConfig(n_batches=1, total_steps=10,
                                hidden_points=POINTS)
  one = ci_fns.make_ci_fn(VECTOR, target.sites)
  with pytest.raises(ValueError, match="CI function's roles"):
    eval_step.make_eval_step(target, one, hidden_terms, config, None)
  dual = ci_fns.make_ci_fn(ci_fns.CIConfig(
    "vector_mlp", (4,), roles=ci_fns.ROLES), target.sites)
  with pytest.raises(ValueError, match="no hidden points"):
    eval_step.make_eval_step(
      target, dual, hidden_terms,
      eval_step.EvalConfig(n_batches=1, total_steps=10), None)
