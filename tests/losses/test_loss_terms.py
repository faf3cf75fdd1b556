"""The loss-term constructors on a tiny TMS: each term's value is the
formula it names (SPEC §5.1, §5.2, §6.6) computed directly, and settings no
term can use are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import sites as sites_lib, squash
from decompax.core.schedules import Schedule
from decompax.core.step_records import StepContext
from decompax.losses import loss_terms
from decompax.targets import tms

CONFIG = tms.TmsConfig(n_features=5, n_hidden=2)
FNS = tms.target_fns(CONFIG, 2)
RNG = np.random.default_rng(0)
WEIGHTS = tms.TmsWeights(jnp.asarray(RNG.standard_normal((5, 2)), jnp.float32),
                         jnp.asarray(RNG.standard_normal(5), jnp.float32))
# Exact rank-2 factors: linear1 = W·I, linear2 = I·Wᵀ.
EXACT = {"linear1": sites_lib.Factors(WEIGHTS.w[None], jnp.eye(2)[None]),
         "linear2": sites_lib.Factors(jnp.eye(2)[None], WEIGHTS.w.T[None])}
UPPER = {"linear1": jnp.asarray(RNG.uniform(size=(4, 2)), jnp.float32),
         "linear2": jnp.asarray(RNG.uniform(size=(4, 2)), jnp.float32)}
INPUTS = jnp.asarray(RNG.uniform(size=(4, 5)), jnp.float32)


def _context(components):
  ci = squash.CIOutput(pre=UPPER, lower=UPPER, upper=UPPER)
  clean = tms.forward(WEIGHTS, INPUTS)
  return StepContext(jnp.asarray(0), 10, FNS, WEIGHTS, INPUTS, clean,
                     components, ci)


def _value(term, components=EXACT):
  return float(term.fn(_context(components), jax.random.key(0), None)[0])


def test_exact_factors_have_no_faithfulness_loss_and_rebuild_the_model():
  assert _value(loss_terms.faithfulness_term(1.0)) == pytest.approx(
    0, abs=1e-12)
  assert _value(loss_terms.unmasked_no_delta_term("u", 1.0)) == (
    pytest.approx(0, abs=1e-10))
  off = {**EXACT, "linear1": EXACT["linear1"]._replace(
    v=EXACT["linear1"].v + 1.0)}
  want = np.mean(np.square(np.ones((5, 2)) @ np.eye(2)))
  # The mean squared delta over every element of both kinds' stacks.
  assert _value(loss_terms.faithfulness_term(1.0), off) == pytest.approx(
    want * 10 / 20)


def test_importance_minimality_sums_the_powers_of_the_upper_ci():
  p = 2.0
  want = sum(np.sum(np.mean((np.asarray(c) + 1e-12) ** p, axis=0))
             for c in UPPER.values())
  term = loss_terms.importance_minimality_term(1.0, p, eps=1e-12)
  assert _value(term) == pytest.approx(want, rel=1e-5)
  weighted = loss_terms.importance_minimality_term(
    1.0, p, eps=1e-12, site_weights={"linear1": 0.0})
  assert _value(weighted) == pytest.approx(
    np.sum(np.mean(np.asarray(UPPER["linear2"]) ** p, axis=0)), rel=1e-5)


def test_settings_no_term_can_use_are_refused():
  with pytest.raises(ValueError, match="takes no warmup"):
    loss_terms.importance_minimality_term(
      1.0, Schedule(2.0, "linear", 0.5, warmup_pct=0.1))
  with pytest.raises(ValueError, match="reference_token_count"):
    loss_terms.frequency_minimality_term(1.0, 1.0, 0.0)
