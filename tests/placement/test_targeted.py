"""A targeted decomposition placed on a mesh (SPEC §6.6, D4, I34): two
streams of different lead shapes, each batch-sharded, the same trajectory
as on one device."""

import jax
import pytest

from decompax.bin import train_flags
from decompax.placement import shardings, table

pytestmark = pytest.mark.multidevice

TPD = ("--target=induction", "--c=8", "--ci_fn=vector_mlp", "--ci_hidden=4",
       "--num_steps=4", "--eval_every=0", "--slow_eval_every=0",
       "--faithfulness_coeff=0", "--stochastic_coeff=1", "--per_site_coeff=0",
       "--importance_coeff=1e-3", "--use_delta_component=true",
       "--target_task=addsub", "--nontarget_task=copy",
       "--target_batch_size=8", "--nontarget_batch_size=4",
       "--nontarget_recon_coeff=1", "--nontarget_unmasked_coeff=0.1",
       "--nontarget_importance_coeff=1e-4", "--nontarget_merged_coeff=0.5",
       "--merged_routing=all", "--pgd_scope=bsc", "--ci_scaled_decay=0.1",
       # Dual-role CI, its four passes scored one at a time.
       "--ci_roles=output,hidden", "--sequential_passes")


@pytest.fixture(scope="module")
def targeted(helpers):
  p = helpers.problem(train_flags.parse_config(*TPD))
  return p, helpers.trajectory(p, (1, 1, 1), "ddp", n_steps=3)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,preset", [((1, 4, 1), "ddp"),
                                         ((2, 2, 1), "zero1")])
def test_a_targeted_trajectory_is_invariant(helpers, targeted, mesh, preset):
  p, reference = targeted
  placed = helpers.trajectory(p, mesh, preset, n_steps=3)
  assert "nontarget/loss/merged_recon" in reference.metrics[-1]
  assert "nontarget/loss/merged_recon_hidden" in reference.metrics[-1]
  helpers.assert_same_trajectory(reference.metrics, placed.metrics)
  # The non-target adversary's per-position sources follow its own batch.
  sources = placed.state.term_states["nontarget_merged_recon"].sources
  leaf = next(iter(sources.values())).source
  assert leaf.shape[:2] == (4, 32)
  assert not leaf.sharding.is_fully_replicated


def test_each_stream_shards_by_its_own_lead_shape(helpers):
  """The fast variant: the specs of a two-stream batch and of per-stream
  persistent sources follow each stream's own lead shape."""
  leads = {"target": (8, 5), "nontarget": (4, 32)}
  sizes = {"replicate": 1, "fsdp": 4, "tp": 1}
  ddp = table.make_table("ddp")
  batch = {s: jax.ShapeDtypeStruct(lead, "int32") for s, lead in leads.items()}
  specs = shardings.batch_specs(ddp, batch, leads, sizes)
  for stream in leads:
    assert specs[stream][0] is not None, stream
  for lead in leads.values():
    source = jax.ShapeDtypeStruct((*lead, 6), "float32")
    assert shardings.source_axes(source, leads) == ("batch", "seq", "c")
    shared = jax.ShapeDtypeStruct((1, 1, 6), "float32")
    assert shardings.source_axes(shared, leads) == (None, None, "c")
  unrelated = jax.ShapeDtypeStruct((3, 7, 6), "float32")
  assert shardings.source_axes(unrelated, leads) is None
  assert shardings.batch_axes(unrelated, leads, "c") is None
