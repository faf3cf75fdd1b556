"""Device-count invariance of the full VPD recipe (SPEC D4, I34, I25).

For each toy VPD flagfile and the two-block LM under the reference LM
recipe, each preset and each mesh, five steps at a fixed
global batch and seed equal the one-device trajectory within rel 1e-5 on
every metric, no batch-sized intermediate is replicated, and shared-scope
sources stay bit-identical on every device. Meshes cover 2, 4 and 8
devices, the degenerate `fsdp = tp = 1` layout and `2 x 2 x 2`.
"""

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multidevice]

# Batches chosen so the component-MLP CI's folded, sliced batch tiles 8 ways;
# the two-block LM (conftest.lm_problem) runs 16 sequences of 32 tokens.
RECIPES = {"tms_5-2_vpd": 1024, "resid_mlp1_vpd": 512, "glu_2block": 16}
MESHES = [(2, 1, 1), (1, 4, 1), (1, 8, 1), (2, 2, 2)]
PRESETS = ["ddp", "zero1", "owner"]


@pytest.fixture(scope="module")
def references(helpers):
  cache = {}

  def get(name):
    if name not in cache:
      if name == "glu_2block":
        p = helpers.lm_problem()
      else:
        p = helpers.problem(helpers.vpd_config(
          name, f"--batch_size={RECIPES[name]}", "--num_steps=5"))
      reference = helpers.trajectory(p, (1, 1, 1), "ddp")
      cache[name] = (p, reference, helpers.batch_shapes(p, reference))
    return cache[name]

  return get


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_trajectory_is_invariant(helpers, references, name, preset, mesh):
  p, reference, batch_shapes = references(name)
  placed = helpers.trajectory(p, mesh, preset)
  helpers.assert_same_trajectory(reference.metrics, placed.metrics)
  found = helpers.buffers_at_least(placed.compiled.as_text(),
                                   helpers.full_batch_elements(p),
                                   batch_shapes)
  assert not found, f"replicated batch-sized buffers: {found}"
  helpers.assert_replicas_identical(
    placed.state.term_states["persistent_pgd_recon"].sources)
