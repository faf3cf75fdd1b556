"""Jitted step time of the toy recipes, beside this machine's matmul rate.

Run: `./dev bench step_time`.
For each flagfile it builds the run exactly as `bin/train` does
(`recipe.assembly`; untrained target weights: step cost does not depend on
them) and compiles once. Each of `--timing_rounds` rounds first calibrates
the machine's fp32 matmul rate, then times `--timed_steps` steps of every
recipe after `--untimed_steps` untimed ones. It reports, all measured in this one process:
  * the step time (ms): median over rounds of each round's median, with the
    [min, max] of the round medians;
  * the speed-up over the reference implementation's per-step time;
  * achieved FLOP/s from XLA's cost analysis of the compiled step, and its
    share of the matmul rate measured in the same round;
  * CI-MLP elementwise throughput: `[B, C, d_gate]` elements per second.

A recipe ending in `@N` runs data-parallel over `N` CPU devices (simulated,
one per core: XLA runs each elementwise fusion on one core, so a single
device leaves the others idle for most of a toy step), as `bin/train
--local_device_count=N` does.

Each recipe compiles with the XLA options `bin/train` uses by default
(`--compiler`'s default preset, `placement/compiler.py`). `--compilers`
times it under several presets or option lists (`;`-separated), one row
each, interleaved in the same rounds: the like-for-like measure of a
compile option. `--ci_layouts` does the same for the component-MLP CI
kernel's layout (`core/component_mlp.py`): `platform`, the one `bin/train`
gets, or `cpu` or `accelerator` forced on any backend, or on a TPU the
Pallas kernel (`pallas`; `pallas_compact` without replicated parameter
rows).

The speed-up compares like with like only under `--matched` (default): the
reference's toy configs train with the delta component, no faithfulness
term and no nonlinearity locality, so matched rows add
`--use_delta_component --faithfulness_coeff=0 --nonlinearity_coeff=0` to
the flagfile, and the speed-up is taken against the faster of the
reference's fp32 and bf16 times (`REFERENCE_MS`). Unmatched rows time the
flagfiles as shipped and show no speed-up.
"""

import contextlib
import functools
import statistics
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.sharding import AxisType

from decompax.core import ci_fns, component_mlp, component_mlp_pallas
from decompax.placement import compiler
from decompax.placement import mesh as mesh_lib
from decompax.placement import shardings
from decompax.placement import table as table_lib
from decompax.recipe import assembly
from decompax.recipe.config import TrainConfig
from decompax.recipe.flagfiles import read_args
from decompax.targets import registry

from bench import hlo_flops

# Flag names distinct from the other benches' (nonfinite_guard imports this
# module, and tests load several benches into one process).
_STEPS = flags.DEFINE_integer("timed_steps", 100, "Timed steps per recipe "
                              "and round.")
_ROUNDS = flags.DEFINE_integer("timing_rounds", 3, "Rounds (each "
                               "recalibrates the matmul rate).")
_MATCHED = flags.DEFINE_bool(
  "matched", True, "Time the reference's work (delta on, no faithfulness, "
  "no locality) and show the speed-up; --nomatched times the flagfiles as "
  "shipped.")
_WARMUP = flags.DEFINE_integer("untimed_steps", 5, "Untimed steps after "
                               "compiling, per round.")
_COMPILERS = flags.DEFINE_string(
  "compilers", compiler.DEFAULT, "';'-separated compile options to time each "
  "recipe under, as bin/train's --compiler takes them (a preset: "
  f"{', '.join(compiler.PRESETS)}, or xla_option=value pairs).")
# The component-MLP kernel each `--ci_layouts` entry traces the step with.
CI_LAYOUTS = {"platform": component_mlp.component_mlp_pre,
              "cpu": component_mlp.cpu_pre,
              "accelerator": component_mlp.accelerator_pre,
              "pallas": component_mlp_pallas.pallas_pre,
              "pallas_compact": functools.partial(
                component_mlp_pallas.pallas_pre, replicated=False)}
_CI_LAYOUTS = flags.DEFINE_list(
  "ci_layouts", ["platform"], "Component-MLP CI kernel layouts to time each "
  f"recipe under, one row each: {', '.join(CI_LAYOUTS)} (the layout "
  "component_mlp_pre picks for this backend).")
_RECIPES = flags.DEFINE_list(
  "recipes",
  ["tms_5-2", "tms_40-10", "resid_mlp1", "tms_5-2_vpd",
   "tms_5-2_vpd+--pgd_coeff=0", "resid_mlp1_vpd", "resid_mlp1_vpd+--pgd_coeff=0"],
  "Flagfiles in flags/, each optionally followed by '+'-joined flag overrides "
  "(the VPD rows without their PGD term give the adversary's cost) and by "
  "@N to run data-parallel over N CPU devices.")

# Per-step time (ms) of the PyTorch reference implementation on a 2-core CPU
# like this one, in its best clean configuration (allocator fixed), timed
# side by side with decompax; per dtype where it was measured (fp32, or
# bf16 autocast). The speed-up is taken against the faster entry.
REFERENCE_MS = {
  "tms_5-2": {"fp32": 26.3},
  "tms_40-10": {"bf16": 286.0},
  "resid_mlp1": {"bf16": 124.0},
}
# What the reference's toy configs train: delta on, faithfulness and
# nonlinearity locality off.
MATCHED_FLAGS = ("--use_delta_component", "--faithfulness_coeff=0",
                 "--nonlinearity_coeff=0")
MATCHED_WORK = "matched work (delta on, no faithfulness, no locality)"


def matmul_flops_per_s(n: int = 1024, repeats: int = 20) -> float:
  """Return the measured fp32 FLOP/s of an `n×n @ n×n` jitted matmul."""
  return hlo_flops.measured_matmul_rate(jnp.float32, n, repeats)


def split_devices(name: str) -> tuple[str, int]:
  """Return `(recipe, devices)` of `recipe[@devices]`."""
  recipe, sep, count = name.rpartition("@")
  if not sep:
    return name, 1
  if not count.isdigit() or int(count) < 1:
    raise ValueError(f"{name!r}: the device count after @ must be a "
                     "positive integer")
  return recipe, int(count)


def load_recipe(name: str) -> TrainConfig:
  """Return the config of `flags/<file>.flags` plus overrides, for
  `name = file[+--flag=value...]`."""
  file, *overrides = name.split("+")
  return read_args([f"--flagfile=flags/{file}.flags", *overrides])


def data_parallel(devices: int) -> shardings.Placement | None:
  """Return the ddp placement over the first `devices` devices (None for
  one: the unplaced step, as `bin/train` builds it)."""
  if devices == 1:
    return None
  present = jax.devices()
  if len(present) < devices:
    raise ValueError(f"@{devices} needs {devices} devices; this process "
                     f"has {len(present)}")
  shape = mesh_lib.mesh_shape(devices)
  mesh = jax.make_mesh(tuple(shape.sizes.values()), table_lib.MESH_AXES,
                       axis_types=(AxisType.Auto,) * len(table_lib.MESH_AXES),
                       devices=present[:devices])
  return shardings.Placement(mesh, table_lib.make_table("ddp"), {})


def best_reference(name: str) -> tuple[float, str] | None:
  """Return the reference's faster per-step time (ms) and its dtype."""
  times = REFERENCE_MS.get(name)
  if not times:
    return None
  dtype = min(times, key=times.get)
  return times[dtype], dtype


def ci_layout(name: str) -> contextlib.AbstractContextManager:
  """Return a context in which the component-MLP CI traces with the
  `name`d kernel layout (`CI_LAYOUTS`)."""
  if name not in CI_LAYOUTS:
    raise ValueError(f"unknown CI layout {name!r}; use "
                     f"{', '.join(CI_LAYOUTS)}")
  return mock.patch.object(ci_fns, "component_mlp_pre", CI_LAYOUTS[name])


def compile_recipe(name: str, matched: bool,
                   options: str = compiler.DEFAULT,
                   layout: str = "platform") -> dict:
  """Return one recipe's compiled step (under the compile `options`, a
  preset name or option list, and the CI kernel `layout`), its state and
  static figures."""
  name, devices = split_devices(name)
  config = load_recipe(name + ("+" + "+".join(MATCHED_FLAGS) if matched
                               else ""))
  toy = registry.get(config.target)
  target = toy.fns(config.c)
  # The CI function picks its kernel when the run is built.
  with ci_layout(layout):
    run = assembly.build_run(config, toy, target,
                             toy.init(jax.random.key(0)),
                             placement=data_parallel(devices))
    compiled = run.built.step.lower(run.state, run.weights,
                                    run.data_key).compile(
      compiler.options(options))
  weights = run.weights  # on the mesh when placed
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  d_gate = config.ci_hidden[0]
  # A sharded program's cost analysis counts one device's share.
  flops = devices * cost.get("flops", float("nan"))
  return {"compiled": compiled, "state": run.state, "weights": weights,
          "key": run.data_key, "flops": flops,
          "ci_elements": config.batch_size * sum(s.c for s in target.sites)
          * d_gate}


def time_steps(recipe: dict, steps: int, warmup: int) -> float:
  """Return the median time (s) of `steps` steps after `warmup` untimed."""
  step, state = recipe["compiled"], recipe["state"]
  args = (recipe["weights"], recipe["key"])
  for _ in range(warmup):
    state, _ = step(state, *args)
  jax.block_until_ready(state)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, _ = step(state, *args)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - start)
  recipe["state"] = state  # the step donates its state
  return statistics.median(times)


def row(name: str, recipe: dict, medians: list[float], peaks: list[float],
        matched: bool) -> str:
  """Return one table row from the per-round medians and matmul rates."""
  ms = 1e3 * statistics.median(medians)
  spread = f"[{1e3 * min(medians):.2f}, {1e3 * max(medians):.2f}]"
  # A label may end in its compile options: `recipe [options]`.
  reference = (best_reference(split_devices(name.split(" [")[0])[0])
               if matched else None)
  if reference:
    ref_ms, dtype = reference
    ref_text = f"{ref_ms:.1f} ({dtype}) | {ref_ms / ms:.2f}×"
  else:
    ref_text = "– | –"
  flops = recipe["flops"] / statistics.median(medians)
  share = statistics.median(recipe["flops"] / m / p
                            for m, p in zip(medians, peaks))
  return (f"| {name} | {ms:.2f} {spread} | {ref_text} | {flops / 1e9:.1f} "
          f"({100 * share:.0f}%) | "
          f"{recipe['ci_elements'] / statistics.median(medians) / 1e9:.3f} |")


def main(argv):
  del argv
  matched = _MATCHED.value
  try:
    devices = max(split_devices(name)[1] for name in _RECIPES.value)
  except ValueError as e:
    raise app.UsageError(f"--recipes: {e}") from None
  # Before the first device use, which fixes the CPU device count.
  jax.config.update("jax_num_cpu_devices", devices)
  try:
    settings = [c.strip() for c in _COMPILERS.value.split(";") if c.strip()]
    for setting in settings:
      compiler.options(setting)
  except ValueError as e:
    raise app.UsageError(f"--compilers: {e}") from None
  layouts = _CI_LAYOUTS.value
  try:
    for layout in layouts:
      ci_layout(layout)
  except ValueError as e:
    raise app.UsageError(f"--ci_layouts: {e}") from None
  recipes = {}
  for name in _RECIPES.value:
    for setting in settings:
      for layout in layouts:
        tags = ([setting] if len(settings) > 1 else []) + (
          [f"ci {layout}"] if len(layouts) > 1 else [])
        label = f"{name} [{', '.join(tags)}]" if tags else name
        start = time.perf_counter()
        recipes[label] = compile_recipe(name, matched, setting, layout)
        print(f"[step_time] {label}: compiled in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
  medians = {name: [] for name in recipes}
  peaks = []
  for round_index in range(_ROUNDS.value):
    peaks.append(matmul_flops_per_s())
    for name, recipe in recipes.items():
      medians[name].append(time_steps(recipe, _STEPS.value, _WARMUP.value))
    print(f"[step_time] round {round_index + 1}/{_ROUNDS.value}: matmul "
          f"{peaks[-1] / 1e9:.0f} GFLOP/s", flush=True)
  print(f"machine: {jax.devices()[0].device_kind}, fp32 matmul "
        f"{statistics.median(peaks) / 1e9:.0f} GFLOP/s (1024³, median of 20, "
        f"per round: {', '.join(f'{p / 1e9:.0f}' for p in peaks)}); "
        f"{MATCHED_WORK if matched else 'flagfiles as shipped'}")
  print("| recipe | step ms, median [min, max] of rounds | reference ms | "
        "speed-up | GFLOP/s (of matmul) | CI-MLP Gelem/s |")
  print("|---|---|---|---|---|---|")
  for name, recipe in recipes.items():
    print(row(name, recipe, medians[name], peaks, matched), flush=True)


if __name__ == "__main__":
  sys.argv[0] = "step_time"
  app.run(main)
