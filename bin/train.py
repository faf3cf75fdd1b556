"""Decompose a toy target: `bin/train --flagfile=flags/<name>.flags`.

Without flags it runs the embedded default, the SPD paper's TMS 5-2 recipe.
The run directory receives the resolved flags, `metrics.jsonl`, the trained
target, checkpoints, the final decomposition and PNG figures. The same
command resumes an interrupted run; SIGTERM/SIGINT save the completed step
and exit with 75 for a requeue (`checkpointing`).
"""

import functools
import os
import time
from typing import NamedTuple

import jax
import numpy as np
from absl import flags, logging

from decompax.bin import checkpointing, cli, evaluation, recipe, run_records
from decompax.bin import lm_setup, placement_setup, term_table, token_data
from decompax.bin import tokens_text, train_flags
from decompax.core import ci_fns, health, probe, sites as sites_lib
from decompax.core import train_step
from decompax.core import warmup as warmup_lib
from decompax.io import checkpoint, decomposition, figures, run_dir
from decompax.placement import transfer
from decompax.losses import faithfulness
from decompax.targets import registry

# Flags a launch may change without changing the run (flags.txt omits them).
RELAUNCH_FLAGS = ("overwrite", "on_nonfinite", "max_skipped_in_a_row")


def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  cli.fail("train", message)


def _run_flags() -> list:
  """Return the train flags that define a run (flags.txt), sorted."""
  module_flags = flags.FLAGS.get_flags_for_module(train_flags)
  return [flag for flag in sorted(module_flags, key=lambda f: f.name)
          if flag.name not in RELAUNCH_FLAGS
          and flag.name not in placement_setup.LAUNCH_FLAGS]


def _recorded(value) -> str:
  if isinstance(value, list):
    value = ",".join(str(v) for v in value)
  return "" if value is None else str(value)


def resolved_flags_text() -> str:
  """Return every train flag as `--name=value`, one per line, sorted."""
  lines = [f"--{flag.name}={_recorded(flag.value)}" for flag in _run_flags()]
  return "\n".join(lines) + "\n"


def flag_defaults() -> dict[str, str]:
  """Return each run flag's default as flags.txt records values, so that a
  run made before a flag existed resumes (`run_dir.check_run_dir`)."""
  return {flag.name: _recorded(flag.default) for flag in _run_flags()}


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
  for term in term_table.TERMS:
    if f"loss/{term.name}" in metrics:
      parts.append(f"{term.short} {metrics[f'loss/{term.name}']:.3e}")
  l0 = "/".join(f"{metrics[f'ci_l0/{s.name}']:.2f}" for s in sites)
  parts.append(f"L0 {l0}")
  parts.append(f"{steps_per_s:.0f} it/s")
  eta = (total - step) / max(steps_per_s, 1e-9)
  parts.append(f"ETA {format_duration(eta)}")
  return "  ".join(parts)


def write_figures(output_dir, target, ci_fn, weights, state, metrics_path):
  """Render CI-on-features, U/V and loss-curve PNGs into `figures/`."""
  fig_dir = os.path.join(output_dir, "figures")
  os.makedirs(fig_dir, exist_ok=True)
  if target.feature_probe is None:  # language models: no features to probe
    records = run_dir.read_metrics(metrics_path)
    if records:
      figures.plot_loss_curves(records, os.path.join(fig_dir, "losses.png"))
    return {}
  # The state arrives on the host (fetched); the probe and the factor reads
  # are JAX functions, so give them arrays again.
  state = state._replace(components=jax.device_put(state.components),
                         ci_params=jax.device_put(state.ci_params))
  ci = jax.device_get(probe.probe_ci(
    target, ci_fn, weights, state.components, state.ci_params))
  ci = {site: np.asarray(v) for site, v in ci.items()}
  figures.plot_ci_on_features(
    ci, os.path.join(fig_dir, "ci_on_features.png"), "CI on one-hot features")
  uv, order = {}, {}
  for site in target.sites:
    v, u = jax.device_get(sites_lib.site_factors(state.components, site))
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


def resolve_target(config: train_flags.TrainConfig):
  """Return the target record, the selected sites, their function table and,
  for checkpoint LMs, the weight loader (None: toys train their weights)."""
  if lm_setup.is_lm(config):
    toy, target, load = lm_setup.hf_target(config)
    return toy, target.sites, target, load
  toy = registry.get(config.target)
  sites = recipe.select_sites(toy.sites(config.c), config.sites, toy.name)
  return toy, sites, registry.fns_for(toy, config.c, sites), None


def ci_config_of(config, toy, sites):
  """Return the run's CI config; LM transformer CIs chunk by block."""
  width = toy.config.d_model if lm_setup.is_lm(config) else 0
  return recipe.ci_config(config, sites, width)


def setup(config: train_flags.TrainConfig, placement=None):
  """Return the toy, its function table, trained weights and run dir.

  Every check of user input happens here, before anything is written
  (with a placement: its `--place` layouts, see `report_placement`).
  """
  toy, sites, target, load_lm = resolve_target(config)
  lead = lm_setup.lead_shape(target, toy.sample_inputs, config.batch_size)
  # Builds every loss term once so that term-level refusals (unknown group
  # sites, missing unit layouts) happen before anything is written.
  recipe.loss_terms(config, sites, lm_setup.tokens_per_batch(lead),
                    target.nonlinear_units, lead)
  output_dir = config.output_dir
  if output_dir is None:
    # The default location's parent is ours to create; a user's is not.
    os.makedirs("runs", exist_ok=True)
    output_dir = os.path.join("runs", toy.name)
  flags_text = resolved_flags_text()
  run_dir.check_run_dir(output_dir, flags_text, config.overwrite,
                        flag_defaults())
  # The lock lasts as long as its descriptor, which nothing closes. An
  # existing run is locked before anything reads it; a new one only once
  # every check has passed, since locking creates the directory.
  writer, lock = placement_setup.is_writer(), None
  if writer and os.path.isdir(output_dir):
    lock = run_dir.lock_run_dir(output_dir)
  checkpointing.check_entry(config, output_dir, sites,
                            ci_config_of(config, toy, sites))
  target_path = config.target_path or os.path.join(output_dir, "target.npz")
  # --overwrite replaces the run, including a target cached inside it.
  use_cache = config.target_path is not None or not config.overwrite
  if lm_setup.is_lm(config):
    weights, cache = load_lm(), None
  else:
    weights, cache = load_or_train_target(toy, config, target_path, use_cache)
    weights = registry.weights_for(toy, weights, sites)
  recipe.check_rider_points(config, target, weights,
                            toy.sample_inputs(jax.random.key(0), 2))
  if lm_setup.is_lm(config):
    print(token_data.describe(open_token_data(config, toy)))
  if placement is not None:
    report_placement(config, toy, target, weights, placement, lead)
  if writer:
    if lock is None:
      run_dir.lock_run_dir(output_dir)
    run_dir.prepare_run_dir(output_dir, flags_text, config.overwrite,
                            flag_defaults())
    if cache is not None and not os.path.exists(target_path):
      run_dir.save_arrays(target_path, *cache)
  return toy, target, weights, output_dir


def report_placement(config, toy, target, weights, placement,
                     lead: tuple[int, ...]) -> None:
  """Refuse `--place` layouts that do not tile the run's arrays (ValueError)
  and print where the preset's layouts replicate what does not tile
  (process 0), from the run's shapes alone; `lead` is the batch's lead
  shape."""
  state = jax.eval_shape(lambda: build_run(
    config, toy, target, weights, restore=lambda state, *_: state).state)
  lines = placement_setup.check_layouts(
    placement, state, weights, lead,
    jax.eval_shape(target.frozen_stacks, weights))
  if placement_setup.is_writer():
    for line in lines:
      print(line)


def open_token_data(config, toy) -> token_data.TokenData | None:
  """Return an LM run's token files (None: batches sampled in the step)."""
  if not lm_setup.is_lm(config):
    return None
  return token_data.open_data(config, toy.config.vocab_size)


class Run(NamedTuple):
  """A ready-to-step run: its jitted step, state and keys."""

  built: train_step.TrainStep
  state: train_step.TrainState
  ci_fn: ci_fns.CIFn
  terms: tuple[train_step.LossTerm, ...]
  data_key: jax.Array
  warmup_losses: jax.Array
  # The frozen weights as the step takes them (on the mesh when placed), the
  # batch sampler and the placement hook for other passes (evals).
  weights: object = None
  sample_inputs: object = None
  constrain: object = train_step.no_constraint
  # Token files (None: the step samples its own batch from `data_key`) and
  # where a host batch goes on the mesh (None: unplaced).
  data: token_data.TokenData | None = None
  inputs_sharding: object = None

  def step_inputs(self, step: int):
    """Return what the step takes beside state and weights at `step`."""
    if self.data is None:
      return self.data_key
    return token_data.train_batch(self.data, step, self.inputs_sharding)

  def eval_batches(self, n_batches: int):
    """Return the held-out batches read from token files, or None."""
    if self.data is None:
      return None
    return token_data.eval_batches(self.data, n_batches, self.inputs_sharding)


def build_run(config, toy, target, weights, restore=None,
              placement=None) -> Run:
  """Initialise, warm up faithfulness and build the step of one run.

  With `restore(state, reinit, shardings, term_names)` (a resume or
  fine-tune init) the warmup is skipped and the initial state is replaced by
  the restored one, read onto the placement's shardings when placed. With a
  `placement_setup.Placement` the step, state and weights go on its mesh.
  """
  root = jax.random.key(config.seed)
  init_key, _, run_key, data_key = jax.random.split(root, 4)
  vu_key, ci_key = jax.random.split(init_key)
  ci_fn = ci_fns.make_ci_fn(ci_config_of(config, toy, target.sites),
                            target.sites)
  components, warmup_losses = warm_components(
    config, target, weights, vu_key, warm=restore is None)
  lead = lm_setup.lead_shape(target, toy.sample_inputs, config.batch_size)
  terms = recipe.loss_terms(config, target.sites,
                            lm_setup.tokens_per_batch(lead),
                            target.nonlinear_units, lead)

  def sample(key):
    return toy.sample_inputs(key, config.batch_size)

  data = open_token_data(config, toy)
  make_step = functools.partial(
    train_step.make_train_step, target, ci_fn, terms,
    recipe.step_config(config), sample_inputs=None if data else sample)
  built = make_step()
  state = init_state(built, placement, components, ci_fn.init(ci_key),
                     run_key, lead, restore, tuple(t.name for t in terms))
  constrain, inputs_sharding = train_step.no_constraint, None
  if placement is not None:
    built, state, weights, sample, constrain, inputs_sharding = (
      placement_setup.place_run(
        placement, make_step, state, weights, lead, sample,
        None if data is None else token_data.example_batch(data)))
  return Run(built, state, ci_fn, terms, data_key, warmup_losses, weights,
             sample, constrain, data, inputs_sharding)


def warm_components(config, target, weights, vu_key, warm: bool):
  """Return the initial components, after the faithfulness warmup when
  `warm`, and the warmup's losses (none without it)."""
  w_stacks = target.frozen_stacks(weights)
  if config.components_init == "projected":
    components = sites_lib.init_components_projected(
      vu_key, target.sites, w_stacks)
  else:
    components = sites_lib.init_components(vu_key, target.sites)
  return warmup_lib.faithfulness_warmup(
    lambda comps, ws: faithfulness.faithfulness_per_kind(ws, comps),
    components, w_stacks, config.faithfulness_warmup_steps if warm else 0,
    config.faithfulness_warmup_lr, config.faithfulness_warmup_weight_decay)


def init_state(built, placement, components, ci_params, run_key, lead,
               restore=None, term_names=()) -> train_step.TrainState:
  """Return the step's initial state, on the placement's shardings when
  placed, replaced by the restored one with `restore` (see `build_run`)."""
  shardings = placement_setup.state_shardings(placement, jax.eval_shape(
    lambda c, p, k: built.init(c, p, k, lead), components, ci_params,
    run_key), lead)
  init = built.init
  if shardings is not None:
    # The optimizer moments are born in their shards: a whole copy of the
    # state need never fit one device.
    init = jax.jit(built.init, static_argnums=3, out_shardings=shardings)
  state = init(components, ci_params, run_key, lead)
  if restore is not None:
    # Placed runs read each leaf straight into its shards on the mesh.
    state = restore(state, lambda comps, ci_params: built.init(
      comps, ci_params, run_key, lead), shardings, term_names)
  return state


def train(config, toy, target, weights, output_dir, placement=None):
  """Warm up, train with progress output, then write results.

  Every process runs this; only process 0 writes (`placement_setup`).
  """
  writer = placement_setup.is_writer()
  session = checkpointing.open_session(
    config, output_dir, target.sites,
    ci_config_of(config, toy, target.sites))
  run = build_run(config, toy, target, weights,
                  checkpointing.restorer(session), placement)
  session = checkpointing.with_terms(session, tuple(t.name for t in run.terms))
  checkpointing.after_warmup(session, run.state)
  print_warmup(config, run.warmup_losses)
  print(f"[train] {toy.name}: sites {', '.join(s.name for s in target.sites)}"
        f"; C={config.c}; terms {', '.join(t.name for t in run.terms)}")
  first = int(jax.device_get(run.state.step))
  loop = Loop(config, target, weights, run, compile_step(run, first, placement),
              evaluator_of(config, target, run, output_dir), session,
              output_dir, writer)
  if first == 0:  # fresh runs only (SPEC I44)
    evaluation.log_baseline(loop.evaluator, run.state, loop.metrics_path)
  state = run_steps(loop, run.state, first)
  checkpointing.close(session)
  loop.evaluator.close()
  checkpointing.check_finite(session, state, full=True)
  state = transfer.fetch(state)  # collective: every process
  if writer:
    finish(config, target, run.ci_fn, session.ci_config, weights, state,
           output_dir, loop.metrics_path)
    evaluation.write_final_report(output_dir)


def print_warmup(config, warmup_losses: jax.Array) -> None:
  """Print the faithfulness warmup's first and last loss, if it ran."""
  if warmup_losses.shape[0]:
    warm_first, warm_last = jax.device_get(warmup_losses)[[0, -1]]
    print(f"[warmup] {config.faithfulness_warmup_steps} faithfulness steps: "
          f"{warm_first:.3e} -> {warm_last:.3e}")


def compile_step(run: Run, first: int, placement=None):
  """Return the run's step compiled for its state at step `first`."""
  compile_start = time.time()
  compiled = run.built.step.lower(
    run.state, run.weights, run.step_inputs(first)).compile(
      placement.compiler_options if placement else None)
  print(f"[train] step compiled in {time.time() - compile_start:.1f}s")
  return compiled


def evaluator_of(config, target, run: Run,
                 output_dir: str) -> evaluation.Evaluator:
  """Return the run's in-loop evaluator (`evaluation.make_evaluator`)."""
  return evaluation.make_evaluator(
    config, target, run.ci_fn, run.terms, run.sample_inputs, run.weights,
    output_dir, constrain=run.constrain,
    eval_batches=run.eval_batches(config.eval_batches),
    compute_dtype=recipe.compute_dtype(config),
    decode=(tokens_text.token_decoder(config.model_dir)
            if lm_setup.is_lm(config) else None))


class Loop(NamedTuple):
  """What the training loop holds beside the state: the run, its compiled
  step and evaluator, the checkpoint session and where results go. `weights`
  are the host's frozen weights (figures); `writer`: this process writes."""

  config: train_flags.TrainConfig
  target: object
  weights: object
  run: Run
  compiled: object
  evaluator: evaluation.Evaluator
  session: object
  output_dir: str
  writer: bool

  @property
  def metrics_path(self) -> str:
    return os.path.join(self.output_dir, "metrics.jsonl")


def run_steps(loop: Loop, state, first: int):
  """Step from `first` to the end, logging every --log_every steps and
  saving as the session says; return the last state."""
  config, session = loop.config, loop.session
  window_start, window_steps = time.time(), 0
  skipped = int(jax.device_get(state.health.nonfinite_steps))
  for s in range(first, config.num_steps):
    run_records.profile_before_step(config, loop.output_dir, s)
    state, metrics = loop.compiled(state, loop.run.weights,
                                   loop.run.step_inputs(s))
    window_steps += 1
    done = s + 1
    if done % config.log_every == 0 or done == config.num_steps:
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
      skipped = check_nonfinite(session, state, metrics, skipped)
      step_time = (time.time() - window_start) / window_steps
      log_step(loop, state, metrics, done, step_time)
      window_start, window_steps = time.time(), 0
    run_records.profile_after_step(config, loop.output_dir, state, done)
    checkpointing.after_step(session, state, done)
  return state


def log_step(loop: Loop, state, metrics: dict, done: int,
             step_time: float) -> None:
  """Evaluate when due, append the step's record to metrics.jsonl, print
  its progress line and refresh the figures when due."""
  config = loop.config
  record = {"step": done, **metrics, "step_time_s": step_time}
  record.update(loop.evaluator.evaluate(
    state, done, lambda: checkpointing.stop_requested(loop.session)))
  if loop.writer:
    run_dir.append_metrics(loop.metrics_path, record)
    print(progress_line(done, config.num_steps, metrics, loop.target.sites,
                        1.0 / step_time), flush=True)
  if config.figures_every and done % config.figures_every == 0:
    host_state = transfer.fetch(state)  # collective: every process
    if loop.writer:
      write_figures(loop.output_dir, loop.target, loop.run.ci_fn,
                    loop.weights, host_state, loop.metrics_path)


def check_nonfinite(session, state, metrics: dict, skipped: int) -> int:
  """Stop a diverged run (Diverged) or, under --on_nonfinite=skip, say how
  many updates were dropped since the last look; return the count."""
  count = int(metrics["nonfinite/steps"])
  if count:
    checkpointing.check_finite(session, state)
  if count > skipped and placement_setup.is_writer():
    record = jax.device_get(state.health)
    print(f"[train] skipped {count - skipped} non-finite update(s); "
          f"{count} in all, the first at "
          f"{health.describe(record, session.part_names)}", flush=True)
  return count


def finish(config, target, ci_fn, ci_config, weights, state, output_dir,
           metrics_path):
  """Write the decomposition and figures, and print the recovery summary.

  `decomposition.npz` carries the site specs and the whole CI config, so
  `decomposition.load_npz` rebuilds and applies it from the file alone.
  """
  arrays = run_dir.flatten_tree(
    {"components": state.components, "ci_params": state.ci_params})
  meta = decomposition.decomposition_metadata(
    target.sites, ci_config, target=config.target,
    step=int(jax.device_get(state.step)))
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
    placement_config = placement_setup.config_from_flags()
    placement_setup.start(placement_config)
    placement = placement_setup.make_placement(placement_config,
                                               (config.batch_size,))
    toy, target, weights, output_dir = setup(config, placement)
  except ValueError as e:
    fail(str(e))
  except OSError as e:  # the disk filled or vanished under the setup
    fail(run_dir.write_refusal(e.filename or config.output_dir, e))
  try:
    train(config, toy, target, weights, output_dir, placement)
  except checkpoint.CheckpointError as e:
    fail(str(e))
  except checkpointing.Diverged as e:
    cli.fail("train", str(e), checkpointing.DIVERGED_EXIT_CODE)
  except OSError as e:  # metrics, figures or results; checkpoints are safe
    fail(run_dir.write_refusal(e.filename or output_dir, e))


def entry() -> None:
  """Launch the absl app (used by the `bin/train` launcher)."""
  cli.launch("train", main)


if __name__ == "__main__":
  entry()
