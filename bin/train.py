"""Decompose a toy target: `bin/train --flagfile=flags/<name>.flags`.

Without flags it runs the embedded default, the SPD paper's TMS 5-2 recipe.
The run directory receives the resolved flags, `metrics.jsonl`, the trained
target, the final decomposition and PNG figures.
"""

import os
import sys
import time
from typing import NamedTuple

import jax
import numpy as np
from absl import app, flags, logging

from decompax.bin import recipe, train_flags
from decompax.core import ci_fns, probe, sites as sites_lib, train_step
from decompax.core import warmup as warmup_lib
from decompax.io import figures, run_dir
from decompax.losses import faithfulness
from decompax.targets import registry

SHORT_NAMES = {
  "faithfulness": "faith",
  "importance_minimality": "imp",
  "frequency_minimality": "freq",
  "stochastic_recon": "recon",
  "stochastic_recon_per_site": "recon_site",
  "stochastic_recon_subset": "recon_subset",
  "stochastic_recon_groups": "recon_groups",
  "persistent_pgd_recon": "pgd",
  "fresh_pgd_recon": "fresh_pgd",
  "nonlinearity_locality": "nl",
}


def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  print(f"train: error: {message}", file=sys.stderr)
  sys.exit(2)


def resolved_flags_text() -> str:
  """Return every train flag as `--name=value`, one per line, sorted."""
  module_flags = flags.FLAGS.get_flags_for_module(train_flags)
  lines = []
  for flag in sorted(module_flags, key=lambda f: f.name):
    if flag.name == "overwrite":
      continue
    value = flag.value
    if isinstance(value, list):
      value = ",".join(str(v) for v in value)
    lines.append(f"--{flag.name}={'' if value is None else value}")
  return "\n".join(lines) + "\n"


def load_or_train_target(toy, config, target_path: str, use_cache: bool):
  """Return trained target weights and their cache record.

  A cached target is used when `use_cache` and it was trained for the same
  target and seed; otherwise the target is trained here.
  """
  seed = toy.default_seed if config.target_seed is None else config.target_seed
  meta = {"target": toy.name, "target_seed": seed}
  if use_cache and os.path.exists(target_path):
    arrays, found = run_dir.load_arrays(target_path)
    found = {k: found.get(k) for k in meta}
    if found != meta:
      raise ValueError(
        f"cached target {target_path} holds {found}, not {meta}; pass "
        "another --target_path or delete the file to retrain")
    print(f"[target] loaded {toy.name} (seed {seed}) from {target_path}")
    return toy.weights_from_arrays(arrays), (arrays, meta)
  print(f"[target] training {toy.name} (seed {seed}) ...", flush=True)
  start = time.time()

  def progress(step, loss):
    print(f"[target]   step {step}  loss {loss:.3e}", flush=True)

  weights = toy.train(seed, progress=progress)
  print(f"[target] trained in {time.time() - start:.1f}s; every feature "
        "represented")
  return weights, (toy.weights_to_arrays(weights), meta)


def format_duration(seconds: float) -> str:
  """Return `1h02m`, `3m05s` or `12s`."""
  seconds = int(max(seconds, 0))
  if seconds >= 3600:
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
  if seconds >= 60:
    return f"{seconds // 60}m{seconds % 60:02d}s"
  return f"{seconds}s"


def progress_line(step, total, metrics, sites, steps_per_s) -> str:
  """Return one terminal line: step, losses, CI-L0, speed and ETA."""
  parts = [f"step {step}/{total}"]
  for name, short in SHORT_NAMES.items():
    if f"loss/{name}" in metrics:
      parts.append(f"{short} {metrics[f'loss/{name}']:.3e}")
  l0 = "/".join(f"{metrics[f'ci_l0/{s.name}']:.2f}" for s in sites)
  parts.append(f"L0 {l0}")
  parts.append(f"{steps_per_s:.0f} it/s")
  parts.append(f"ETA {format_duration((total - step) / max(steps_per_s, 1e-9))}")
  return "  ".join(parts)


def write_figures(output_dir, target, ci_fn, weights, state, metrics_path):
  """Render CI-on-features, U/V and loss-curve PNGs into `figures/`."""
  fig_dir = os.path.join(output_dir, "figures")
  os.makedirs(fig_dir, exist_ok=True)
  ci = jax.device_get(probe.probe_ci(
    target, ci_fn, weights, state.components, state.ci_params))
  ci = {site: np.asarray(v) for site, v in ci.items()}
  figures.plot_ci_on_features(
    ci, os.path.join(fig_dir, "ci_on_features.png"), "CI on one-hot features")
  uv, order = {}, {}
  components = jax.device_get(state.components)
  for site in target.sites:
    v, u = sites_lib.site_factors(components, site)
    uv[site.name] = (np.asarray(v), np.asarray(u))
    perm = probe.identity_permutation(ci[site.name])
    alive = set(probe.alive_components(ci[site.name]))
    order[site.name] = [c for c in perm if c in alive] or perm[:1]
  figures.plot_components(uv, os.path.join(fig_dir, "components.png"), order)
  records = run_dir.read_metrics(metrics_path)
  if records:
    figures.plot_loss_curves(records, os.path.join(fig_dir, "losses.png"))
  return ci


def summarize(ci: dict[str, np.ndarray]) -> list[str]:
  """Return the recovery summary: alive components and identity CI error."""
  lines = []
  for site, matrix in ci.items():
    active = probe.active_features(matrix)
    described = ", ".join(f"c{c}->f{fs}" for c, fs in active.items())
    lines.append(
      f"[result] {site}: {len(active)} alive, identity CI error "
      f"{probe.identity_ci_error(matrix)}; {described}")
  return lines


def setup(config: train_flags.TrainConfig):
  """Return the toy, its function table, trained weights and run dir.

  Every check of user input happens here, before anything is written.
  """
  toy = registry.get(config.target)
  sites = recipe.select_sites(toy.sites(config.c), config.sites, toy.name)
  target = toy.fns(config.c)._replace(sites=sites)
  # Builds every loss term once so that term-level refusals (unknown group
  # sites, missing unit layouts) happen before anything is written.
  recipe.loss_terms(config, sites, config.batch_size, target.nonlinear_units)
  output_dir = config.output_dir
  if output_dir is None:
    # The default location's parent is ours to create; a user's is not.
    os.makedirs("runs", exist_ok=True)
    output_dir = os.path.join("runs", config.target)
  flags_text = resolved_flags_text()
  run_dir.check_run_dir(output_dir, flags_text, config.overwrite)
  target_path = config.target_path or os.path.join(output_dir, "target.npz")
  # --overwrite replaces the run, including a target cached inside it.
  use_cache = config.target_path is not None or not config.overwrite
  weights, cache = load_or_train_target(toy, config, target_path, use_cache)
  run_dir.prepare_run_dir(output_dir, flags_text, config.overwrite)
  if not os.path.exists(target_path):
    run_dir.save_arrays(target_path, *cache)
  return toy, target, weights, output_dir


class Run(NamedTuple):
  """A ready-to-step run: its jitted step, state and keys."""

  built: train_step.TrainStep
  state: train_step.TrainState
  ci_fn: ci_fns.CIFn
  terms: tuple[train_step.LossTerm, ...]
  data_key: jax.Array
  warmup_losses: jax.Array


def build_run(config, toy, target, weights) -> Run:
  """Initialise, warm up faithfulness and build the step of one run."""
  root = jax.random.key(config.seed)
  init_key, _, run_key, data_key = jax.random.split(root, 4)
  vu_key, ci_key = jax.random.split(init_key)
  ci_fn = ci_fns.make_ci_fn(recipe.ci_config(config), target.sites)
  w_stacks = target.frozen_stacks(weights)
  if config.components_init == "projected":
    components = sites_lib.init_components_projected(
      vu_key, target.sites, w_stacks)
  else:
    components = sites_lib.init_components(vu_key, target.sites)
  components, warmup_losses = warmup_lib.faithfulness_warmup(
    lambda comps, ws: faithfulness.faithfulness_per_kind(ws, comps),
    components, w_stacks, config.faithfulness_warmup_steps,
    config.faithfulness_warmup_lr, config.faithfulness_warmup_weight_decay)
  terms = recipe.loss_terms(config, target.sites, config.batch_size,
                            target.nonlinear_units)
  built = train_step.make_train_step(
    target, ci_fn, terms, recipe.step_config(config),
    sample_inputs=lambda key: toy.sample_inputs(key, config.batch_size))
  state = built.init(components, ci_fn.init(ci_key), run_key,
                     (config.batch_size,))
  return Run(built, state, ci_fn, terms, data_key, warmup_losses)


def train(config, toy, target, weights, output_dir):
  """Warm up, train with progress output, then write results."""
  run = build_run(config, toy, target, weights)
  state, ci_fn, data_key = run.state, run.ci_fn, run.data_key
  if config.faithfulness_warmup_steps:
    warm_first, warm_last = jax.device_get(run.warmup_losses)[[0, -1]]
    print(f"[warmup] {config.faithfulness_warmup_steps} faithfulness steps: "
          f"{warm_first:.3e} -> {warm_last:.3e}")
  terms, built = run.terms, run.built
  metrics_path = os.path.join(output_dir, "metrics.jsonl")
  print(f"[train] {toy.name}: sites {', '.join(s.name for s in target.sites)}"
        f"; C={config.c}; terms {', '.join(t.name for t in terms)}")
  compile_start = time.time()
  compiled = built.step.lower(state, weights, data_key).compile()
  print(f"[train] step compiled in {time.time() - compile_start:.1f}s")
  window_start, window_steps = time.time(), 0
  for s in range(config.num_steps):
    state, metrics = compiled(state, weights, data_key)
    window_steps += 1
    done = s + 1
    if done % config.log_every == 0 or done == config.num_steps:
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
      elapsed = time.time() - window_start
      step_time = elapsed / window_steps
      record = {"step": done, **metrics, "step_time_s": step_time}
      run_dir.append_metrics(metrics_path, record)
      print(progress_line(done, config.num_steps, metrics, target.sites,
                          1.0 / step_time), flush=True)
      if config.figures_every and done % config.figures_every == 0:
        write_figures(output_dir, target, ci_fn, weights, state, metrics_path)
      window_start, window_steps = time.time(), 0
  finish(config, target, ci_fn, weights, state, output_dir, metrics_path)


def finish(config, target, ci_fn, weights, state, output_dir, metrics_path):
  """Write the decomposition and figures, and print the recovery summary."""
  arrays = run_dir.flatten_tree(
    {"components": state.components, "ci_params": state.ci_params})
  meta = {
    "sites": [vars(s) for s in target.sites],
    "ci_fn": {"kind": config.ci_fn, "hidden": list(config.ci_hidden)},
    "target": config.target,
    "step": int(jax.device_get(state.step)),
  }
  path = os.path.join(output_dir, "decomposition.npz")
  run_dir.save_arrays(path, arrays, meta)
  ci = write_figures(output_dir, target, ci_fn, weights, state, metrics_path)
  for line in summarize(ci):
    print(line)
  print(f"[train] wrote {path} and {os.path.join(output_dir, 'figures')}/")


def main(argv: list[str]) -> None:
  # JAX reports each accelerator backend it fails to find at INFO level.
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; flags (and flagfile lines) take "
         "the form --name=value")
  jax.config.update("jax_transfer_guard_device_to_host", "disallow")
  try:
    config = train_flags.config_from_flags()
    toy, target, weights, output_dir = setup(config)
  except ValueError as e:
    fail(str(e))
  train(config, toy, target, weights, output_dir)


def parse_flags(argv: list[str]) -> list[str]:
  """Parse flags, turning absl's parse errors into one-line errors."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(f"{e}; see --helpfull")


def entry() -> None:
  """Launch the absl app (used by the `bin/train` launcher)."""
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  entry()
