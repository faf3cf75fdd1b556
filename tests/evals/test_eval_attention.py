"""The attention-pattern recon of the fast eval (SPEC §11), end to end.

A tiny GLU LM decomposes layer 1's q_proj and k_proj exactly: `C = d_model`,
`V = I`, `U = W`, so `x·V` is `x` bit for bit and every mask of ones
reproduces the clean queries and keys bit for bit. A CI function of all
ones then leaves every attention row as it was (KL exactly 0, CI-masked
and stochastic); knocking out one q_proj component changes them.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from decompax.core import ci_fns, sites as sites_lib
from decompax.evals import eval_step
from decompax.targets import glu_config, glu_sites, glu_target, tms

from .exact_lm_eval import (evaluator_record, exact_run, fast_scalars,
                            random_weights, unscored_names)

CONFIG = glu_config.GluConfig(
  n_layers=2, d_model=8, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=8,
  vocab_size=16, rope_theta=10000.0, rms_eps=1e-6, tied=True, qk_norm=False)
B, T = 2, 5
QK_SITES = ("layers.1.self_attn.q_proj", "layers.1.self_attn.k_proj")
SCORED = ("attn_kl/ci_masked/layers.1", "attn_kl/stochastic/layers.1",
          "attn_kl/ci_masked/all", "attn_kl/stochastic/all")


def _ones_ci_fn(sites):
  """CI 1 everywhere, but 0 on q_proj's component 0 when `knock` is set."""

  def apply(params, taps, components):
    del components
    out = {}
    for s in sites:
      pre = jnp.full(taps["resid.1"].shape[:-1] + (s.c,), 2.0)
      if s.name == QK_SITES[0]:
        pre = pre.at[..., 0].set(jnp.where(params["knock"], -1.0, 2.0))
      out[s.name] = pre
    return out

  return ci_fns.CIFn(("resid.1",), lambda key: {"knock": jnp.array(False)},
                     apply)


def _sample(key):
  return jax.random.randint(key, (B, T), 0, CONFIG.vocab_size)


@pytest.fixture(scope="module")
def exact():
  sites = glu_sites.site_specs(CONFIG, QK_SITES, CONFIG.d_model)
  target = glu_target.target_fns(CONFIG, sites)
  weights = random_weights(CONFIG, sites)
  components = {kind: sites_lib.Factors(jnp.eye(8)[None], w)
                for kind, w in target.frozen_stacks(weights).items()}
  return exact_run(target, _ones_ci_fn(sites), components, weights, (B, T))


@pytest.fixture(scope="module")
def scored(exact):
  return fast_scalars(exact, _sample, attention_kl=True)


def test_an_exact_decomposition_keeps_every_attention_row(scored):
  exact, _ = scored
  for name in SCORED:
    assert exact[name] == 0.0, name


def test_ablating_a_q_proj_component_moves_the_attention_rows(scored):
  _, knocked = scored
  for name in SCORED:
    assert knocked[name] > 1e-6, name
  assert knocked["attn_kl/ci_masked/all"] == knocked[
    "attn_kl/ci_masked/layers.1"]


def test_the_eval_scores_attention_only_when_asked(exact):
  scalars = unscored_names(exact, _sample)
  assert "recon/ci_masked" in scalars
  assert not any(k.startswith("attn_kl/") for k in scalars)


@pytest.mark.parametrize("which,message", [
  ("toy", "this target has no attention"),
  ("mlp_only", "no site is one"),
])
def test_the_eval_refuses_targets_it_cannot_score(which, message):
  if which == "toy":
    target = tms.target_fns(tms.TmsConfig(5, 2), 3)
  else:
    target = glu_target.target_fns(CONFIG, glu_sites.site_specs(
      CONFIG, ("layers.1.mlp.up_proj",), 3))
  ci_fn = ci_fns.CIFn((), lambda key: {}, lambda p, t, c: {})
  with pytest.raises(ValueError, match=message):
    eval_step.make_eval_step(
      target, ci_fn, (), eval_step.EvalConfig(1, 10, attention_kl=True),
      _sample)


def test_the_run_evaluator_logs_and_prints_the_attention_scalars(
    exact, tmp_path, capsys):
  record = evaluator_record(exact, _sample, tmp_path, eval_attention_kl=True)
  for name in SCORED:
    assert record[f"eval/{name}"] > 0, name
  line = capsys.readouterr().out
  assert re.search(r"\[eval\] step 5 .* attn_kl/ci_masked \d\.\d{3}e-?\d+ "
                   r" attn_kl/stochastic \d", line), line
