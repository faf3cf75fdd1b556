"""The attention-pattern recon of the fast eval (SPEC §11), end to end.

A tiny GLU LM decomposes layer 1's q_proj and k_proj exactly: `C = d_model`,
`V = I`, `U = W`, so `x·V` is `x` bit for bit and every mask of ones
reproduces the clean queries and keys bit for bit. A CI function of all
ones then leaves every attention row as it was (KL exactly 0, CI-masked
and stochastic); knocking out one q_proj component changes them.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, optim, sites as sites_lib, train_step
from decompax.core.schedules import Schedule
from decompax.losses import eval_step, recon
from decompax.losses import loss_terms as terms
from decompax.recipe import config as config_lib
from decompax.recipe import evaluation
from decompax.targets import glu_config, glu_lm, glu_target, tms

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
  sites = glu_target.site_specs(CONFIG, QK_SITES, CONFIG.d_model)
  target = glu_target.target_fns(CONFIG, sites)
  seg = glu_target.span_segments(CONFIG, sites)
  stack = glu_lm.init_stack(jax.random.key(0), CONFIG, CONFIG.n_layers)
  arrays = {k: np.asarray(v) for k, v in stack._asdict().items()
            if v is not None}
  arrays["embed"] = np.random.default_rng(1).standard_normal(
    (16, 8)).astype(np.float32)
  arrays["norm"] = np.ones(8, np.float32)
  weights = glu_target.weights_from_arrays(arrays, CONFIG, seg)
  stacks = target.frozen_stacks(weights)
  components = {kind: sites_lib.Factors(jnp.eye(8)[None], w)
                for kind, w in stacks.items()}
  ci_fn = _ones_ci_fn(sites)
  loss_terms = (terms.faithfulness_term(1.0),
                terms.stochastic_recon_term(
                  "stochastic_recon", 1.0, recon.all_sites_plan(sites),
                  False))
  adam = optim.AdamWConfig(Schedule(1e-3))
  built = train_step.make_train_step(target, ci_fn, loss_terms,
                                     train_step.StepConfig(10, adam, adam))
  state = built.init(components, ci_fn.init(None), jax.random.key(3), (B, T))
  return target, ci_fn, loss_terms, weights, state


@pytest.fixture(scope="module")
def scored(exact):
  target, ci_fn, loss_terms, weights, state = exact
  config = eval_step.EvalConfig(n_batches=2, total_steps=10, pgd_steps=0,
                                attention_kl=True)
  fns = eval_step.make_eval_step(target, ci_fn, loss_terms, config, _sample)

  def run(knock):
    knocked = state._replace(ci_params={"knock": jnp.array(knock)})
    output, _ = fns.fast(knocked, weights, jax.random.key(5))
    return eval_step.summarize(jax.device_get(output)).scalars

  return run(False), run(True)


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
  target, ci_fn, loss_terms, weights, state = exact
  fns = eval_step.make_eval_step(
    target, ci_fn, loss_terms,
    eval_step.EvalConfig(n_batches=1, total_steps=10, pgd_steps=0), _sample)
  scalars = jax.eval_shape(fns.fast, state, weights, jax.random.key(0)
                           )[0].scalars
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
    target = glu_target.target_fns(CONFIG, glu_target.site_specs(
      CONFIG, ("layers.1.mlp.up_proj",), 3))
  ci_fn = ci_fns.CIFn((), lambda key: {}, lambda p, t, c: {})
  with pytest.raises(ValueError, match=message):
    eval_step.make_eval_step(
      target, ci_fn, (), eval_step.EvalConfig(1, 10, attention_kl=True),
      _sample)


def test_the_run_evaluator_logs_and_prints_the_attention_scalars(
    exact, tmp_path, capsys):
  target, ci_fn, loss_terms, weights, state = exact
  config = dataclasses.replace(
    config_lib.DEFAULTS, target="hf", num_steps=10, eval_every=5,
    slow_eval_every=0, eval_batches=2, eval_pgd_steps=0,
    eval_attention_kl=True)
  evaluator = evaluation.make_evaluator(
    config, target, ci_fn, loss_terms, _sample, weights, str(tmp_path),
    say=print)
  knocked = state._replace(ci_params={"knock": jnp.array(True)})
  record = evaluator.evaluate(knocked, 5)
  evaluator.close()
  for name in SCORED:
    assert record[f"eval/{name}"] > 0, name
  line = capsys.readouterr().out
  assert re.search(r"\[eval\] step 5 .* attn_kl/ci_masked \d\.\d{3}e-?\d+ "
                   r" attn_kl/stochastic \d", line), line
