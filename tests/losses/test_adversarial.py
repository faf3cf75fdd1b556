"""Persistent and fresh PGD terms in the step (SPEC §5.6, §5.7, I17, I20, I21)."""

import jax
import numpy as np
import pytest

from decompax.core import adversary, ci_fns, optim, sites as sites_lib
from decompax.core import train_step
from decompax.core.schedules import Schedule
from decompax.losses import adversarial, recon, terms

B = 8


def _persistent(target, coeff, n_warmup, step_rule="adam"):
  config = adversarial.PersistentConfig(
    adversary.SourceConfig(scope="c", step_rule=step_rule),
    Schedule(0.05), n_warmup=n_warmup)
  plan = recon.all_sites_plan(target.sites, "uniform_k", 1)
  return adversarial.persistent_pgd_term(
    "persistent", coeff, plan, config, target.sites, with_delta=True)


def _run(chain, extra_terms):
  target, weights = chain
  ci = ci_fns.make_ci_fn(ci_fns.CIConfig("site_mlp", (4,)), target.sites)
  cfg = train_step.StepConfig(
    total_steps=10, components_opt=optim.AdamWConfig(Schedule(1e-2)),
    ci_opt=optim.AdamWConfig(Schedule(1e-2)))
  all_terms = (terms.faithfulness_term(1.0), *extra_terms)
  built = train_step.make_train_step(target, ci, all_terms, cfg)
  comps = sites_lib.init_components(jax.random.key(0), target.sites)
  state = built.init(comps, ci.init(jax.random.key(1)), jax.random.key(2), (B,))
  x = jax.random.normal(jax.random.key(3), (B, 4))
  before = jax.tree.map(np.asarray, state._replace(rng=None))
  after, metrics = built.step(state, weights, x)
  return before, after, metrics, built, ci, x


@pytest.mark.parametrize("n_warmup", [0, 2])
def test_i17_source_updates_per_step(chain, n_warmup):
  _, after, _, _, _, _ = _run(chain, (_persistent(chain[0], 1.0, n_warmup),))
  assert int(after.term_states[1]["count"]) == n_warmup + 1


def test_i20_final_ascent_independent_of_coefficient(chain):
  _, after0, _, _, _, _ = _run(chain, (_persistent(chain[0], 0.0, 1),))
  _, after1, _, _, _, _ = _run(chain, (_persistent(chain[0], 3.0, 1),))
  for site in after0.term_states[1]["sources"]:
    np.testing.assert_allclose(
      after0.term_states[1]["sources"][site].source,
      after1.term_states[1]["sources"][site].source, rtol=1e-6, atol=1e-7)


def test_i21_warmup_ascents_touch_no_parameter(chain):
  _, with_adv, _, _, _, _ = _run(chain, (_persistent(chain[0], 0.0, 3),))
  _, without, _, _, _, _ = _run(chain, ())
  for kind in without.components:
    np.testing.assert_array_equal(with_adv.components[kind].v,
                                  without.components[kind].v)
  np.testing.assert_array_equal(
    with_adv.ci_params["l0"][0].w, without.ci_params["l0"][0].w)


def test_i18_clamp_sources_stay_in_range_after_steps(chain):
  _, after, _, _, _, _ = _run(chain, (_persistent(chain[0], 1.0, 2, "sign"),))
  for s in after.term_states[1]["sources"].values():
    assert float(s.source.min()) >= 0.0 and float(s.source.max()) <= 1.0


def test_persistent_config_refusals():
  with pytest.raises(ValueError, match="not linear"):
    adversarial.PersistentConfig(adversary.SourceConfig(),
                                 Schedule(0.1, "linear", final_frac=0.0))
  with pytest.raises(ValueError, match="objective"):
    adversarial.PersistentConfig(adversary.SourceConfig(), Schedule(0.1),
                                 objective="both")


def test_fresh_pgd_term_runs_and_is_finite(chain):
  target = chain[0]
  term = adversarial.fresh_pgd_term(
    "fresh", 1.0, recon.all_sites_plan(target.sites, "uniform_k", 1),
    adversarial.FreshConfig("random", "bc", n_steps=2, step_size=0.1), True)
  _, after, metrics, _, _, _ = _run(chain, (term,))
  assert np.isfinite(float(metrics["loss/fresh"]))
  assert int(after.step) == 1


def test_i24_fresh_pgd_raises_the_loss_over_its_init(chain):
  target = chain[0]
  plan = recon.all_sites_plan(target.sites, "all", 1)
  values = {}
  for n_steps in (0, 3):
    term = adversarial.fresh_pgd_term(
      "fresh", 1.0, plan,
      adversarial.FreshConfig("ones", "bc", n_steps=n_steps, step_size=0.2),
      False)
    _, _, metrics, _, _, _ = _run(chain, (term,))
    values[n_steps] = float(metrics["loss/fresh"])
  assert values[3] > values[0]
