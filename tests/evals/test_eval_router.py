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
import pytest

from decompax.core import ci_fns, sites as sites_lib
from decompax.targets import glu_config, glu_sites, glu_target

from .exact_lm_eval import (evaluator_record, exact_run, fast_scalars,
                            random_weights, unscored_names)

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


def _exact_run(config, name):
  """Return target, CI function, terms, weights and state decomposing site
  `name` (`d_out = d_ff` wide) exactly."""
  sites = glu_sites.site_specs(config, (name,), config.d_ff)
  target = glu_target.target_fns(config, sites)
  weights = random_weights(config, sites)
  components = {kind: sites_lib.Factors(w, jnp.eye(config.d_ff)[None])
                for kind, w in target.frozen_stacks(weights).items()}
  return exact_run(target, _ones_ci_fn(sites[0]), components, weights,
                   (B, T))


@pytest.fixture(scope="module")
def exact():
  return _exact_run(CONFIG, SITE)


@pytest.fixture(scope="module")
def scored(exact):
  return fast_scalars(exact, _sample)


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
  scalars = unscored_names(_exact_run(config, "layers.0.mlp.up_proj"),
                           _sample)
  assert "recon/ci_masked" in scalars
  assert not any(k.startswith("router_kl/") for k in scalars)


def test_the_run_evaluator_logs_and_prints_the_router_scalars(
    exact, tmp_path, capsys):
  record = evaluator_record(exact, _sample, tmp_path)
  for name in SCORED:
    assert record[f"eval/{name}"] > 0, name
  line = capsys.readouterr().out
  assert re.search(r"\[eval\] step 5 .* router_kl/ci_masked \d\.\d{3}e-?\d+ "
                   r" router_kl/stochastic \d", line), line
