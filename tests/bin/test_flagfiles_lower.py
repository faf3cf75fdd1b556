"""Every flagfile whose smoke run is `slow` builds its run and lowers its
training step at smoke size.

The fast variant of those smoke runs (`test_eval_smoke*.py` run one
flagfile per code path in the default suite, and compile its step there):
it still catches a flagfile whose settings no longer parse, plan or trace.
Lowering traces the whole step to StableHLO without XLA's compile, the
part of a smoke run that costs most.

The language-model families' flagfiles (`conftest.FAMILY_RUNS`) are `slow`
rows here: the fast variant is
tests/bin/test_family_runs.py::test_family_flagfile_decomposes_a_few_steps,
which builds, compiles and runs each of their steps.
"""

import jax

from decompax.bin import train
from decompax.recipe import assembly


def test_flagfile_builds_its_run_and_lowers_its_step(smoke_config,
                                                     slow_smoke_flagfile):
  prepared = train.setup(smoke_config(slow_smoke_flagfile))
  run = assembly.start(prepared.plan, prepared.weights)
  lowered = run.built.step.lower(run.state, run.weights, run.step_inputs(0))
  assert "func.func public @main" in lowered.as_text()
  # The step returns the state it was given, leaf for leaf, and its loss.
  state_out, metrics = lowered.out_info
  assert jax.tree.structure(state_out) == jax.tree.structure(run.state)
  assert "loss/total" in metrics
