"""The SPEC options that are flags reach the library: relative
faithfulness, smooth-L0 minimality, knot schedules and static-probability
routing (SPEC §5.1, §5.2, §5.4, §6.4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import schedules, sites as sites_lib, squash
from decompax.core.step_records import StepContext
from decompax.losses import faithfulness, minimality
from decompax.recipe import assembly, engine
from decompax.recipe import terms as term_table

TINY = ("--c=6", "--batch_size=8", "--num_steps=11")


def _terms(config):
  toy, target, _ = assembly.resolve_target(config)
  return {t.name: t for t in assembly.parts(config, toy, target).terms}, \
    toy, target


def _context(toy, target, step=0):
  weights = toy.init(jax.random.key(0))
  components = sites_lib.init_components(jax.random.key(1), target.sites)
  upper = {s.name: jax.random.uniform(jax.random.fold_in(
    jax.random.key(2), i), (8, s.c)) for i, s in enumerate(target.sites)}
  ci = squash.CIOutput(pre=upper, lower=upper, upper=upper)
  return StepContext(jnp.asarray(step), 11, target, weights, None,
                     jnp.zeros(()), components, ci)


def _value(term, ctx):
  return float(term.fn(ctx, jax.random.key(3), None)[0])


def test_relative_faithfulness_flag(parse):
  built, toy, target = _terms(parse(*TINY, "--faithfulness_form=relative"))
  ctx = _context(toy, target)
  expected = faithfulness.relative_faithfulness_per_kind(
    target.frozen_stacks(ctx.weights), ctx.components)
  np.testing.assert_allclose(_value(built["faithfulness"], ctx), expected,
                             rtol=1e-6)
  default, _, _ = _terms(parse(*TINY))
  assert abs(_value(default["faithfulness"], ctx) - float(expected)) > 1e-3


def test_smooth_l0_flags_anneal_gamma(parse):
  built, toy, target = _terms(parse(
    *TINY, "--importance_penalty=smooth_l0", "--smooth_l0_gamma=0.5",
    "--smooth_l0_gamma_schedule=linear", "--smooth_l0_gamma_final_frac=0.1",
    "--smooth_l0_normalized"))
  for step, gamma in ((0, 0.5), (10, 0.05)):
    ctx = _context(toy, target, step)
    expected = sum(float(minimality.smooth_l0_frequencies(c, gamma, True).sum())
                   for c in ctx.ci.upper.values())
    np.testing.assert_allclose(_value(built["importance_minimality"], ctx),
                               expected, rtol=1e-5)


def test_knot_flags_shape_the_lr_and_p(parse):
  config = parse(*TINY, "--lr=0.02", "--lr_knots=0:0,0.5:1:cosine,1:0.25",
                 "--p_start=2", "--p_knots=0:1:hold,0.5:1,1:0.5")
  lr = engine.step_config(config).components_opt.lr
  values = [float(schedules.schedule_value(lr, s, 11)) for s in (0, 5, 10)]
  np.testing.assert_allclose(values, [0.0, 0.02, 0.005], rtol=1e-5)
  built, toy, target = _terms(config)
  ctx = _context(toy, target, step=10)  # p = 2·0.5 = 1 at the end
  expected = sum(float(minimality.component_frequencies(c, 1.0).sum())
                 for c in ctx.ci.upper.values())
  np.testing.assert_allclose(_value(built["importance_minimality"], ctx),
                             expected, rtol=1e-5)


def test_static_probability_routing_flags_reach_every_plan(parse):
  config = parse(*TINY, "--stochastic_routing=static_probability",
                 "--route_probability=0.3")
  _, _, target = _terms(config)
  plan = term_table.make_plan(config, target.sites, "all_sites",
                              "static_probability", 1)
  assert [(e.routing, e.route_probability) for e in plan] == [
    ("static_probability", 0.3)]
  assert term_table.make_plan(config, target.sites, "subset", "uniform_k",
                              1)[0].route_probability is None


@pytest.mark.parametrize("args, message", [
  (("--lr_knots=0:0,1:1", "--lr_warmup_pct=0.1"), "--lr_knots replaces"),
  (("--p_knots=0:1,1:0.5", "--p_schedule=linear", "--p_final_frac=0.5"),
   "--p_knots replaces"),
  (("--importance_penalty=smooth_l0", "--p_knots=0:1,1:0.5"),
   "smooth_l0 does not use"),
])
def test_conflicting_schedule_flags_are_refused(parse, args, message):
  with pytest.raises(ValueError, match=message):
    parse(*TINY, *args)


@pytest.mark.parametrize("args, message", [
  (("--lr_knots=0:0,0.5:0.5",), "--lr_knots"),
  (("--importance_penalty=smooth_l0", "--smooth_l0_gamma_final_frac=0"),
   "--smooth_l0_gamma_final_frac"),
  (("--stochastic_routing=static_probability", "--route_probability=0"),
   "--route_probability"),
])
def test_bad_option_values_name_their_flag(parse, args, message):
  """Refused where it is first seen: a setting's own domain when the
  config is built, a rule joining several when the run is assembled."""
  with pytest.raises(ValueError, match=message):
    config = parse(*TINY, *args)
    toy, target, _ = assembly.resolve_target(config)
    parts = assembly.parts(config, toy, target)
    engine.step_config(config)
    del parts
