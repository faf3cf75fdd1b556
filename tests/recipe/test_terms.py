"""recipe/terms: the settings of the minimality terms reach the built
terms (SPEC §5.2)."""

import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import sites as sites_lib, squash
from decompax.core.step_records import StepContext
from decompax.recipe import terms
from decompax.recipe.config import TrainConfig

SITES = (sites_lib.SiteSpec("a", "a", 0, 3, 4, 2),)
INPUTS = terms.TermInputs(SITES, 4, None, (4,))
STEPS = 11
# Distinct lower and upper CI: the importance term reads the upper one.
UPPER = jnp.array([[0.3, 0.0], [1.0, 0.5]])
LOWER = jnp.array([[0.1, 0.0], [0.9, 0.2]])


def _importance(config: TrainConfig, step: int) -> float:
  built = {t.name: t for t in terms.build_terms(config, INPUTS)}
  ci = squash.CIOutput(pre=UPPER, lower={"a": LOWER}, upper={"a": UPPER})
  ctx = StepContext(jnp.asarray(step), STEPS, None, None, None,
                    jnp.zeros(()), {}, ci)
  return float(built["importance_minimality"].fn(ctx, None, None)[0])


def _lp(p: float) -> float:
  return float(np.sum(np.mean((np.asarray(UPPER) + 1e-12) ** p, axis=0)))


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_the_p_anneal_runs_from_p_start_to_its_final_fraction(schedule):
  # I32: a decay reaches f·start exactly at the last step.
  config = TrainConfig(num_steps=STEPS, p_start=2.0, p_schedule=schedule,
                       p_final_frac=0.25)
  # The last step (`num_steps - 1` completed) is at p_start·p_final_frac.
  np.testing.assert_allclose(_importance(config, 0), _lp(2.0), rtol=1e-6)
  np.testing.assert_allclose(_importance(config, STEPS - 1), _lp(0.5),
                             rtol=1e-6)
  np.testing.assert_allclose(_importance(config, STEPS // 2),
                             _lp(2.0 * (0.25 + 0.75 * 0.5)), rtol=1e-6)


SITE_NAMES = ("layers.0.mlp.up", "layers.0.mlp.down", "layers.1.mlp.up")
NAMED_SITES = tuple(sites_lib.SiteSpec(n, n, 0, 3, 4, 2) for n in SITE_NAMES)


def test_site_weights_take_the_last_matching_glob_and_default_to_one():
  config = TrainConfig(importance_site_weights=(
    "layers.0.*:4", "layers.0.mlp.down:8"))
  assert terms.importance_site_weights(config, NAMED_SITES) == {
    "layers.0.mlp.up": 4.0, "layers.0.mlp.down": 8.0,
    "layers.1.mlp.up": 1.0}
  assert terms.importance_site_weights(TrainConfig(), NAMED_SITES) == {
    n: 1.0 for n in SITE_NAMES}


@pytest.mark.parametrize("entry,message", [
  ("layers.9.*:2", "names no site"),
  ("layers.0.*:-1", "finite weight >= 0"),
  ("layers.0.*:none", "finite weight >= 0"),
  # Refused as the config is built (its domain: finite numbers).
  ("layers.0.*:inf", "'inf' is not a finite number"),
  (":2", "finite weight >= 0"),
])
def test_a_site_weight_naming_no_site_or_no_weight_is_refused(entry, message):
  with pytest.raises(ValueError, match=message):
    config = TrainConfig(importance_site_weights=(entry,))
    terms.importance_site_weights(config, NAMED_SITES)


def test_the_built_importance_term_scales_its_site():
  # One site, weight 3: the term is three times the unweighted one.
  weighted = TrainConfig(num_steps=STEPS, importance_site_weights=("a:3",))
  np.testing.assert_allclose(_importance(weighted, 0),
                             3 * _importance(TrainConfig(num_steps=STEPS), 0),
                             rtol=1e-6)
