"""A targeted decomposition placed on a mesh (SPEC §6.6, D4, I34): two
streams of different lead shapes, each batch-sharded, the same trajectory
as on one device."""

import pytest

from decompax.bin import train_flags

pytestmark = pytest.mark.multidevice

TPD = ("--target=induction", "--c=8", "--ci_fn=vector_mlp", "--ci_hidden=4",
       "--num_steps=4", "--eval_every=0", "--slow_eval_every=0",
       "--faithfulness_coeff=0", "--stochastic_coeff=1", "--per_site_coeff=0",
       "--importance_coeff=1e-3", "--use_delta_component=true",
       "--target_task=addsub", "--nontarget_task=copy",
       "--target_batch_size=8", "--nontarget_batch_size=4",
       "--nontarget_recon_coeff=1", "--nontarget_unmasked_coeff=0.1",
       "--nontarget_importance_coeff=1e-4", "--nontarget_merged_coeff=0.5",
       "--merged_routing=all", "--pgd_scope=bsc", "--ci_scaled_decay=0.1")


@pytest.fixture(scope="module")
def targeted(helpers):
  p = helpers.problem(train_flags.parse_config(*TPD))
  return p, helpers.trajectory(p, (1, 1, 1), "ddp", n_steps=3)


@pytest.mark.parametrize("mesh,preset", [
  ((1, 4, 1), "ddp"),
  pytest.param((2, 2, 1), "zero1", marks=pytest.mark.slow)])
def test_a_targeted_trajectory_is_invariant(helpers, targeted, mesh, preset):
  p, reference = targeted
  placed = helpers.trajectory(p, mesh, preset, n_steps=3)
  assert "nontarget/loss/merged_recon" in reference.metrics[-1]
  helpers.assert_same_trajectory(reference.metrics, placed.metrics)
  # The non-target adversary's per-position sources follow its own batch.
  sources = placed.state.term_states["nontarget_merged_recon"].sources
  leaf = next(iter(sources.values())).source
  assert leaf.shape[:2] == (4, 32)
  assert not leaf.sharding.is_fully_replicated
