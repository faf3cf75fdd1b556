"""Compile time of the language-model train step on this machine.

Run: `./dev bench compile_time`. For each `--compile_recipes` entry (default:
the tiny random Llama, `flags/tiny_llama.flags`, and the induction toy,
`flags/induction.flags`) it builds the run exactly as `bin/train` does
(`recipe.assembly`; the tiny Llama from its committed checkpoint, the
induction toy untrained: compile time depends on shapes, not values) and
lowers and compiles its step `--compile_repeats` times, each after clearing
JAX's in-memory caches and with no persistent cache, so that every repeat
traces, lowers and compiles from nothing, as a new process does. It reports
per recipe the median [min, max] over repeats of the lowering (trace to
StableHLO), of XLA's compile, and of the two together.
"""

import dataclasses
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from decompax.placement import compiler
from decompax.recipe import assembly, lm
from decompax.recipe.config import TrainConfig, read_args
from decompax.targets import registry

# Flag names apart from the other benches' and bin/train's: tests load
# several into one process.
_RECIPES = flags.DEFINE_list(
  "compile_recipes", ["tiny_llama", "induction"],
  "Flagfiles in flags/, each optionally followed by '+'-joined flag "
  "overrides.")
_REPEATS = flags.DEFINE_integer("compile_repeats", 3,
                                "Compiles timed per recipe.")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_recipe(name: str) -> TrainConfig:
  """Return the config of `flags/<file>.flags` plus overrides, for
  `name = file[+--flag=value...]`, its model directory under the
  repository root when relative."""
  file, *overrides = name.split("+")
  config = read_args([f"--flagfile={ROOT / 'flags' / f'{file}.flags'}",
                      *overrides])
  if config.model_dir and not pathlib.Path(config.model_dir).is_absolute():
    config = dataclasses.replace(config,
                                 model_dir=str(ROOT / config.model_dir))
  return config


def build_run(config: TrainConfig) -> assembly.Run:
  """Return the run `bin/train` builds from `config`, on the checkpoint's
  weights for a language model and untrained ones for a toy."""
  # The warmup runs before the step and changes none of its shapes.
  config = dataclasses.replace(config, faithfulness_warmup_steps=0)
  toy, target, load = assembly.resolve_target(config)
  if lm.is_lm(config):
    weights = load()
  else:
    weights = registry.weights_for(toy, toy.init(jax.random.key(0)),
                                   target.sites)
  return assembly.build_run(config, toy, target, weights)


def time_compile(run: assembly.Run) -> tuple[float, float]:
  """Return the wall times of lowering and of compiling the run's step,
  from cleared in-memory caches."""
  jax.clear_caches()
  start = time.perf_counter()
  lowered = run.built.step.lower(run.state, run.weights, run.data_key)
  lowered_at = time.perf_counter()
  lowered.compile(compiler.options(compiler.DEFAULT))  # as bin/train does
  return lowered_at - start, time.perf_counter() - lowered_at


def measure(config: TrainConfig, repeats: int) -> dict[str, list[float]]:
  """Return one recipe's lower, compile and total times per repeat."""
  run = build_run(config)
  times = [time_compile(run) for _ in range(repeats)]
  return {"lower": [t[0] for t in times], "compile": [t[1] for t in times],
          "total": [t[0] + t[1] for t in times]}


def spread(values: list[float]) -> str:
  """Return `median [min, max]` in seconds."""
  return (f"{statistics.median(values):.2f} [{min(values):.2f}, "
          f"{max(values):.2f}]")


def main(argv):
  del argv
  if _REPEATS.value < 1:
    sys.exit(f"compile_time: --compile_repeats must be at least 1, got "
             f"{_REPEATS.value}")
  try:
    configs = {name: load_recipe(name) for name in _RECIPES.value}
  except (OSError, ValueError) as e:
    sys.exit(f"compile_time: {e}")
  # The process's first compile pays one-time setup; not the recipes'.
  jax.jit(jnp.sin)(jnp.ones(2)).block_until_ready()
  print(f"machine: {jax.devices()[0].device_kind}, {jax.device_count()} "
        f"device(s); seconds, median [min, max] of {_REPEATS.value} "
        "compiles from cleared caches")
  print("| recipe | lower s | compile s | total s |")
  print("|---|---|---|---|")
  for name, config in configs.items():
    times = measure(config, _REPEATS.value)
    print(f"| {name} | {spread(times['lower'])} | "
          f"{spread(times['compile'])} | {spread(times['total'])} |",
          flush=True)


if __name__ == "__main__":
  sys.argv[0] = "compile_time"
  app.run(main)
