"""What in-loop evaluation costs the training loop, as ratios.

Run: `./dev bench eval_cost`.
For each recipe it builds the run as `bin/train` does (untrained target
weights), compiles the step and both eval passes, then runs `--rounds`
rounds. A round first times, each right after `--every` steps and in turn
(`paired_costs`), the bare fast pass, an evaluate call of the fast tier,
the bare fast and slow passes, and an evaluate call of both tiers. Then it
times the same `--window` of steps three ways, in an order rotated from
round to round so that drifting machine load falls on each way alike:
  * eval off,
  * the fast tier every `--every` steps,
  * the fast tier plus the slow tier every `--slow_every` steps.
Every window fetches the step's metrics at each eval step, as `bin/train`
does at its log steps.

Reported per recipe, as medians over the rounds with their range:
  * `fast` and `fast+slow`: window time over the eval-off window;
  * `loop / passes`: the fast+slow window's extra time over the time of the
    bare passes it ran. 1 means the evals cost the loop their forward
    passes and nothing more;
  * `fast call / pass` and `slow call / passes`: an evaluate call over the
    bare passes it runs; the call adds the host reduction of the outputs
    (scalars, summed arrays, the drawn U/V columns) and the eval line;
  * `loop / calls`: the window's extra time over the time inside its calls.
    1 means the loop pays for the calls and nothing after them (no slower
    steps, no waiting for figures).
The slow tier's figures are drawn in a child process, held to
`--figure_cpu_share` of one core (`bin/figure_worker.py`), so
they are not in the windows; `render s` is the CPU time of one render
(median of three, in this process) and `figures, core share` the part of
one core the renders take at this cadence and at the default one. The last
column projects the loop's slowdown at the default cadences (fast every
1000 steps, slow every 10000) from the measured per-eval loop costs.
"""

import dataclasses
import statistics
import sys
import tempfile
import time

import jax
from absl import app, flags

# The bench times bin/train's own evaluator, which lives with the loop.
from decompax.evals import eval_step
from decompax.io import run_dir
from decompax.recipe import assembly, evaluation
from decompax.recipe.config import TrainConfig, held_out_seed
from decompax.recipe.flagfiles import read_args
from decompax.targets import registry

_WINDOW = flags.DEFINE_integer("window", 200, "Steps per timed window.")
_EVERY = flags.DEFINE_integer("every", 50, "Fast eval cadence in the window.")
_SLOW_EVERY = flags.DEFINE_integer(
  "slow_every", 100, "Slow eval cadence in the window.")
_ROUNDS = flags.DEFINE_integer("rounds", 9, "Rounds of the three windows.")
_REPEATS = flags.DEFINE_integer(
  "eval_repeats", 3, "Timings of each bare pass and call per round.")
_BENCH_RECIPES = flags.DEFINE_list(
  "bench_recipes", ["tms_5-2", "resid_mlp1"], "Flagfiles in flags/.")

DEFAULT_EVERY, DEFAULT_SLOW_EVERY = 1000, 10000
WAYS = ("off", "fast", "fast+slow")


def load_recipe(name: str) -> TrainConfig:
  """Return the config of `flags/<name>.flags`."""
  return read_args([f"--flagfile=flags/{name}.flags"])


def _median_time(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _median_cpu(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.process_time()
    fn()
    times.append(time.process_time() - start)
  return statistics.median(times)


def window(compiled, state, run, evaluate, steps: int, every: int):
  """Run `steps` steps as `bin/train`'s loop does with `log_every = every`.

  Returns the wall time, the time inside `evaluate` calls (none when it is
  None) and the final state (the step donates its input).
  """
  in_calls = 0.0
  start = time.perf_counter()
  for s in range(steps):
    state, metrics = compiled(state, run.weights, run.data_key)
    if (s + 1) % every == 0:
      jax.device_get(metrics)
      if evaluate is not None:
        called = time.perf_counter()
        evaluate(state, s + 1)
        in_calls += time.perf_counter() - called
  jax.block_until_ready(state)
  return time.perf_counter() - start, in_calls, state


def paired_costs(compiled, state, run, fns, key, evaluators, every: int,
                 slow_every: int, repeats: int):
  """Return median times of four things, each run right after `every`
  steps as the loop runs its evals, and the final state: the bare fast
  pass, an evaluate call of the fast tier, the bare fast and slow passes,
  and an evaluate call of both tiers. The four alternate, so drifting load
  falls on each alike.

  Back to back, a pass finds its code and buffers in the caches; after a
  stretch of steps, where the loop runs it, it does not (on the 2-core CPU
  the tms_5-2 fast pass takes 51 ms back to back and 72 ms after 50 steps).
  """
  def both():
    output, batches = fns.fast(state, run.weights, key)
    return output, fns.slow(state, run.weights, key, batches)

  measures = {
    "fast_pass": lambda: fns.fast(state, run.weights, key),
    "fast_call": lambda: evaluators["fast"].evaluate(state, every),
    "both_pass": both,
    "both_call": lambda: evaluators["fast+slow"].evaluate(state, slow_every),
  }
  times = {name: [] for name in measures}
  for _ in range(repeats):
    for name, measure in measures.items():
      *_, state = window(compiled, state, run, None, every, every)
      times[name].append(_median_time(measure, 1))
  return {k: statistics.median(v) for k, v in times.items()}, state


def _spread(values: list[float]) -> tuple[float, float, float]:
  return statistics.median(values), min(values), max(values)


def _say(line: str) -> None:
  # The eval line, printed as bin/train prints it: part of a call's cost.
  print(line, flush=True)


def make_evaluators(config, run, target, out: str, steps: int, every: int,
                    slow_every: int) -> dict[str, evaluation.Evaluator]:
  """Return the evaluators of the fast and the fast+slow windows. They draw
  no figures (no renderer): bin/train draws them in a child process, apart
  from the loop."""
  timed = dataclasses.replace(
    config, num_steps=steps + 1, eval_every=every, slow_eval_every=slow_every,
    slow_on_first_step=False)
  tiers = {"fast": dataclasses.replace(timed, slow_eval_every=0),
           "fast+slow": timed}
  return {way: evaluation.make_evaluator(
    tier, target, run.ci_fn, run.terms, run.sample_inputs, run.weights, out,
    say=_say) for way, tier in tiers.items()}


def bench_recipe(name: str, steps: int, every: int, slow_every: int,
                 rounds: int, repeats: int) -> dict:
  """Return the timing record of one recipe (see the module docstring)."""
  config = load_recipe(name)
  toy = registry.get(config.target)
  target = toy.fns(config.c)
  weights = toy.init(jax.random.key(0))
  run = assembly.build_run(config, toy, target, weights)
  compiled = run.built.step.lower(run.state, run.weights,
                                  run.data_key).compile()
  state = run.state
  for _ in range(3):
    state, _ = compiled(state, run.weights, run.data_key)
  out = tempfile.mkdtemp(prefix="eval_cost_")
  run_dir.prepare_run_dir(out, f"--target={config.target}\n", False)
  evaluators = make_evaluators(config, run, target, out, steps, every,
                               slow_every)
  for ev in evaluators.values():  # compile both tiers outside the windows
    ev.evaluate(state, slow_every)
  eval_config = eval_step.EvalConfig(
    config.eval_batches, config.num_steps, config.ci_alive_threshold,
    config.use_delta_component, config.n_mask_samples, pgd_steps=
    config.eval_pgd_steps, pgd_lr=config.eval_pgd_lr)
  fns = eval_step.make_eval_step(target, run.ci_fn, run.terms, eval_config,
                                 run.sample_inputs)
  key = eval_step.eval_data_key(held_out_seed(config))
  _, batches = fns.fast(state, run.weights, key)  # compile the bare passes
  jax.block_until_ready(fns.slow(state, run.weights, key, batches))
  rows = []
  for r in range(rounds):
    costs, state = paired_costs(compiled, state, run, fns, key, evaluators,
                                every, slow_every, repeats)
    times, calls = {}, {}
    for way in WAYS[r % 3:] + WAYS[:r % 3]:
      evaluate = evaluators[way].evaluate if way in evaluators else None
      times[way], calls[way], state = window(compiled, state, run, evaluate,
                                             steps, every)
    rows.append(round_row(costs, times, calls["fast+slow"], steps,
                          steps // every, steps // slow_every))
  for ev in evaluators.values():
    ev.close()
  render_s = render_cpu_seconds(out, state, run, fns, key, target, config,
                                eval_config.top_contexts)
  record = {k: _spread([row[k] for row in rows]) for k in rows[0]}
  record.update(recipe=name, render_s=render_s,
                share=config.figure_cpu_share)
  return record


def round_row(costs: dict, times: dict, in_calls: float, steps: int,
              n_fast: int, n_slow: int) -> dict:
  """Return one round's ratios and per-eval costs (see the docstring)."""
  fast_s, slow_s = costs["fast_pass"], costs["both_pass"] - costs["fast_pass"]
  extra = times["fast+slow"] - times["off"]
  return {
    "fast": times["fast"] / times["off"],
    "fast+slow": times["fast+slow"] / times["off"],
    "loop": extra / (n_fast * fast_s + n_slow * slow_s),
    "fast_calls": costs["fast_call"] / costs["fast_pass"],
    "slow_calls": costs["both_call"] / costs["both_pass"],
    "loop_calls": extra / in_calls,
    "step_s": times["off"] / steps,
    "fast_pass_s": fast_s,
    "slow_pass_s": slow_s,
    "fast_cost_s": (times["fast"] - times["off"]) / n_fast,
    "slow_cost_s": (times["fast+slow"] - times["fast"]) / n_slow,
  }


def render_cpu_seconds(out, state, run, fns, key, target, config,
                       top_contexts: int) -> float:
  """Return the median CPU time of drawing one slow eval's figures here."""
  output, batches = fns.fast(state, run.weights, key)
  output = jax.device_get(eval_step.merge_slow(
    output, fns.slow(state, run.weights, key, batches)))
  job = evaluation.render_job(out, state, output,
                              eval_step.summarize(output), target.sites, str,
                              config.ci_alive_threshold, top_contexts)
  job()  # matplotlib's first figure pays its imports and font cache
  return _median_cpu(job, 3)


def projected_ratio(r: dict, at_every: int, at_slow: int) -> float:
  """Return the loop's slowdown at other cadences from the measured
  per-eval loop costs (medians)."""
  step_s = r["step_s"][0]
  extra = r["fast_cost_s"][0] / at_every + r["slow_cost_s"][0] / at_slow
  return 1 + extra / step_s


def figure_share(r: dict, slow_every: int) -> float:
  """Return the part of one core the renders take with a slow eval every
  `slow_every` steps, under the run's cap."""
  return min(r["share"], r["render_s"] / (slow_every * r["step_s"][0]))


def _cell(spread: tuple[float, float, float], digits: int = 2) -> str:
  median, low, high = spread
  return f"{median:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def main(argv):
  del argv
  steps, every, slow_every = _WINDOW.value, _EVERY.value, _SLOW_EVERY.value
  rounds, repeats, recipes = _ROUNDS.value, _REPEATS.value, _BENCH_RECIPES.value
  print(f"machine: {jax.devices()[0].device_kind}; {rounds} rounds of "
        f"{steps}-step windows, fast eval every {every}, slow every "
        f"{slow_every}; medians [min, max] over rounds")
  columns = ("recipe", "step ms", "fast pass ms", "slow pass ms", "fast",
             "fast+slow", "loop / passes", "fast call / pass",
             "slow call / passes", "loop / calls", "render s",
             "figures, core share", "default cadence")
  print(" | ".join(columns))
  for name in recipes:
    r = bench_recipe(name, steps, every, slow_every, rounds, repeats)
    cells = (
      name, f"{1e3 * r['step_s'][0]:.2f}",
      f"{1e3 * r['fast_pass_s'][0]:.1f}", f"{1e3 * r['slow_pass_s'][0]:.1f}",
      _cell(r["fast"], 3), _cell(r["fast+slow"], 3), _cell(r["loop"]),
      _cell(r["fast_calls"]), _cell(r["slow_calls"]), _cell(r["loop_calls"]),
      f"{r['render_s']:.2f}",
      f"{figure_share(r, slow_every):.3f} here, "
      f"{figure_share(r, DEFAULT_SLOW_EVERY):.3f} default",
      f"{projected_ratio(r, DEFAULT_EVERY, DEFAULT_SLOW_EVERY):.4f}")
    print(" | ".join(cells), flush=True)


if __name__ == "__main__":
  sys.argv[0] = "eval_cost"
  app.run(main)
