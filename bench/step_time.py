"""Median jitted step time of the toy recipes, beside this machine's matmul rate.

Run: `./dev bench step_time` (or `.venv/bin/python -P bench/step_time.py`).
For each flagfile it builds the run exactly as `bin/train` does (untrained
target weights: step cost does not depend on them), compiles once, times
`--steps` steps after `--warmup` untimed ones, and reports, all measured in
this one process:
  * median step time (ms) and the reference's per-step time ratio,
  * achieved FLOP/s from XLA's cost analysis of the compiled step,
  * CI-MLP elementwise throughput: `[B, C, d_gate]` elements per second,
  * the machine's measured fp32 matmul FLOP/s, and the step's share of it.
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from decompax.bin import train, train_flags
from decompax.targets import registry

_STEPS = flags.DEFINE_integer("steps", 50, "Timed steps per recipe.")
_WARMUP = flags.DEFINE_integer("warmup", 5, "Untimed steps after compiling.")
_RECIPES = flags.DEFINE_list(
  "recipes",
  ["tms_5-2", "tms_40-10", "resid_mlp1", "tms_5-2_vpd",
   "tms_5-2_vpd+--pgd_coeff=0", "resid_mlp1_vpd", "resid_mlp1_vpd+--pgd_coeff=0"],
  "Flagfiles in flags/, each optionally followed by '+'-joined flag overrides "
  "(the VPD rows without their PGD term give the adversary's cost).")

# Per-step time of the PyTorch reference implementation on a 2-core CPU (ms).
REFERENCE_MS = {"tms_5-2": 25.0, "tms_40-10": 240.0, "resid_mlp1": 125.0}


def matmul_flops_per_s(n: int = 1024, repeats: int = 20) -> float:
  """Return the measured fp32 FLOP/s of an `n×n @ n×n` jitted matmul."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  f = jax.jit(jnp.matmul)
  f(a, b).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    f(a, b).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n**3 / statistics.median(times)


def load_recipe(name: str) -> train_flags.TrainConfig:
  """Return the validated config of `flags/<file>.flags` plus overrides,
  for `name = file[+--flag=value...]`."""
  file, *overrides = name.split("+")
  argv = flags.FLAGS.read_flags_from_files([f"--flagfile=flags/{file}.flags"],
                                           force_gnu=False)
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["bench", *argv, *overrides])
  return train_flags.config_from_flags()


def time_recipe(name: str, steps: int, warmup: int) -> dict:
  """Return the timing record of one recipe."""
  config = load_recipe(name)
  toy = registry.get(config.target)
  target = toy.fns(config.c)
  weights = toy.init(jax.random.key(0))
  run = train.build_run(config, toy, target, weights)
  compiled = run.built.step.lower(run.state, weights, run.data_key).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  state = run.state
  for _ in range(warmup):
    state, metrics = compiled(state, weights, run.data_key)
  jax.block_until_ready(state)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = compiled(state, weights, run.data_key)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - start)
  median = statistics.median(times)
  d_gate = config.ci_hidden[0]
  elements = config.batch_size * sum(s.c for s in target.sites) * d_gate
  return {
    "recipe": name,
    "ms": 1e3 * median,
    "flops": cost.get("flops", float("nan")) / median,
    "ci_elements": elements / median,
  }


def main(argv):
  del argv
  # Loading a recipe re-parses the flags, so read the bench's own first.
  steps, warmup, recipes = _STEPS.value, _WARMUP.value, _RECIPES.value
  peak = matmul_flops_per_s()
  print(f"machine: {jax.devices()[0].device_kind}, fp32 matmul "
        f"{peak / 1e9:.1f} GFLOP/s (1024^3, median of 20)")
  header = (f"{'recipe':<30} {'step ms':>8} {'ref ms':>7} {'speedup':>8} "
            f"{'GFLOP/s':>8} {'% matmul':>8} {'CI-MLP Gelem/s':>15}")
  print(header)
  for name in recipes:
    r = time_recipe(name, steps, warmup)
    ref = REFERENCE_MS.get(name)
    ref_text = f"{ref:7.0f} {ref / r['ms']:7.2f}x" if ref else f"{'-':>7} {'-':>8}"
    print(f"{name:<30} {r['ms']:8.2f} {ref_text} "
          f"{r['flops'] / 1e9:8.2f} {100 * r['flops'] / peak:7.1f}% "
          f"{r['ci_elements'] / 1e9:15.3f}", flush=True)


if __name__ == "__main__":
  sys.argv[0] = "step_time"
  app.run(main)
