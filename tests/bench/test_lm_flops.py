"""bench/lm_flops.py: the recipe's matmul count is the one its compiled
step runs (`hlo_flops`), and it refuses what it does not follow."""

import pathlib

import jax
import jax.numpy as jnp
import pytest

from bench import hlo_flops, lm_flops, random_lm
from decompax.recipe.config import read_args
from decompax.targets import glu_config, glu_lm, glu_target

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


def sites_of(layer, roles, c=4):
  names = tuple(glu_lm.site_name(layer, r) for r in roles)
  return glu_target.site_specs(MODEL, names, c)


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


def _both_counts(config, sites):
  weights = random_lm.random_weights(jax.random.key(0), MODEL, sites,
                                     jnp.float32)
  run = random_lm.build_run(config, MODEL, sites, weights)
  compiled = run.built.step.lower(run.state, run.weights,
                                  run.data_key).compile()
  counted = hlo_flops.compiled_matmul_flops(compiled.as_text())
  return lm_flops.lm_step_flops(config, MODEL, sites), counted


# The default suite checks the l18 sites (tests/bench/test_lm_step.py);
# these take the other paths of the count.
@pytest.mark.slow
@pytest.mark.parametrize("overrides, roles, layer", [
  # Every role live: the attention and each input gradient run too.
  (("--noci_remat",), glu_lm.ROLES, 2),
  # No recon term: nothing reads the clean output past the CI's tap.
  (("--stochastic_coeff=0", "--pgd_coeff=0"), ("down",), 1),
  (("--n_mask_samples=2", "--pgd_n_warmup=1", "--c=16"), ("o", "up"), 1),
  (("--seq_len=16", "--batch_size=1"), ("gate", "up", "down"), 3),
  # The head chunked over positions: 8 in chunks of 3, the last ragged.
  (("--output_chunk=3",), ("gate", "up", "down"), 2),
  (("--output_chunk=2", "--n_mask_samples=2", "--pgd_n_warmup=1"),
   ("o", "up"), 1),
])
def test_the_recipe_count_is_the_compiled_one(overrides, roles, layer):
  predicted, counted = _both_counts(recipe(*overrides),
                                    sites_of(layer, roles))
  assert counted.uncounted == {}
  assert predicted.executed == pytest.approx(counted.flops, rel=1e-9)
  assert predicted.model < predicted.executed
