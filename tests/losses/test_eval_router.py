"""The router recon of the fast eval (design §11), end to end.

A tiny two-layer mixture-of-experts LM decomposes layer 0's expert 1
up_proj exactly: `C = d_ff`, `V = W`, `U = I`, so every mask of ones
reproduces the clean forward bit for bit. Layer 0's router reads the
block's stream before its experts, so only layer 1's is scored. A CI
function of all ones leaves layer 1's router distribution as it was (KL
exactly 0, CI-masked and stochastic); knocking out one component moves it.
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
from decompax.targets import glu_config, glu_lm, glu_target

CONFIG = glu_config.GluConfig(
  n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=4,
  vocab_size=16, rope_theta=1e4, rms_eps=1e-6, tied=True, qk_norm=True,
  family="qwen3_moe", n_experts=4, experts_per_token=2, norm_topk=True)
B, T = 2, 6
SITE = "layers.0.mlp.experts.1.up_proj"
SCORED = ("router_kl/ci_masked/layers.1", "router_kl/stochastic/layers.1",
          "router_kl/ci_masked/all", "router_kl/stochastic/all")


def _ones_ci_fn(site):
  """CI 1 everywhere, but 0 on component 0 when `knock` is set."""

  def apply(params, taps, components):
    del components
    pre = jnp.full(taps["resid.0"].shape[:-1] + (site.c,), 2.0)
    return {site.name: pre.at[..., 0].set(
      jnp.where(params["knock"], -1.0, 2.0))}

  return ci_fns.CIFn(("resid.0",), lambda key: {"knock": jnp.array(False)},
                     apply)


def _sample(key):
  return jax.random.randint(key, (B, T), 0, CONFIG.vocab_size)


def _weights(config, sites):
  stack = glu_lm.init_stack(jax.random.key(0), config, config.n_layers)
  arrays = {k: np.asarray(v) for k, v in stack._asdict().items()
            if v is not None}
  arrays["embed"] = np.random.default_rng(1).standard_normal(
    (config.vocab_size, config.d_model)).astype(np.float32)
  arrays["norm"] = np.ones(config.d_model, np.float32)
  return glu_target.weights_from_arrays(
    arrays, config, glu_target.span_segments(config, sites))


def _exact_run(config, name):
  """Return target, CI function, terms, weights and state decomposing site
  `name` (`d_out = d_ff` wide) exactly."""
  sites = glu_target.site_specs(config, (name,), config.d_ff)
  target = glu_target.target_fns(config, sites)
  weights = _weights(config, sites)
  components = {kind: sites_lib.Factors(w, jnp.eye(config.d_ff)[None])
                for kind, w in target.frozen_stacks(weights).items()}
  ci_fn = _ones_ci_fn(sites[0])
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
def exact():
  return _exact_run(CONFIG, SITE)


@pytest.fixture(scope="module")
def scored(exact):
  target, ci_fn, loss_terms, weights, state = exact
  config = eval_step.EvalConfig(n_batches=2, total_steps=10, pgd_steps=0)
  fns = eval_step.make_eval_step(target, ci_fn, loss_terms, config, _sample)

  def run(knock):
    knocked = state._replace(ci_params={"knock": jnp.array(knock)})
    output, _ = fns.fast(knocked, weights, jax.random.key(5))
    return eval_step.summarize(jax.device_get(output)).scalars

  return run(False), run(True)


def test_only_the_routers_masking_moves_are_scored(scored):
  for scalars in scored:
    assert sorted(k for k in scalars if k.startswith("router_kl/")) == (
      sorted(SCORED))


def test_an_exact_decomposition_keeps_every_router_distribution(
    scored):  # I56
  exact, _ = scored
  for name in SCORED:
    assert exact[name] == 0.0, name


def test_ablating_an_expert_component_moves_the_next_router(scored):
  _, knocked = scored
  for name in SCORED:
    assert knocked[name] > 1e-6, name
  assert knocked["router_kl/ci_masked/all"] == knocked[
    "router_kl/ci_masked/layers.1"]


def test_a_dense_model_reports_no_router_recon():  # I56
  config = dataclasses.replace(CONFIG, family="qwen3", n_experts=0,
                               experts_per_token=0)
  target, ci_fn, loss_terms, weights, state = _exact_run(
    config, "layers.0.mlp.up_proj")
  fns = eval_step.make_eval_step(
    target, ci_fn, loss_terms,
    eval_step.EvalConfig(n_batches=1, total_steps=10, pgd_steps=0), _sample)
  scalars = jax.eval_shape(fns.fast, state, weights, jax.random.key(0)
                           )[0].scalars
  assert "recon/ci_masked" in scalars
  assert not any(k.startswith("router_kl/") for k in scalars)


def test_the_run_evaluator_logs_and_prints_the_router_scalars(
    exact, tmp_path, capsys):
  target, ci_fn, loss_terms, weights, state = exact
  config = dataclasses.replace(
    config_lib.DEFAULTS, target="hf", num_steps=10, eval_every=5,
    slow_eval_every=0, eval_batches=2, eval_pgd_steps=0)
  evaluator = evaluation.make_evaluator(
    config, target, ci_fn, loss_terms, _sample, weights, str(tmp_path),
    say=print)
  knocked = state._replace(ci_params={"knock": jnp.array(True)})
  record = evaluator.evaluate(knocked, 5)
  evaluator.close()
  for name in SCORED:
    assert record[f"eval/{name}"] > 0, name
  line = capsys.readouterr().out
  assert re.search(r"\[eval\] step 5 .* router_kl/ci_masked \d\.\d{3}e-?\d+ "
                   r" router_kl/stochastic \d", line), line
