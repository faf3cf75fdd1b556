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

With `--compile_eval` it also times, the same way, the two programs of the
run's evaluation (`evals.eval_step.make_eval_step`, configured as
`bin/train` configures it): the fast tier and the slow tier, each lowered
and compiled from cleared caches. A recipe whose flags name a token file
hands the eval held-out batches, as `bin/train` does (zeros here: compile
time depends on shapes); others sample theirs.

`--compile_model=PRESET[:field=value,...]` builds the language-model
recipes on a random model of a `targets.text_lm` preset's shape, its
fields overridden (`brown-m:d_model=64,d_ff=256`), instead of the
checkpoint their flags name (`bench.random_lm`), so that a recipe whose
model is not on this machine can be timed at a smaller width.
"""

import dataclasses
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from absl import app, flags

from bench import random_lm
from decompax.evals import eval_step
from decompax.io import hf_checkpoint
from decompax.placement import compiler
from decompax.recipe import assembly, engine, evaluation, lm
from decompax.recipe.config import TrainConfig, held_out_seed
from decompax.recipe.flagfiles import read_args
from decompax.targets import registry, text_lm

# Flag names apart from the other benches' and bin/train's: tests load
# several into one process.
_RECIPES = flags.DEFINE_list(
  "compile_recipes", ["tiny_llama", "induction"],
  "Flagfiles in flags/, each optionally followed by '+'-joined flag "
  "overrides.")
_REPEATS = flags.DEFINE_integer("compile_repeats", 3,
                                "Compiles timed per recipe.")
_EVAL = flags.DEFINE_boolean(
  "compile_eval", False, "Also time the eval's fast and slow programs.")
_MODEL = flags.DEFINE_string(
  "compile_model", "", "PRESET[:field=value,...]: build language-model "
  "recipes on a random model of this text_lm preset's shape.")

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


def random_model(spec: str) -> text_lm.LmPreset:
  """Return the preset `spec` names (`PRESET[:field=value,...]`), its
  integer fields overridden; ValueError on an unknown preset or field."""
  name, _, fields = spec.partition(":")
  if name not in text_lm.PRESETS:
    raise ValueError(f"--compile_model names preset {name!r}; use one of "
                     f"{sorted(text_lm.PRESETS)}")
  overrides = {}
  for item in filter(None, fields.split(",")):
    field, _, value = item.partition("=")
    if field not in {f.name for f in dataclasses.fields(text_lm.LmPreset)}:
      raise ValueError(f"--compile_model sets {field!r}, which preset "
                       f"{name} has no field of")
    overrides[field] = int(value)
  return dataclasses.replace(text_lm.PRESETS[name], **overrides)


def with_model_dir(config: TrainConfig, preset: text_lm.LmPreset,
                   folder: str) -> TrainConfig:
  """Return `config` reading its model from `folder`, where the preset's
  `config.json` is written (no weights: `build_run` draws them)."""
  glu = text_lm.model_config(preset)
  hf_checkpoint._write_json(str(pathlib.Path(folder, "config.json")),
                            hf_checkpoint.llama_config(glu))
  return dataclasses.replace(config, model_dir=folder)


def build_run(config: TrainConfig, random: bool = False) -> assembly.Run:
  """Return the run `bin/train` builds from `config`, on the checkpoint's
  weights for a language model (`random`: random ones of its shape) and
  untrained ones for a toy."""
  # The warmup runs before the step and changes none of its shapes.
  config = dataclasses.replace(config, faithfulness_warmup_steps=0)
  toy, target, load = assembly.resolve_target(config)
  if lm.is_lm(config) and random:
    weights = random_lm.random_weights(
      jax.random.key(0), toy.token_model, target.sites,
      lm._DTYPES[config.compute_dtype][0])
  elif lm.is_lm(config):
    weights = load()
  else:
    weights = registry.weights_for(toy, toy.init(jax.random.key(0)),
                                   target.sites)
  return assembly.build_run(config, toy, target, weights)


def lower_compile(lower: Callable[[], Any], options: Any = None
                  ) -> tuple[Any, float, float, float]:
  """Return the program `lower()` lowers, the wall times of lowering and of
  compiling it from cleared in-memory caches, and the process CPU time of
  both: on a shared machine the CPU time follows the work, the wall time
  the load too."""
  jax.clear_caches()
  cpu, start = time.process_time(), time.perf_counter()
  lowered = lower()
  lowered_at = time.perf_counter()
  lowered.compile(options)
  return (lowered, lowered_at - start, time.perf_counter() - lowered_at,
          time.process_time() - cpu)


def time_compile(run: assembly.Run) -> tuple[float, float, float]:
  """Return the wall times of lowering and of compiling the run's step,
  from cleared in-memory caches, and the CPU time of both."""
  _, *times = lower_compile(
    lambda: run.built.step.lower(run.state, run.weights, run.data_key),
    compiler.options(compiler.DEFAULT))  # as bin/train does
  return tuple(times)


def measure(config: TrainConfig, repeats: int, random: bool = False
            ) -> dict[str, list[float]]:
  """Return one recipe's lower, compile and total times per repeat."""
  run = build_run(config, random)
  times = [time_compile(run)[:2] for _ in range(repeats)]
  return {"lower": [t[0] for t in times], "compile": [t[1] for t in times],
          "total": [t[0] + t[1] for t in times]}


def eval_fns(config: TrainConfig, run: assembly.Run
             ) -> tuple[eval_step.EvalFns, jax.Array | None]:
  """Return the run's eval passes as `bin/train` builds them, and the
  held-out batches it would hand them (None: they sample their own)."""
  target = run.plan.parts.target
  batches = None
  if config.data_path:
    batches = jnp.zeros((config.eval_batches, config.batch_size,
                         config.seq_len), jnp.int32)
  fns = eval_step.make_eval_step(
    target, run.ci_fn, run.terms,
    evaluation.make_eval_config(config, target,
                                engine.compute_dtype(config)),
    run.sample_inputs if batches is None else None, run.constrain)
  return fns, batches


def time_eval_compile(config: TrainConfig, run: assembly.Run
                      ) -> dict[str, tuple[float, float, float]]:
  """Return per eval program (`fast`, `slow`) the wall times of lowering
  and compiling it, each from cleared in-memory caches, and the CPU time
  of both."""
  fns, batches = eval_fns(config, run)
  key = eval_step.eval_data_key(held_out_seed(config))
  lowered, *fast = lower_compile(
    lambda: fns.fast.lower(run.state, run.weights, key, batches))
  _, *slow = lower_compile(
    lambda: fns.slow.lower(run.state, run.weights, key, lowered.out_info[1]))
  return {"fast": tuple(fast), "slow": tuple(slow)}


def measure_all(config: TrainConfig, repeats: int, random: bool = False
                ) -> dict[str, dict[str, list[float]]]:
  """Return per program (`step`, `fast`, `slow`) its lower, compile and
  total wall times and the CPU time of both per repeat."""
  run = build_run(config, random)
  out = {p: {"lower": [], "compile": [], "total": [], "cpu": []}
         for p in ("step", "fast", "slow")}
  for _ in range(repeats):
    times = {"step": time_compile(run), **time_eval_compile(config, run)}
    for program, (lower, compiled, cpu) in times.items():
      out[program]["lower"].append(lower)
      out[program]["compile"].append(compiled)
      out[program]["total"].append(lower + compiled)
      out[program]["cpu"].append(cpu)
  return out


def spread(values: list[float]) -> str:
  """Return `median [min, max]` in seconds."""
  return (f"{statistics.median(values):.2f} [{min(values):.2f}, "
          f"{max(values):.2f}]")


def report(name: str, times: dict[str, dict[str, list[float]]]) -> None:
  """Print one recipe's rows: one per program timed."""
  for program, spans in times.items():
    label = name if program == "step" else f"{name} ({program} eval)"
    cpu = f" {spread(spans['cpu'])} |" if "cpu" in spans else ""
    print(f"| {label} | {spread(spans['lower'])} | "
          f"{spread(spans['compile'])} | {spread(spans['total'])} |{cpu}",
          flush=True)


def main(argv):
  del argv
  if _REPEATS.value < 1:
    sys.exit(f"compile_time: --compile_repeats must be at least 1, got "
             f"{_REPEATS.value}")
  folder = tempfile.mkdtemp(prefix="compile_time_")
  try:
    configs = {name: load_recipe(name) for name in _RECIPES.value}
    if _MODEL.value:
      preset = random_model(_MODEL.value)
      configs = {name: with_model_dir(c, preset, folder) if lm.is_lm(c)
                 else c for name, c in configs.items()}
  except (OSError, ValueError) as e:
    sys.exit(f"compile_time: {e}")
  # The process's first compile pays one-time setup; not the recipes'.
  jax.jit(jnp.sin)(jnp.ones(2)).block_until_ready()
  print(f"machine: {jax.devices()[0].device_kind}, {jax.device_count()} "
        f"device(s); seconds, median [min, max] of {_REPEATS.value} "
        "compiles from cleared caches")
  cpu = " CPU s |" if _EVAL.value else ""
  print(f"| recipe | lower s | compile s | total s |{cpu}")
  print("|---|---|---|---|" + "---|" * bool(cpu))
  random = bool(_MODEL.value)
  for name, config in configs.items():
    if _EVAL.value:
      report(name, measure_all(config, _REPEATS.value, random))
    else:
      report(name, {"step": measure(config, _REPEATS.value, random)})


if __name__ == "__main__":
  sys.argv[0] = "compile_time"
  app.run(main)
