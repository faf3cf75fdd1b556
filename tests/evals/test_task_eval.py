"""Task metrics of a targeted run (evals/task_eval.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, optim, sites as sites_lib, squash
from decompax.core import step_records, train_step
from decompax.core.masks import SiteMask
from decompax.core.schedules import Schedule
from decompax.evals.eval_metrics import cross_entropy
from decompax.evals import task_eval


def test_accuracy_counts_labelled_positions_only():
  logits = jnp.asarray([[[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]]])
  labels = jnp.asarray([[1, 1, -1]])
  assert float(task_eval.accuracy(logits, labels)) == 0.5
  kept = task_eval.answer_labels(jnp.asarray([[4, 5, 6, 7]]), (1, 3))
  np.testing.assert_array_equal(kept, [[-1, 5, -1, 7]])


@pytest.fixture(scope="module")
def scored(token_target):
  target, weights = token_target
  ci = ci_fns.make_ci_fn(ci_fns.CIConfig("vector_mlp", (4,)), target.sites)
  comps = sites_lib.init_components(jax.random.key(0), target.sites)
  opt = optim.AdamWConfig(Schedule(1e-3))
  state = train_step.make_init((), step_records.StepConfig(10, opt, opt))(
    comps, ci.init(jax.random.key(1)), jax.random.key(2))
  prompts = jax.random.randint(jax.random.key(3), (7, 4), 0, 6)
  other = jax.random.randint(jax.random.key(4), (3, 6), 0, 6)
  fn = task_eval.make_task_eval(target, ci, (2,), 0.5)
  return target, weights, ci, state, prompts, other, fn(
    state.components, state.ci_params, weights, prompts, other)


def test_alive_components_are_those_firing_at_an_answer_position(scored):
  target, weights, ci, state, prompts, _, out = scored
  _, taps = target.clean_forward(weights, prompts, ci.input_taps)
  lower = squash.squash(ci.apply(state.ci_params, taps,
                                 state.components)).lower
  for site, ci_site in lower.items():
    want = np.asarray(ci_site[:, 2] > 0.5).any(axis=0)
    np.testing.assert_array_equal(out.alive[site], want)
    np.testing.assert_allclose(out.answer_ci["output"][site], ci_site[:, 2],
                               rtol=1e-5)
    assert int(out.scalars[f"task/alive/{site}"]) == want.sum()
    np.testing.assert_allclose(
      out.scalars[f"task/answer_l0/{site}"],
      np.mean(np.sum(np.asarray(ci_site[:, 2]) > 0.5, axis=-1)))
  # One role: no other role's CI or scalars.
  assert list(out.answer_ci) == ["output"]
  assert not any("hidden" in k for k in out.scalars)
  # The thresholds leave both alive and silent components, so the
  # ablation removes some pieces and keeps others.
  every = np.concatenate([np.asarray(a) for a in out.alive.values()])
  assert 0 < every.sum() < every.size


def test_the_ablated_model_lacks_exactly_the_target_alive_pieces(scored):
  target, weights, _, state, prompts, other, out = scored
  labels = task_eval.answer_labels(target.token_labels(prompts), (2,))
  masks = {s: SiteMask(jnp.broadcast_to(1.0 - out.alive[s], (7, 4, 3)),
                       jnp.ones((7, 4))) for s in out.alive}
  ablated = target.masked_forward(weights, state.components, prompts, masks)
  np.testing.assert_allclose(out.scalars["task/answer_ce/ablated"],
                             cross_entropy(ablated, labels), rtol=1e-5)
  clean, _ = target.clean_forward(weights, prompts, ())
  np.testing.assert_allclose(out.scalars["task/answer_accuracy/clean"],
                             task_eval.accuracy(clean, labels))
  other_clean, _ = target.clean_forward(weights, other, ())
  np.testing.assert_allclose(
    out.scalars["task/nontarget_ce/clean"],
    cross_entropy(other_clean, target.token_labels(other)), rtol=1e-6)
  assert (out.scalars["task/nontarget_ce/ablated"]
          != out.scalars["task/nontarget_ce/clean"])


def test_a_dual_role_ci_reports_both_roles_answer_ci(scored):
  """Both roles' answer CI and answer CI-L0; alive, masks and ablation stay
  the output role's, so they match the one-role CI of the same trunk and
  output head."""
  target, weights, _, state, prompts, other, one_role = scored
  dual = ci_fns.make_ci_fn(ci_fns.CIConfig(
    "vector_mlp", (4,), roles=("output", "hidden")), target.sites)
  params = ci_fns.RoleHeads(state.ci_params, dual.init(
    jax.random.key(1)).hidden_head)
  out = task_eval.make_task_eval(target, dual, (2,), 0.5)(
    state.components, params, weights, prompts, other)
  _, taps = target.clean_forward(weights, prompts, dual.input_taps)
  lower = {role: squash.squash(pre).lower for role, pre in
           dual.apply_roles(params, taps, state.components).items()}
  assert set(out.answer_ci) == {"output", "hidden"}
  for role, name in (("output", "answer_l0"), ("hidden", "answer_l0_hidden")):
    for site, ci_site in lower[role].items():
      np.testing.assert_allclose(out.answer_ci[role][site], ci_site[:, 2],
                                 rtol=1e-5)
      np.testing.assert_allclose(
        out.scalars[f"task/{name}/{site}"],
        np.mean(np.sum(np.asarray(ci_site[:, 2]) > 0.5, axis=-1)))
  # The hidden head is its own readout, not a copy of the output one.
  assert not np.allclose(out.answer_ci["hidden"]["mix"],
                         out.answer_ci["output"]["mix"])
  for site in one_role.alive:
    np.testing.assert_array_equal(out.alive[site], one_role.alive[site])
  for key, value in one_role.scalars.items():
    np.testing.assert_allclose(out.scalars[key], value, rtol=1e-5,
                               err_msg=key)
  assert set(out.scalars) - set(one_role.scalars) == {
    f"task/answer_l0_hidden/{s.name}" for s in target.sites}
