"""What in-loop evaluation costs the training loop, as ratios.

Run: `./dev bench eval_cost` (or `.venv/bin/python -P bench/eval_cost.py`).
For each recipe it builds the run as `bin/train` does (untrained target
weights), compiles the step and both eval passes, then times the same
window of `--steps` steps three ways, in this one process:
  * eval off,
  * the fast tier every `--eval_every` steps,
  * the fast tier plus the slow tier every `--slow_eval_every` steps, with
    its figures and report rendered by the niced render process as in a run.
It also times each eval pass alone. `overhead / passes` is the loop's extra
time over the isolated cost of the eval passes it ran: near 1 means the
eval adds its forward passes and nothing else. `same, no figures` repeats
the fast+slow window without rendering: the loop's own cost of its evals,
apart from the CPU the render process takes from a machine with no idle
core. The last column projects the slowdown at the default cadences
(fast every 1000 steps, slow every 10000) from the measured per-eval costs.
"""

import dataclasses
import statistics
import sys
import tempfile
import time

import jax
from absl import app, flags

from decompax.bin import evaluation, train, train_flags
from decompax.io import run_dir
from decompax.losses import eval_step
from decompax.targets import registry

_STEPS = flags.DEFINE_integer("window", 400, "Steps per timed window.")
_EVERY = flags.DEFINE_integer("every", 50, "Fast eval cadence in the window.")
_SLOW_EVERY = flags.DEFINE_integer(
  "slow_every", 200, "Slow eval cadence in the window.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timings per isolated pass.")
_BENCH_RECIPES = flags.DEFINE_list(
  "bench_recipes", ["tms_5-2", "resid_mlp1"], "Flagfiles in flags/.")


def load_recipe(name: str) -> train_flags.TrainConfig:
  """Return the validated config of `flags/<name>.flags`."""
  argv = flags.FLAGS.read_flags_from_files([f"--flagfile=flags/{name}.flags"],
                                           force_gnu=False)
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["bench", *argv])
  return train_flags.config_from_flags()


def _median_time(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _window(compiled, state, run, evaluate, steps: int):
  """Return the wall time of `steps` steps (evaluating when given) and the
  final state (the step donates its input)."""
  start = time.perf_counter()
  for s in range(steps):
    state, _ = compiled(state, run.weights, run.data_key)
    if evaluate is not None:
      evaluate(state, s + 1)
  jax.block_until_ready(state)
  return time.perf_counter() - start, state


def bench_recipe(name: str, steps: int, every: int, slow_every: int,
                 repeats: int) -> dict:
  """Return the timing record of one recipe."""
  config = load_recipe(name)
  toy = registry.get(config.target)
  target = toy.fns(config.c)
  weights = toy.init(jax.random.key(0))
  run = train.build_run(config, toy, target, weights)
  compiled = run.built.step.lower(run.state, run.weights,
                                  run.data_key).compile()
  state = run.state
  for _ in range(3):
    state, _ = compiled(state, run.weights, run.data_key)
  out = tempfile.mkdtemp(prefix="eval_cost_")
  run_dir.prepare_run_dir(out, f"--target={config.target}\n", False)
  timed = dataclasses.replace(
    config, num_steps=steps + 1, log_every=1, eval_every=every,
    slow_eval_every=slow_every, slow_on_first_step=False)
  fast_only = dataclasses.replace(timed, slow_eval_every=0)
  evaluators = {
    "fast": evaluation.make_evaluator(fast_only, target, run.ci_fn, run.terms,
                                      run.sample_inputs, run.weights, out),
    "fast+slow": evaluation.make_evaluator(timed, target, run.ci_fn,
                                           run.terms, run.sample_inputs,
                                           run.weights, out),
    "no figures": evaluation.make_evaluator(timed, target, run.ci_fn,
                                            run.terms, run.sample_inputs,
                                            run.weights, out, render=False),
  }
  for ev in evaluators.values():  # compile both tiers outside the window
    ev.evaluate(state, slow_every)
    ev.drain()  # and let those renders finish before anything is timed
  fns = eval_step.make_eval_step(
    target, run.ci_fn, run.terms,
    eval_step.EvalConfig(config.eval_batches, config.num_steps,
                         config.ci_alive_threshold,
                         config.use_delta_component, config.n_mask_samples),
    run.sample_inputs)
  key = eval_step.eval_data_key(config.seed)
  _, batches = fns.fast(state, run.weights, key)
  step_s, state = _window(compiled, state, run, None, repeats * 10)
  record = {
    "recipe": name,
    "step_ms": 1e3 * step_s / (repeats * 10),
    "fast_ms": 1e3 * _median_time(
      lambda: fns.fast(state, run.weights, key), repeats),
    "slow_ms": 1e3 * _median_time(
      lambda: fns.slow(state, run.weights, key, batches), repeats),
  }
  # Off is timed before and after the eval windows, against drifting load.
  off_before, state = _window(compiled, state, run, None, steps)
  for label, ev in evaluators.items():
    record[f"{label}_s"], state = _window(compiled, state, run, ev.evaluate,
                                          steps)
    ev.close()  # a render still running must not load the next window
  off_after, state = _window(compiled, state, run, None, steps)
  record["off_s"] = (off_before + off_after) / 2
  n_fast, n_slow = steps // every, steps // slow_every
  record["passes_s"] = 1e-3 * (n_fast * record["fast_ms"]
                               + n_slow * record["slow_ms"])
  return record


def _projected_ratio(r: dict, every: int, slow_every: int, steps: int,
                     at_every: int, at_slow: int) -> float:
  """Return the loop's slowdown at other cadences from this window's
  measured per-eval loop costs."""
  step_s = r["off_s"] / steps
  fast_cost = (r["fast_s"] - r["off_s"]) / (steps // every)
  slow_cost = (r["fast+slow_s"] - r["fast_s"]) / (steps // slow_every)
  return 1 + (fast_cost / at_every + slow_cost / at_slow) / step_s


def main(argv):
  del argv
  window, every, slow_every = _STEPS.value, _EVERY.value, _SLOW_EVERY.value
  repeats, recipes = _REPEATS.value, _BENCH_RECIPES.value
  print(f"machine: {jax.devices()[0].device_kind}; window {window} steps, "
        f"fast eval every {every}, slow every {slow_every}")
  print(f"{'recipe':<12} {'step ms':>8} {'fast ms':>8} {'slow ms':>8} "
        f"{'on/off fast':>11} {'on/off +slow':>12} {'overhead/passes':>15} "
        f"{'same, no figures':>16} {'on/off @1000/10000':>18}")
  for name in recipes:
    r = bench_recipe(name, window, every, slow_every, repeats)
    overhead = r["fast+slow_s"] - r["off_s"]
    bare = r["no figures_s"] - r["off_s"]
    projected = _projected_ratio(r, every, slow_every, window, 1000, 10000)
    print(f"{name:<12} {r['step_ms']:8.2f} {r['fast_ms']:8.2f} "
          f"{r['slow_ms']:8.2f} {r['fast_s'] / r['off_s']:11.3f} "
          f"{r['fast+slow_s'] / r['off_s']:12.3f} "
          f"{overhead / r['passes_s']:15.2f} {bare / r['passes_s']:16.2f} "
          f"{projected:18.4f}", flush=True)


if __name__ == "__main__":
  sys.argv[0] = "eval_cost"
  app.run(main)
