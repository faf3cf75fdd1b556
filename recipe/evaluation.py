"""In-loop evaluation of a training run (SPEC §11, I44).

Which tiers run after a step, the jitted eval passes on the held-out stream,
the `eval/` scalars for `metrics.jsonl` and their console lines, and the
render of the slow tier's figures and report: a picklable job the evaluator
hands to its `Renderer`. Where and when jobs are drawn, and where lines go,
is the caller's (`bin/figure_worker.py` draws them off the loop); with the
defaults an evaluator draws nothing and says nothing, which is how a
benchmark times the evaluation alone.
"""

import functools
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from decompax.core import sites as sites_lib
from decompax.core.ci_fns import OUTPUT
from decompax.core.target import Expected, TargetFns
from decompax.core.step_records import (
  LossTerm, StreamSpec, TrainState, no_constraint)
from decompax.evals import eval_step, task_eval
from decompax.io import run_dir
from decompax.measures import ci_counts, probe
from decompax.placement import transfer
from decompax.recipe import engine, streams
from decompax.recipe.config import held_out_seed
from decompax.render import ab_grid, figures
from decompax.render import run_report as report

# Components drawn per site in the U/V figure (alive ones first).
MAX_UV_COLUMNS = 64


def due(config, done: int) -> tuple[bool, bool]:
  """Return whether the fast and the slow tier run after `done` steps.

  Cadences nest (`slow_eval_every` is a multiple of `eval_every`); both tiers
  also run at the last step. Step 0 is the fresh-run baseline: the caller
  asks only on fresh runs, and the slow tier runs there only with
  `slow_on_first_step` (I44).
  """
  every, slow_every = config.eval_every, config.slow_eval_every
  if not every:
    return False, False
  if done == 0:
    return True, bool(slow_every and config.slow_on_first_step)
  last = done == config.num_steps
  fast = last or done % every == 0
  slow = bool(slow_every) and (last or done % slow_every == 0)
  return fast, slow


class Renderer(NamedTuple):
  """Where an evaluator hands the render of each slow eval (a picklable
  call, `render_job`): `submit(job)` without waiting; `close()` draws what
  waits and stops; `drain()` draws it and goes on. The binaries' figure
  worker is one (`bin/figure_worker.py`); `NO_RENDERER` drops the jobs."""

  submit: Callable[[Callable[[], Any]], None]
  close: Callable[[], None]
  drain: Callable[[], None]


NO_RENDERER = Renderer(lambda job: None, lambda: None, lambda: None)


def _quiet(line: str) -> None:
  del line


@functools.partial(jax.jit, static_argnames="sites")
def _gather_columns(components, sites, index):
  picked = {}
  for site in sites:
    v, u = sites_lib.site_factors(components, site)
    picked[site.name] = (jnp.take(v, index[site.name], axis=1),
                         jnp.take(u, index[site.name], axis=0))
  return picked


def uv_columns(
  components, sites: tuple[sites_lib.SiteSpec, ...],
  order: dict[str, list[int]],
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Return per site `(V[:, order], U[order, :])` fetched to the host."""
  # Indices padded to one length per site: one compiled gather serves every
  # slow eval, whatever number of components is alive.
  width = {s.name: min(MAX_UV_COLUMNS, s.c) for s in sites}
  index = {name: np.resize(np.asarray(order[name], np.int32), width[name])
           for name in width}
  # collective: every process
  picked = transfer.fetch(_gather_columns(components, sites, index))
  return {name: (v[:, :len(order[name])], u[:len(order[name])])
          for name, (v, u) in picked.items()}


def probe_column_order(ci: np.ndarray, expected: Optional[Expected],
                       threshold: float = probe.IDENTITY_TOL) -> list[int]:
  """Return the alive components of a probe CI in the order of the site's
  expected pattern (identity when None, SPEC §11); at least one."""
  permutation = probe.pattern_permutation(ci, expected)
  alive = set(probe.alive_components(ci, threshold))
  return [c for c in permutation if c in alive] or permutation[:1]


def column_order(summary: eval_step.EvalSummary, site: str,
                 threshold: float,
                 expected: Optional[dict[str, Expected]] = None
                 ) -> list[int]:
  """Return the components to draw for `site`: on toys the alive ones in
  the order of the site's expected pattern (`probe_column_order`), else by
  descending firing density; at least one."""
  if site in summary.probe:
    order = probe_column_order(summary.probe[site],
                               (expected or {}).get(site), threshold)
  else:
    density = summary.arrays["density"][site]
    ranked = np.argsort(-density, kind="stable")
    order = [int(c) for c in ranked if density[c] > 0] or [int(ranked[0])]
  return order[:MAX_UV_COLUMNS]


def plot_probe_and_factors(
  fig_dir: str, probe_ci: dict[str, np.ndarray],
  uv: dict[str, tuple[np.ndarray, np.ndarray]], order: dict[str, list[int]],
  expected: Optional[dict[str, Expected]] = None,
) -> None:
  """Write `ci_on_features.png` (a toy's probe CI, permuted by each site's
  `expected` pattern; none without a probe) and `components.png` (the
  drawn columns `uv` of V and U, labelled by their components `order`):
  the one drawing of both, for the slow evals and a run's final figures."""
  if probe_ci:
    figures.plot_ci_on_features(
      probe_ci, os.path.join(fig_dir, "ci_on_features.png"),
      "CI on one-hot features", expected=expected)
  figures.plot_components(uv, os.path.join(fig_dir, "components.png"),
                          column_labels=order)


def render_slow(
  output_dir: str, summary: eval_step.EvalSummary,
  uv: dict[str, tuple[np.ndarray, np.ndarray]], order: dict[str, list[int]],
  table: Optional[report.ComponentTable], threshold: float,
  expected: Optional[dict[str, Expected]] = None,
) -> None:
  """Write the slow tier's figures, the LM component table and the report;
  probe CI is permuted by each site's `expected` pattern. A dual-role CI
  function's hidden role gets its own CI histograms and log-band densities
  (`report.HIDDEN_FIGURE_CAPTIONS`)."""
  fig_dir = os.path.join(output_dir, "figures")
  arrays = summary.arrays
  for role, suffix in eval_step.ROLE_SUFFIXES.items():
    if f"hist_lower{suffix}" not in arrays:
      continue
    shown = "" if role == OUTPUT else role
    figures.plot_ci_histograms(
      arrays[f"hist_lower{suffix}"], ci_counts.LOWER_EDGES,
      arrays[f"hist_pre{suffix}"], ci_counts.PRE_EDGES,
      os.path.join(fig_dir, f"ci_histograms{suffix}.png"), shown)
    figures.plot_log_density(
      arrays[f"log_density{suffix}"], ci_counts.LOG_DENSITY_MIN,
      os.path.join(fig_dir, f"ci_log_density{suffix}.png"), shown)
  figures.plot_component_density(
    arrays["density"], arrays["mean_ci"],
    os.path.join(fig_dir, "ci_density.png"), threshold)
  if "position_ci" in arrays:
    figures.plot_ci_on_features(
      arrays["position_ci"], os.path.join(fig_dir, "position_ci.png"),
      "Batch-mean CI per position", ylabel="position")
  plot_probe_and_factors(fig_dir, summary.probe, uv, order, expected)
  if table is not None:
    report.write_table(output_dir, table)
  report.write_report(output_dir)


def lm_table(
  stats: dict[str, np.ndarray], summary: eval_step.EvalSummary,
  sites: tuple[sites_lib.SiteSpec, ...], decode: Callable[[int], str],
  k: int,
) -> report.ComponentTable:
  """Return the component table of a token target's slow eval."""
  top = {s.name: eval_step.top_contexts(stats, s.name, k) for s in sites}
  return report.component_table(
    stats["tokens"], top, summary.arrays["density"],
    summary.arrays["mean_ci"], decode)


def render_job(
  output_dir: str, state: TrainState, output: eval_step.EvalOutput,
  summary: eval_step.EvalSummary, sites: tuple[sites_lib.SiteSpec, ...],
  decode: Callable[[int], str], threshold: float, top_contexts: int,
  expected: Optional[dict[str, Expected]] = None,
) -> Callable[[], None]:
  """Return the render of one slow eval: a picklable call of `render_slow`.

  The drawn U/V columns are fetched now, while `state` is live (collective:
  every process). `expected` is the target's (`TargetFns.expected`).
  """
  order = {s.name: column_order(summary, s.name, threshold, expected)
           for s in sites}
  uv = uv_columns(state.components, sites, order)
  table = None
  if "tokens" in output.stats:
    table = lm_table(output.stats, summary, sites, decode, top_contexts)
  return functools.partial(render_slow, output_dir, summary, uv, order,
                           table, threshold, expected)


def _site_values(scalars: dict[str, float], names: tuple[str, ...],
                 sites) -> Optional[str]:
  """Return `a/b/…`, per site the first of `names/<site>` it has (`-` for
  none), or None when no site has any."""
  values = []
  for site in sites:
    found = [scalars[f"{n}/{site.name}"] for n in names
             if f"{n}/{site.name}" in scalars]
    values.append(f"{found[0]:.3g}" if found else "-")
  return None if set(values) == {"-"} else "/".join(values)


def _eval_line(done: int, scalars: dict[str, float], sites, seconds: float,
               slow: bool) -> str:
  parts = [f"[eval] step {done}" + (" (slow)" if slow else "")]
  for variant in ("ci_masked", "stochastic", "pgd", "zero"):
    if f"recon/{variant}" in scalars:
      parts.append(f"{variant} {scalars[f'recon/{variant}']:.3e}")
  for name in ("attn_kl", "router_kl"):
    for variant in eval_step.ATTENTION_VARIANTS:
      if f"{name}/{variant}/all" in scalars:
        parts.append(f"{name}/{variant} "
                     f"{scalars[f'{name}/{variant}/all']:.3e}")
  if "recon/hidden_ci_masked" in scalars:
    parts.append(f"hidden_ci_masked {scalars['recon/hidden_ci_masked']:.3e}")
  # A site's CI error is against its expected pattern, identity or dense.
  for label, names in (("ci_l0", ("ci_l0",)),
                       ("ci_l0_hidden", ("ci_l0_hidden",)),
                       ("alive", ("alive",)),
                       ("ci_error", ("identity_ci_error", "dense_ci_error")),
                       ("mmcs", ("mmcs",)), ("ml2r", ("ml2r",))):
    values = _site_values(scalars, names, sites)
    if values is not None:
      parts.append(f"{label} {values}")
  parts.append(f"{seconds:.2f}s")
  return "  ".join(parts)


def _match_text(expected: Optional[Expected], scalars: dict[str, float],
                site: str) -> str:
  """Return a site's pattern error and, where measured, MMCS and ML2R."""
  pattern = expected.pattern if expected is not None else "identity"
  text = f"{pattern} CI error {scalars[f'{pattern}_ci_error/{site}']:.0f}"
  if expected is not None and expected.pattern == "dense":
    text += f" (k={expected.k})"
  if f"mmcs/{site}" in scalars:
    text += (f", MMCS {scalars[f'mmcs/{site}']:.3f}, "
             f"ML2R {scalars[f'ml2r/{site}']:.3f}")
  return text


def recovery_lines(
  ci: dict[str, np.ndarray], target: TargetFns, weights, components,
) -> list[str]:
  """Return the end-of-run recovery summary, one `[result]` line per probed
  site: its alive components, the features each is active on, the CI error
  against the site's expected pattern (identity or dense, SPEC §11) and,
  where the site declares a feature axis, MMCS and ML2R (SPEC §10).

  `ci` is the probe CI per site on the host (`probe.probe_ci`); `weights`
  the frozen target's as the run holds them and `components` the
  decomposition's, on the host or on device (only the matched sites'
  slices are fetched).
  """
  # Host components become arrays again: the factor reads are JAX functions.
  features = jax.device_get(eval_step.feature_factors(
    target, weights, jax.device_put(components)))
  expected = target.expected or {}
  scalars = eval_step.probe_scalars(ci, features, expected)
  lines = []
  for site, matrix in ci.items():
    active = probe.active_features(matrix)
    described = ", ".join(f"c{c}->f{fs}" for c, fs in active.items())
    lines.append(
      f"[result] {site}: {len(active)} alive, "
      f"{_match_text(expected.get(site), scalars, site)}; "
      f"{described}")
  return lines


class Evaluator(NamedTuple):
  """`evaluate(state, done, abandon)` returns the `eval/` scalars of the
  tiers due after `done` steps ({} when none is, or when `abandon()` turns
  true before the pass ends); `close()` waits for the renders and ends the
  render process; `drain()` only waits for them."""

  evaluate: Callable[..., dict[str, float]]
  close: Callable[[], None]
  drain: Callable[[], None] = lambda: None


def make_eval_config(config, target, compute_dtype: str | None = None
                     ) -> eval_step.EvalConfig:
  """Return the eval pass's settings of a run (`make_evaluator`'s)."""
  return eval_step.EvalConfig(
    n_batches=config.eval_batches, total_steps=config.num_steps,
    ci_alive_threshold=config.ci_alive_threshold,
    with_delta=config.use_delta_component,
    n_mask_samples=config.n_mask_samples,
    pgd_steps=config.eval_pgd_steps, pgd_lr=config.eval_pgd_lr,
    compute_dtype=compute_dtype, attention_kl=config.eval_attention_kl,
    hidden_points=engine.hidden_pass_points(config, target))


def make_evaluator(
  config, target: TargetFns, ci_fn, terms: tuple[LossTerm, ...],
  sample_inputs: Callable, weights, output_dir: str,
  decode: Optional[Callable[[int], str]] = None,
  constrain: Callable = no_constraint,
  eval_batches: Any = None,
  compute_dtype: Optional[str] = None,
  renderer: Renderer = NO_RENDERER,
  say: Callable[[str], None] = _quiet,
  stream: StreamSpec = StreamSpec(""),
) -> Evaluator:
  """Return the evaluator of one run (see `Evaluator`).

  `sample_inputs(key)` draws one batch; the held-out stream's key is a pure
  function of `held_out_seed(config)`, disjoint from the training draws.
  `decode` turns token ids into strings for the LM component table
  (default: ids).
  `constrain` is the run's placement hook (`bin/placement_setup`).
  `eval_batches` (stacked `[eval_batches, ...]`, e.g. read from a token
  file) replace the sampled held-out batches. `compute_dtype` is the train
  step's (`recipe.compute_dtype`), so evals compute as training does.
  Each slow eval's render goes to `renderer` (default: dropped, which is
  how bench/eval_cost.py isolates the loop's own cost of an eval) and
  each eval line, on process 0, to `say`. `stream` is the stream of a
  targeted run the batches come from: its pin and loss positions hold in
  every pass, and its scalars read `eval/<stream>/…`.
  """
  if not config.eval_every:
    return Evaluator(lambda state, done, abandon=None: {}, lambda: None)
  eval_config = make_eval_config(config, target, compute_dtype)
  fns = eval_step.make_eval_step(
    target, ci_fn, terms, eval_config,
    sample_inputs if eval_batches is None else None, constrain, stream)
  writer = jax.process_index() == 0

  def submit_render(state, output, summary):
    renderer.submit(render_job(
      output_dir, state, output, summary, target.sites, decode or str,
      config.ci_alive_threshold, eval_config.top_contexts, target.expected))

  evaluate = _evaluate_fn(config, fns, weights, eval_batches, target,
                          submit_render, say if writer else _quiet,
                          stream.name)
  return Evaluator(evaluate, renderer.close, renderer.drain)


def combined(evaluators: tuple[Evaluator, ...]) -> Evaluator:
  """Return one evaluator running each of `evaluators` in turn (a targeted
  run's streams), their scalars merged."""

  def evaluate(state, done, abandon=lambda: False):
    record = {}
    for one in evaluators:
      record.update(one.evaluate(state, done, abandon))
    return record

  def close():
    for one in evaluators:
      one.close()

  def drain():
    for one in evaluators:
      one.drain()

  return Evaluator(evaluate, close, drain)


def make_task_evaluator(
  config, target: TargetFns, ci_fn, weights, output_dir: str,
  compute_dtype: Optional[str] = None, nontarget_batches: Any = None,
  say: Callable[[str], None] = _quiet,
) -> Evaluator:
  """Return the task evaluator of a targeted run whose target stream is a
  built-in two-operand task (`evals.task_eval`): at every fast eval the
  `eval/task/…` scalars over the task's every prompt and held-out
  non-target batches; at every slow eval the A/B grid page
  (`report/ab_grid.html`). `nontarget_batches` (`[n, B, T]`) are a
  token-file non-target stream's held-out batches; a task stream's are
  drawn. Each eval line goes, on process 0, to `say`."""
  task = streams.target_task(config)
  if not config.eval_every or task is None or task.grid is None:
    return Evaluator(lambda state, done, abandon=None: {}, lambda: None)
  fn = task_eval.make_task_eval(target, ci_fn, task.answer_positions,
                                config.ci_alive_threshold, compute_dtype)
  prompts = task.grid.prompts()
  key = eval_step.eval_data_key(held_out_seed(config))
  if nontarget_batches is not None:
    other = nontarget_batches.reshape(-1, nontarget_batches.shape[-1])
  else:
    sample = streams.sampler(config)
    other = jnp.concatenate([sample(jax.random.fold_in(key, i))[
      streams.NONTARGET] for i in range(config.eval_batches)])
  writer = jax.process_index() == 0

  def evaluate(state: TrainState, done: int,
               abandon: Callable[[], bool] = lambda: False
               ) -> dict[str, float]:
    fast, slow = due(config, done)
    if not fast or abandon():
      return {}
    out = jax.device_get(fn(state.components, state.ci_params, weights,
                            prompts, other))
    scalars = {k: float(v) for k, v in out.scalars.items()}
    if writer:
      say(_task_line(done, scalars, target.sites))
      if slow and config.ab_grid != "off":
        ab_grid.write(os.path.join(output_dir, report.REPORT_DIR),
                      ab_grid.snapshot(
                        done, task.grid.operators, task.grid.shape,
                        out.answer_ci, out.alive,
                        out.other_density))
    return {f"eval/{k}": v for k, v in scalars.items()}

  return Evaluator(evaluate, lambda: None)


def _task_line(done: int, scalars: dict[str, float], sites) -> str:
  def three(prefix):
    return "/".join(f"{scalars[f'{prefix}/{v}']:.3g}"
                    for v in ("clean", "ci_masked", "ablated"))
  alive = "/".join(str(int(scalars[f"task/alive/{s.name}"])) for s in sites)
  l0 = "/".join(f"{scalars[f'task/answer_l0/{s.name}']:.2f}" for s in sites)
  hidden_l0 = [f"task/answer_l0_hidden/{s.name}" for s in sites]
  if all(k in scalars for k in hidden_l0):
    l0 += " (hidden " + "/".join(f"{scalars[k]:.2f}" for k in hidden_l0) + ")"
  return (f"[eval task] step {done}  answer L0 {l0}  "
          f"answer acc clean/ci/ablated "
          f"{three('task/answer_accuracy')}  answer CE "
          f"{three('task/answer_ce')}  non-target CE clean/ablated "
          f"{scalars['task/nontarget_ce/clean']:.3g}/"
          f"{scalars['task/nontarget_ce/ablated']:.3g}  alive {alive}")


def _evaluate_fn(
  config, fns: eval_step.EvalFns, weights, eval_batches: Any,
  target: TargetFns, submit_render: Callable[..., None],
  say: Callable[[str], None], stream: str = "",
) -> Callable[..., dict[str, float]]:
  """Return `evaluate(state, done, abandon)` of `Evaluator`: run the tiers
  due, hand a slow pass's render to `submit_render(state, output,
  summary)`, hand the eval line to `say` and return the scalars, under
  `eval/<stream>/` for a targeted run's stream."""
  key = eval_step.eval_data_key(held_out_seed(config))
  prefix = f"eval/{stream}/" if stream else "eval/"

  def evaluate(state: TrainState, done: int,
               abandon: Callable[[], bool] = lambda: False
               ) -> dict[str, float]:
    fast, slow = due(config, done)
    if not fast or abandon():
      return {}
    start = time.time()
    output, batches = fns.fast(state, weights, key, eval_batches)
    if slow and abandon():
      # A pending stop signal: drop the pass so the save comes sooner.
      return {}
    if slow:
      output = eval_step.merge_slow(
        output, fns.slow(state, weights, key, batches))
    output = transfer.fetch(output)  # collective: every process
    summary = eval_step.summarize(output, target.expected)
    if slow:
      submit_render(state, output, summary)
    seconds = time.time() - start
    line = _eval_line(done, summary.scalars, target.sites, seconds, slow)
    say(line.replace("[eval]", f"[eval {stream}]" if stream else "[eval]", 1))
    record = {f"{prefix}{k}": v for k, v in summary.scalars.items()}
    record[f"{prefix}time_s"] = seconds
    return record

  return evaluate


def log_baseline(evaluator: Evaluator, state: TrainState,
                 metrics_path: str) -> None:
  """Evaluate a fresh run before its first update; record it as step 0.

  Every process evaluates; process 0 writes the record.
  """
  record = evaluator.evaluate(state, 0)
  if record and jax.process_index() == 0:
    run_dir.append_metrics(metrics_path, {"step": 0, **record})


def write_final_report(output_dir: str,
                       say: Callable[[str], None] = _quiet) -> None:
  """Rewrite the report once the run's last figures exist (process 0),
  saying where."""
  if jax.process_index() == 0:
    path = report.write_report(output_dir)
    say(f"[report] wrote {path}")
