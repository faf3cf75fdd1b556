"""Dual-role CI (SPEC §6.6, I48): one trunk, two heads, the passes of a step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, ci_transformer, optim, sites as sites_lib
from decompax.core import step_records, train_step
from decompax.core.masks import SiteMask
from decompax.core.schedules import Schedule
from decompax.core.step_records import StreamSpec
from decompax.losses import hidden, loss_terms, recon

SITES = (sites_lib.SiteSpec("a", "a", 0, 3, 4, 5),
         sites_lib.SiteSpec("b", "b", 0, 4, 2, 3))
TRANSFORMER = ci_transformer.TransformerCIConfig(
  chunks=(ci_transformer.Chunk(("a",), ("a", "b")),), tap_widths=(("a", 3),),
  d_model=8, n_blocks=1, n_heads=2, d_mlp=8)
KINDS = {
  "component_mlp": ci_fns.CIConfig("component_mlp", (4,)),
  "vector_mlp": ci_fns.CIConfig("vector_mlp", (4,)),
  "site_mlp": ci_fns.CIConfig("site_mlp", (6, 5)),
  "global_mlp": ci_fns.CIConfig("global_mlp", (6,)),
  "transformer": ci_fns.CIConfig("transformer", transformer=TRANSFORMER),
}


def _dual(config):
  return ci_fns.CIConfig(config.kind, config.hidden, config.transformer,
                         roles=ci_fns.ROLES)


def _taps(key, lead=(2, 3)):
  return {s.name: jax.random.normal(jax.random.fold_in(key, i),
                                    (*lead, s.d_in))
          for i, s in enumerate(SITES)}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_trunk_gradient_is_the_sum_of_both_roles(kind):
  one = ci_fns.make_ci_fn(KINDS[kind], SITES)
  dual = ci_fns.make_ci_fn(_dual(KINDS[kind]), SITES)
  comps = sites_lib.init_components(jax.random.key(0), SITES)
  taps = _taps(jax.random.key(1))
  params = dual.init(jax.random.key(2))
  # The output role is the one-role function, drawn from the same key.
  jax.tree.map(np.testing.assert_array_equal, params.shared,
               one.init(jax.random.key(2)))
  weights = {s.name: jax.random.normal(jax.random.fold_in(
    jax.random.key(3), i), (2, 3, s.c)) for i, s in enumerate(SITES)}

  def role_loss(p, role):
    pre = dual.apply_roles(p, taps, comps)[role]
    return sum(jnp.sum(jnp.tanh(pre[s]) * weights[s]) for s in pre)

  @jax.jit
  def grads(p):
    return (jax.grad(role_loss)(p, ci_fns.OUTPUT),
            jax.grad(role_loss)(p, ci_fns.HIDDEN),
            jax.grad(lambda q: role_loss(q, ci_fns.OUTPUT)
                     + role_loss(q, ci_fns.HIDDEN))(p))

  g_out, g_hid, g_sum = grads(params)
  # The one set of trunk arrays takes both roles' gradients, summed; each
  # head only its own role's.
  for leaf in jax.tree.leaves(g_out.hidden_head):
    assert not np.any(np.asarray(leaf))
  assert any(np.any(np.asarray(leaf)) for leaf in
             jax.tree.leaves(g_hid.shared))
  jax.tree.map(lambda s, o, h: np.testing.assert_allclose(
    s, o + h, rtol=1e-5, atol=1e-6), g_sum, g_out, g_hid)
  np.testing.assert_array_equal(
    dual.apply(params, taps, comps)["a"],
    one.apply(params.shared, taps, comps)["a"])


def test_roles_are_refused_outside_output_and_hidden_and_without_a_trunk():
  with pytest.raises(ValueError, match="output,hidden"):
    ci_fns.CIConfig("vector_mlp", (4,), roles=("hidden",))
  with pytest.raises(ValueError, match="without hidden layers"):
    ci_fns.CIConfig("site_mlp", (), roles=ci_fns.ROLES)


# The step: two streams, two roles, four passes.
STREAMS = (StreamSpec("target", loss_positions=(2,)),
           StreamSpec("nontarget", delta_pin=True))
POINTS = ("mix.out", "head.out")


def _config(sequential=False, streams=STREAMS, points=POINTS):
  return step_records.StepConfig(
    total_steps=10, components_opt=optim.AdamWConfig(Schedule(1e-2)),
    ci_opt=optim.AdamWConfig(Schedule(1e-2)), streams=streams,
    hidden_points=points, sequential_passes=sequential)


def _terms(sites):
  plan = recon.all_sites_plan(sites)
  base = []
  for stream, prefix in (("target", ""), ("nontarget", "nontarget_")):
    base += [
      loss_terms.stochastic_recon_term(f"{prefix}recon", 1.0, plan, False),
      loss_terms.importance_minimality_term(0.1, 2.0,
                                            name=f"{prefix}imp")]
    base = [t._replace(stream=stream) if not t.stream else t for t in base]
  copies = [t._replace(name=f"{t.name}_hidden", role=ci_fns.HIDDEN)
            for t in base]
  return tuple(base + copies)


@pytest.fixture(scope="module")
def setup(token_target):
  target, weights = token_target
  ci = ci_fns.make_ci_fn(
    ci_fns.CIConfig("vector_mlp", (4,), roles=ci_fns.ROLES), target.sites)
  comps = sites_lib.init_components(jax.random.key(0), target.sites)
  ci_params = ci.init(jax.random.key(1))
  batches = {"target": jax.random.randint(jax.random.key(2), (3, 4), 0, 6),
             "nontarget": jax.random.randint(jax.random.key(3), (2, 5), 0, 6)}
  return target, weights, ci, comps, ci_params, batches


def _run(setup, config, steps):
  target, weights, ci, comps, ci_params, batches = setup
  built = train_step.make_train_step(target, ci, _terms(target.sites), config)
  state = built.init(*jax.tree.map(jnp.copy, (comps, ci_params)),
                     jax.random.key(4),
                     {k: v.shape for k, v in batches.items()})
  history = []
  for _ in range(steps):
    state, metrics = built.step(state, weights, batches)
    history.append(jax.device_get(metrics))
  return jax.device_get(state), history


@pytest.fixture(scope="module")
def fused(setup):
  return _run(setup, _config(), 3)


def test_sequential_passes_equal_the_fused_step(setup, fused):
  fused, fused_metrics = fused
  seq, seq_metrics = _run(setup, _config(sequential=True), 3)
  for a, b in zip(fused_metrics, seq_metrics):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-7, err_msg=k)
  for a, b in zip(jax.tree.leaves((fused.components, fused.ci_params)),
                  jax.tree.leaves((seq.components, seq.ci_params))):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_four_passes_report_each_role_and_the_hidden_pass_scores_hidden(
    setup, fused):
  target, weights, ci, comps, ci_params, batches = setup
  metrics = fused[1][0]
  assert {"target/ci_l0/mix", "target/ci_l0_hidden/mix",
          "nontarget/ci_l0_hidden/head", "target/loss/recon_hidden",
          "nontarget/loss/recon_hidden", "nontarget/loss/imp_hidden"} <= set(
    metrics)
  # The hidden pass scores the relative error of its points alone: 0 for the
  # forward that rebuilds W (masks and delta at 1), that error at half masks.
  clean, taps = target.clean_forward(weights, batches["target"], POINTS)
  ctx = step_records.StepContext(
    jnp.zeros((), jnp.int32), 10, target, weights, batches["target"], clean,
    comps, None, clean_taps=taps, hidden_points=POINTS)
  ones = {s.name: SiteMask(jnp.ones((3, 4, s.c)), jnp.ones((3, 4)))
          for s in target.sites}
  assert float(hidden.forward_loss(ctx, None)(ones)) == pytest.approx(
    0.0, abs=1e-10)
  halves = {s.name: SiteMask(jnp.full((3, 4, s.c), 0.5))
            for s in target.sites}
  _, masked = ctx.masked_forward_with_taps(halves, POINTS)
  np.testing.assert_allclose(
    hidden.forward_loss(ctx, None)(halves),
    hidden.relative_error(masked, taps, POINTS), rtol=1e-6)


def test_hidden_terms_need_a_hidden_role_and_hidden_points(setup):
  target, _, ci, *_ = setup
  one_role = ci_fns.make_ci_fn(ci_fns.CIConfig("vector_mlp", (4,)),
                               target.sites)
  with pytest.raises(ValueError, match="CI function's roles"):
    train_step.make_train_step(target, one_role, _terms(target.sites),
                               _config())
  with pytest.raises(ValueError, match="no hidden points"):
    train_step.make_train_step(target, ci, _terms(target.sites),
                               _config(points=()))
