"""Amortised step time of one toy at several `--steps_per_call`.

Run: `./dev bench steps_per_call` (ResidMLP-3's shapes, `flags/resid_mlp3.flags`);
on a CPU, in a minute or two: `./dev bench steps_per_call
--per_call_recipe=resid_mlp3+--batch_size=32 --per_call_sizes=1,2,4
--per_call_steps=8 --per_call_rounds=1`.

It builds the run as `bin/train` does (`recipe.assembly`; untrained target
weights: step cost does not depend on them) and compiles, for each `k` of
`--per_call_sizes`, the call `bin/train` makes at `--steps_per_call=k`: the
plain step for 1, above it `TrainStep.steps` (one program for every `k`,
compiled once) called with `n = k`. Each
round times `--per_call_steps` steps of every `k` (rounded up to whole
calls) after one untimed call, blocking only at the end as the loop does
between log steps, so dispatch overlaps the device as it can. It reports
the amortised ms per step (median of the rounds, with their [min, max]),
the speed-up over `k = 1` measured in the same rounds, and whether the
state after `max(k)` steps is bitwise that of `k = 1` (I57).
"""

import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from decompax.recipe import assembly
from decompax.recipe.config import TrainConfig
from decompax.recipe.flagfiles import read_args
from decompax.targets import registry

# Flag names distinct from the other benches' (tests load several benches
# into one process).
_RECIPE = flags.DEFINE_string(
  "per_call_recipe", "resid_mlp3", "Flagfile in flags/, optionally followed "
  "by '+'-joined flag overrides (e.g. resid_mlp3+--batch_size=32).")
_SIZES = flags.DEFINE_list("per_call_sizes", ["1", "8", "64"],
                           "Steps per call to time, one row each.")
_STEPS = flags.DEFINE_integer("per_call_steps", 512, "Timed steps per size "
                              "and round (rounded up to whole calls).")
_ROUNDS = flags.DEFINE_integer("per_call_rounds", 3, "Timing rounds.")


def load_recipe(name: str) -> TrainConfig:
  """Return the config of `flags/<file>.flags` plus overrides, for
  `name = file[+--flag=value...]`."""
  file, *overrides = name.split("+")
  return read_args([f"--flagfile=flags/{file}.flags", *overrides])


def build(name: str) -> assembly.Run:
  """Return the recipe's run, built as `bin/train` builds it."""
  config = load_recipe(name)
  toy = registry.get(config.target)
  target = toy.fns(config.c)
  return assembly.build_run(config, toy, target, toy.init(jax.random.key(0)))


def compile_calls(run: assembly.Run, sizes: list[int]) -> dict:
  """Return, per size `k`, `call(state) -> state` running `k` steps in one
  compiled call, as `bin/train` calls its step at `--steps_per_call=k`."""
  calls = {}
  if 1 in sizes:
    step = run.built.step.lower(run.state, run.weights,
                                run.data_key).compile()
    calls[1] = lambda state: step(state, run.weights, run.data_key)[0]
  if any(k > 1 for k in sizes):
    steps = run.built.steps.lower(run.state, run.weights, run.data_key,
                                  np.int32(1)).compile()
    for k in sizes:
      if k > 1:
        calls[k] = (lambda n: lambda state: steps(
          state, run.weights, run.data_key, n)[0])(np.int32(k))
  return {k: calls[k] for k in sizes}


def copy_state(state):
  """Return a copy of `state` (every call donates its state)."""
  return jax.tree.map(jnp.copy, state)


def time_calls(call, state, per_call: int, steps: int) -> tuple[float, int]:
  """Return the seconds per step of whole calls covering `steps` steps,
  after one untimed call, and the steps timed."""
  state = call(state)
  jax.block_until_ready(state)
  calls = math.ceil(steps / per_call)
  start = time.perf_counter()
  for _ in range(calls):
    state = call(state)
  jax.block_until_ready(state)
  return (time.perf_counter() - start) / (calls * per_call), calls * per_call


def bitwise_equal(a, b) -> bool:
  """Return whether two states hold the same bits, typed keys included."""
  def bits(tree):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key) else x).tobytes()
            for x in jax.tree.leaves(tree)]
  return bits(a) == bits(b)


def final_states(run: assembly.Run, calls: dict, steps: int) -> dict:
  """Return each size's state after `steps` steps (a multiple of every
  size) from the run's initial state."""
  finals = {}
  for per_call, call in calls.items():
    state = copy_state(run.state)
    for _ in range(steps // per_call):
      state = call(state)
    finals[per_call] = jax.device_get(state)
  return finals


def rows(seconds: dict[int, list[float]], equal: dict[int, bool]) -> list[str]:
  """Return the table's rows: per size, its amortised ms per step (median
  [min, max] of the rounds), the speed-up over the first size and whether
  its state is bitwise the first size's."""
  base = statistics.median(next(iter(seconds.values())))
  out = []
  for per_call, times in seconds.items():
    ms = 1e3 * statistics.median(times)
    out.append(f"| {per_call} | {ms:.3f} [{1e3 * min(times):.3f}, "
               f"{1e3 * max(times):.3f}] | {base / statistics.median(times):.2f}× "
               f"| {'yes' if equal[per_call] else 'NO'} |")
  return out


def parse_sizes(texts: list[str]) -> list[int]:
  """Return the sizes, the first 1 (the baseline) and each positive."""
  try:
    sizes = [int(t) for t in texts]
  except ValueError:
    sizes = []
  if not sizes or sizes[0] != 1 or min(sizes) < 1:
    raise ValueError(f"{','.join(texts)}: positive step counts, starting "
                     "with 1 (the baseline)")
  return sizes


def main(argv):
  del argv
  try:
    sizes = parse_sizes(_SIZES.value)
  except ValueError as e:
    raise app.UsageError(f"--per_call_sizes: {e}") from None
  start = time.perf_counter()
  run = build(_RECIPE.value)
  calls = compile_calls(run, sizes)
  print(f"[steps_per_call] built and compiled the calls in "
        f"{time.perf_counter() - start:.1f} s", flush=True)
  seconds = {k: [] for k in sizes}
  for round_index in range(_ROUNDS.value):
    for k, call in calls.items():
      per_step, timed = time_calls(call, copy_state(run.state), k,
                                   _STEPS.value)
      seconds[k].append(per_step)
    print(f"[steps_per_call] round {round_index + 1}/{_ROUNDS.value}: "
          f"{timed} steps at k={k}", flush=True)
  finals = final_states(run, calls, math.lcm(*sizes))
  equal = {k: bitwise_equal(finals[k], finals[1]) for k in sizes}
  print(f"machine: {jax.devices()[0].device_kind}, JAX {jax.__version__}; "
        f"{_RECIPE.value}, fp32, {_STEPS.value} timed steps per size "
        f"and round, {_ROUNDS.value} rounds; bitwise after "
        f"{math.lcm(*sizes)} steps")
  print("| steps per call | ms/step amortised, median [min, max] | "
        "speed-up over 1 | bitwise as 1 |")
  print("|---|---|---|---|")
  for line in rows(seconds, equal):
    print(line, flush=True)


if __name__ == "__main__":
  sys.argv[0] = "steps_per_call"
  app.run(main)
