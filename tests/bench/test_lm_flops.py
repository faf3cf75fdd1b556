"""bench/lm_flops.py: the recipe's matmul count is the one its compiled
step runs (`hlo_flops`), and it refuses what it does not follow."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import pytest

from bench import hlo_flops, lm_flops, random_lm
from decompax.recipe.flagfiles import read_args
from decompax.targets import glu_config, glu_sites, glu_weights

MODEL = glu_config.GluConfig(
  n_layers=4, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8,
  vocab_size=16, rope_theta=500000.0, rms_eps=1e-5, tied=False,
  qk_norm=False)
L18 = pathlib.Path(__file__).resolve().parents[2] / "flags" / "l18.flags"
# The recipe at CPU sizes.
TINY = ("--compute_dtype=float32", "--attention=reference",
        "--ci_attention=reference", "--ci_d_model=16", "--ci_n_blocks=1",
        "--ci_n_heads=2", "--ci_d_mlp=32", "--batch_size=2", "--seq_len=4",
        "--c=4")


def recipe(*overrides):
  return read_args([f"--flagfile={L18}", *TINY, *overrides])


# A mixture of experts, its widths apart from the attention's and the
# batch's so that no two products share a shape.
MOE = glu_config.GluConfig(
  n_layers=4, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=5,
  vocab_size=16, rope_theta=1e6, rms_eps=1e-6, tied=False, qk_norm=True,
  family="qwen3_moe", n_experts=3, experts_per_token=2, norm_topk=True)


def sites_of(layer, roles, c=4):
  names = tuple(glu_weights.site_name(layer, r) for r in roles)
  return glu_sites.site_specs(MODEL, names, c)


def expert_sites(layer, roles=glu_weights.EXPERT_ROLES, experts=range(3),
                 attention=(), c=4):
  names = tuple(glu_weights.site_name(layer, r) for r in attention) + tuple(
    glu_weights.site_name(layer, r, e) for e in experts for r in roles)
  return glu_sites.site_specs(MOE, names, c)


def test_the_count_refuses_what_it_does_not_follow():
  with pytest.raises(ValueError, match="--per_site_coeff"):
    lm_flops.lm_step_flops(recipe("--per_site_coeff=1"), MODEL,
                           sites_of(2, ("up",)))
  with pytest.raises(ValueError, match="--ci_fn"):
    lm_flops.lm_step_flops(recipe("--ci_fn=vector_mlp"), MODEL,
                           sites_of(2, ("up",)))
  with pytest.raises(ValueError, match="one layer"):
    lm_flops.lm_step_flops(recipe(), MODEL, sites_of(1, ("up",))
                           + sites_of(2, ("up",)))
  with pytest.raises(ValueError, match="one C per expert role; "
                     "expert_up has 4 and 6"):
    lm_flops.lm_step_flops(recipe(), MOE, expert_sites(
      1, ("expert_up",), (0,)) + expert_sites(1, ("expert_up",), (1,), c=6))


def test_a_mixture_of_experts_counts_every_expert():
  # The forward runs all experts, so the count grows with their number
  # and barely with how many a position is routed to (the one-hot product
  # of the routing weights alone).
  config, sites = recipe(), expert_sites(1, experts=(0,))
  clean = {m: lm_flops.lm_step_flops(config, m, sites).work["clean forward"]
           for m in (MOE, dataclasses.replace(MOE, n_experts=6),
                     dataclasses.replace(MOE, experts_per_token=1))}
  tokens, layers, d, k = 2 * 4, MOE.n_layers, MOE.d_model, 2
  # Per added expert: its three matrices, its router column, its share
  # of the one-hot product and of the weighted sum.
  added = 3 * 2 * d * MOE.d_ff + 2 * d + 2 * k + 2 * d
  values = list(clean.values())
  assert values[1] - values[0] == 3 * added * tokens * layers
  assert values[0] - values[2] == 2 * 3 * tokens * layers


def _both_counts(config, sites, model=MODEL):
  weights = random_lm.random_weights(jax.random.key(0), model, sites,
                                     jnp.float32)
  run = random_lm.build_run(config, model, sites, weights)
  compiled = run.built.step.lower(run.state, run.weights,
                                  run.data_key).compile()
  counted = hlo_flops.compiled_matmul_flops(compiled.as_text())
  return lm_flops.lm_step_flops(config, model, sites), counted


# The default suite checks the l18 sites (tests/bench/test_lm_step.py);
# these take the other paths of the count.
@pytest.mark.slow
@pytest.mark.parametrize("overrides, roles, layer", [
  # Every role live: the attention and each input gradient run too.
  (("--noci_remat",), glu_weights.ROLES, 2),
  # The adversary's recon alone (a run needs one recon term): no
  # stochastic masked forwards.
  (("--stochastic_coeff=0",), ("down",), 1),
  (("--n_mask_samples=2", "--pgd_n_warmup=1", "--c=16"), ("o", "up"), 1),
  (("--seq_len=16", "--batch_size=1"), ("gate", "up", "down"), 3),
  # The head chunked over positions: 8 in chunks of 3, the last ragged.
  (("--output_chunk=3",), ("gate", "up", "down"), 2),
  (("--output_chunk=2", "--n_mask_samples=2", "--pgd_n_warmup=1"),
   ("o", "up"), 1),
  # Live values alone, or queries alone: part of the attention's products.
  ((), ("v",), 1),
  ((), ("q",), 1),
  ((), ("v", "up"), 1),
])
def test_the_recipe_count_is_the_compiled_one(overrides, roles, layer):
  predicted, counted = _both_counts(recipe(*overrides),
                                    sites_of(layer, roles))
  assert counted.uncounted == {}
  assert predicted.executed == pytest.approx(counted.flops, rel=1e-9)
  assert predicted.model < predicted.executed


@pytest.mark.slow
def test_the_count_of_one_layers_experts_is_the_compiled_one():
  # Every expert's gate, up and down of a middle layer: the memory bench's
  # Qwen3-30B-A3B row, at CPU sizes.
  predicted, counted = _both_counts(recipe("--c=6"), expert_sites(1, c=6),
                                    MOE)
  assert counted.uncounted == {}
  assert predicted.executed == pytest.approx(counted.flops, rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("overrides, sites", [
  (("--c=7", "--pgd_coeff=0"), expert_sites(1, c=7)),
  # Experts without a site: the live roles' frozen products run too.
  ((), expert_sites(1, experts=(0, 2))),
  # A decomposed attention makes the router's input live.
  ((), expert_sites(1, attention=("v",))),
  ((), expert_sites(1, attention=("o",), roles=())),
  ((), expert_sites(1, ("expert_gate", "expert_up"))),
  (("--pgd_n_warmup=0",), expert_sites(1, ("expert_down",))),
  ((), expert_sites(3)),
])
def test_the_mixture_of_experts_count_is_the_compiled_one(overrides, sites):
  predicted, counted = _both_counts(recipe(*overrides), sites, MOE)
  assert counted.uncounted == {}
  assert predicted.executed == pytest.approx(counted.flops, rel=1e-9)
