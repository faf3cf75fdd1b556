"""What the step's finiteness flag costs: the same step with and without it.

Run: `./dev bench nonfinite_guard`. For each recipe three builds of one
step are compiled in this process: `off` (the finiteness record replaced by
a constant, so no reduction is traced), `stop` (the flag and the record,
the default) and `skip` (the flag, the record and the select that drops a
bad update). Rounds time `--steps` steps of each build in turn, the order
rotated per round; the table gives each guarded build's median step time
over `off`'s, with the [min, max] of the per-round ratios.
"""

import contextlib
import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from decompax.core import train_step
from decompax.recipe import assembly
from decompax.targets import registry

from bench import step_time

_STEPS = flags.DEFINE_integer("guard_steps", 100, "Timed steps per build "
                              "and round.")
_ROUNDS = flags.DEFINE_integer("guard_rounds", 5, "Rounds.")
_GUARD_RECIPES = flags.DEFINE_list(
  "guard_recipes", ["tms_5-2", "tms_40-10", "resid_mlp1"], "Flagfiles.")
VARIANTS = ("off", "stop", "skip")


@contextlib.contextmanager
def _unguarded():
  real = train_step.health_lib.record

  def constant(health, parts, number):
    del parts, number
    return jnp.array(True), health

  train_step.health_lib.record = constant
  try:
    yield
  finally:
    train_step.health_lib.record = real


def _compiled(name: str, variant: str):
  config = step_time.load_recipe(name)
  config = dataclasses.replace(
    config, on_nonfinite="stop" if variant == "off" else variant)
  toy = registry.get(config.target)
  weights = toy.init(jax.random.key(0))
  guard = _unguarded() if variant == "off" else contextlib.nullcontext()
  with guard:
    run = assembly.build_run(config, toy, toy.fns(config.c), weights)
    step = run.built.step.lower(run.state, weights, run.data_key).compile()
  return step, run.state, weights, run.data_key


def _time(build, steps: int):
  step, state, weights, key = build
  state, _ = step(state, weights, key)  # warm
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _ in range(steps):
    state, _ = step(state, weights, key)
  jax.block_until_ready(state)
  return (time.perf_counter() - start) / steps, (step, state, weights, key)


def main(argv):
  del argv
  steps, rounds = _STEPS.value, _ROUNDS.value
  print(f"{'recipe':<12} {'off ms':>8} {'stop/off':>20} {'skip/off':>20}")
  for name in _GUARD_RECIPES.value:
    builds = {v: _compiled(name, v) for v in VARIANTS}
    times = {v: [] for v in VARIANTS}
    for r in range(rounds):
      order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
      for v in order:
        seconds, builds[v] = _time(builds[v], steps)
        times[v].append(seconds)
    cells = []
    for v in ("stop", "skip"):
      ratios = [t / o for t, o in zip(times[v], times["off"])]
      ratio = statistics.median(times[v]) / statistics.median(times["off"])
      cells.append(f"{ratio:.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")
    print(f"{name:<12} {1e3 * statistics.median(times['off']):8.2f} "
          f"{cells[0]:>20} {cells[1]:>20}", flush=True)


if __name__ == "__main__":
  sys.argv[0] = "nonfinite_guard"
  app.run(main)
