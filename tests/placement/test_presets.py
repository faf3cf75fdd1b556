"""The ddp and owner presets in the default suite (SPEC §8, I34, I25).

A fast variant of `test_invariance.py` (slow): TMS 5-2 under its full VPD
recipe at toy size (C = 8, CI hidden 4, batch 64), three steps on the
2 x 2 x 2 mesh of the simulated devices under each preset. Every metric
equals the one-device trajectory within rel 1e-5, no device holds a
full-batch `[B, C]` buffer, the shared-scope persistent sources are
bit-identical on every device, and the state sits where the preset's
table puts it. The residual MLP, whose component-MLP CI folds and slices
the batch, keeps its trajectory under zero1 on the same mesh at toy size.
The slow file adds the other meshes, five steps, the full-size residual
MLP and the LM (whose stacked layers let `owner` split the layer
axis: TMS has one layer per kind, so here `owner` differs from zero1 in
its optimizer layout's C axis only); zero1 on this mesh is in
`test_sharded_step.py`.
"""

import jax
import pytest

from decompax.placement import shardings
from decompax.placement import table as table_lib

pytestmark = pytest.mark.multidevice

MESH = (2, 2, 2)
STEPS = 3


@pytest.fixture(scope="module")
def tms(helpers):
  """The toy-size VPD problem and its one-device trajectory."""
  p = helpers.problem(helpers.vpd_config(
    "tms_5-2_vpd", "--batch_size=64", f"--num_steps={STEPS}", "--c=8",
    "--ci_hidden=4"))
  return p, helpers.trajectory(p, (1, 1, 1), "ddp", STEPS)


@pytest.mark.parametrize("preset", ["ddp", "owner"])
def test_preset_keeps_the_trajectory_and_shards_the_batch(helpers, tms,
                                                          preset):
  p, reference = tms
  placed = helpers.trajectory(p, MESH, preset, STEPS)
  helpers.assert_same_trajectory(reference.metrics, placed.metrics)  # I34
  threshold = helpers.full_batch_elements(p)
  found = helpers.buffers_at_least(placed.compiled.as_text(), threshold)
  assert not found, f"replicated batch-sized buffers: {found}"
  # The detector does see the full batch where it exists.
  assert helpers.buffers_at_least(reference.compiled.as_text(), threshold)
  state = placed.state
  sources = state.term_states["persistent_pgd_recon"].sources
  for source in sources.values():
    assert len(source.source.devices()) == 8
  assert helpers.assert_replicas_identical(sources) == 3 * len(
    p.target.sites)  # I25: S, m, v per site
  mesh = jax.tree.leaves(state.components)[0].sharding.mesh
  want = shardings.named(mesh, shardings.state_specs(
    table_lib.make_table(preset), state, helpers.lead_shape(p),
    dict(mesh.shape)))
  for got, spec in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
    assert got.sharding.is_equivalent_to(spec, got.ndim), (got.shape, spec)
  v_specs = {tuple(f.v.sharding.spec) for f in state.components.values()}
  if preset == "ddp":  # pure data parallelism: every state leaf whole
    assert all(leaf.sharding.is_fully_replicated
               for leaf in jax.tree.leaves(state))
  else:  # owner: C over tp alone (zero1 splits it over tp x replicate)
    assert {spec[2] for spec in v_specs} == {"tp"}


def test_the_component_mlp_ci_keeps_the_trajectory_on_eight_devices(
    helpers):
  """I34 for the residual MLP's VPD recipe at toy size (C = 16, batch 64):
  the component-MLP CI's folded batch splits 8 ways under zero1 and every
  metric of three steps equals the one-device trajectory within rel 1e-5,
  with no batch-sized buffer replicated (the slow file: every preset and
  mesh at batch 512)."""
  p = helpers.problem(helpers.vpd_config(
    "resid_mlp1_vpd", "--batch_size=64", f"--num_steps={STEPS}", "--c=16",
    "--ci_hidden=4"))
  reference = helpers.trajectory(p, (1, 1, 1), "ddp", STEPS)
  placed = helpers.trajectory(p, MESH, "zero1", STEPS)
  helpers.assert_same_trajectory(reference.metrics, placed.metrics)
  found = helpers.buffers_at_least(placed.compiled.as_text(),
                                   helpers.full_batch_elements(p),
                                   helpers.batch_shapes(p, reference))
  assert not found, f"replicated batch-sized buffers: {found}"
