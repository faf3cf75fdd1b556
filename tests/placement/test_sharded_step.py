"""Train and eval steps on a (2 replicate x 2 fsdp x 2 tp) mesh (SPEC §8).

Two problems, each under its full recipe: TMS 5-2 with the VPD flagfile and
a two-block GLU transformer with the reference LM recipe (`l18.flags` at toy
sizes). Per problem one compile on one device and one on the eight simulated
devices (zero1) serve every test; `test_invariance.py` (slow) covers every
preset and device count.
"""

from typing import NamedTuple

import jax
import pytest

from decompax.core import adversary
from decompax.evals import eval_step
from decompax.placement import shardings
from decompax.placement import table as table_lib

pytestmark = pytest.mark.multidevice

MESH = (2, 2, 2)
PROBLEMS = {"tms_5-2_vpd": ("tms_vpd", "tms_reference"),
            "glu_2block": ("lm", "lm_reference")}


class Case(NamedTuple):
  problem: object
  reference: object
  sharded: object


# The LM runs in the default suite; TMS (also in `test_invariance.py` and,
# across two processes, `test_two_process.py`) with the slow checks.
@pytest.fixture(scope="module", params=[
  "glu_2block", pytest.param("tms_5-2_vpd", marks=pytest.mark.slow)])
def case(request, helpers):
  problem_name, reference_name = PROBLEMS[request.param]
  problem = request.getfixturevalue(problem_name)
  return Case(problem, request.getfixturevalue(reference_name),
              helpers.trajectory(problem, MESH, "zero1"))


def test_every_batch_sized_intermediate_of_the_train_step_is_sharded(
    helpers, case):
  """Draws, constants and activations follow the batch (SPEC R3, §8): no
  device holds a full-batch `[*L, C]` (or `[B, T, vocab]`) buffer."""
  threshold = helpers.full_batch_elements(case.problem)
  found = helpers.buffers_at_least(case.sharded.compiled.as_text(), threshold)
  assert not found, f"replicated batch-sized buffers: {found}"
  # The detector does see full-batch buffers where they exist.
  assert helpers.buffers_at_least(case.reference.compiled.as_text(),
                                  threshold)


def test_every_batch_sized_intermediate_of_the_eval_step_is_sharded(
    helpers, case):
  p, run = case.problem, case.sharded.run
  config = eval_step.EvalConfig(
    n_batches=2, total_steps=p.config.num_steps,
    with_delta=p.config.use_delta_component)
  fns = eval_step.make_eval_step(p.target, run.ci_fn, run.terms, config,
                                 run.sample_inputs, run.constrain)
  key = jax.random.key(7)
  fast = fns.fast.lower(case.sharded.state, run.weights, key).compile()
  found = helpers.buffers_at_least(fast.as_text(),
                                   helpers.full_batch_elements(p))
  assert not found, f"replicated batch-sized buffers: {found}"


def test_trajectory_equals_the_one_device_trajectory(helpers, case):
  """I34: same global batch and seed, 1 vs 8 devices, every metric."""
  helpers.assert_same_trajectory(case.reference.metrics,
                                 case.sharded.metrics)


def test_shared_scope_sources_are_identical_on_every_device(helpers, case):
  """I25 / D3: batch-1 persistent sources bit-identical across replicas."""
  sources = case.sharded.state.term_states["persistent_pgd_recon"].sources
  for state in sources.values():
    assert isinstance(state, adversary.SourceState)
    assert state.source.shape[0] == 1 and len(state.source.devices()) == 8
  checked = helpers.assert_replicas_identical(sources)
  assert checked == 3 * len(case.problem.target.sites)  # S, m, v per site


def test_state_keeps_the_table_placement_through_updates(helpers, case):
  """Outputs of the donated step carry the shardings the table assigns."""
  state = case.sharded.state
  mesh = jax.tree.leaves(state.components)[0].sharding.mesh
  lead = helpers.lead_shape(case.problem)
  want = shardings.named(mesh, shardings.state_specs(
    table_lib.make_table("zero1"), state, lead, dict(mesh.shape)))
  for got, spec in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
    assert got.sharding.is_equivalent_to(spec, got.ndim), (got.shape, spec)
  # zero1 shards every V's C axis over tp x replicate (each C tiles 4).
  for factors in state.components.values():
    assert tuple(factors.v.sharding.spec)[2] == ("tp", "replicate")
