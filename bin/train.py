"""Decompose a toy target: `bin/train --flagfile=flags/<name>.flags`.

Without a flagfile it runs the library's defaults, the SPD paper's TMS 5-2
recipe as one run; `./dev train` without one runs `flags/tms_5-2.flags`,
that recipe with loss-chosen restarts, which recovers on every seed measured.
The run directory receives the resolved flags, the size and SHA-256 of the
files the run reads (`inputs.json`), `metrics.jsonl`, the trained target,
checkpoints, the final decomposition and PNG figures. The same command
resumes an interrupted run (on the same files: one since rewritten is
refused); SIGTERM/SIGINT save the completed step and exit with 75 for a
requeue (`checkpointing`).
"""

import contextlib
import os
import time
from typing import Any, NamedTuple

import jax
import numpy as np
from absl import flags, logging

from decompax.bin import checkpointing, cli, device_memory, figure_worker
from decompax.bin import placement_setup
from decompax.bin import restarts
from decompax.bin import run_records, tokens_text, train_flags, wandb_sink
from decompax.core import health, sites as sites_lib, slots
from decompax.io import checkpoint, decomposition, hf_checkpoint
from decompax.io import owned_dir, run_dir
from decompax.measures import probe
from decompax.placement import shardings, transfer
from decompax.render import figures
from decompax.recipe import (
  assembly, engine, evaluation, lm, streams, terms, token_data)
from decompax.recipe.config import (
  TrainConfig, held_out_seed, setting, steps_per_call)
from decompax.targets import registry

# Flags a launch may change without changing the run (flags.txt omits them).
RELAUNCH_FLAGS = ("overwrite", "on_nonfinite", "max_skipped_in_a_row",
                  "max_skipped_share", "stop_after_step", "wandb_project",
                  "steps_per_call")
# Flags that say where the run is, not what it is: flags.txt records this
# launch's value, and a run directory moved elsewhere resumes from there.
LOCATION_FLAGS = ("output_dir",)
# Flags naming a token file the run reads, whose bytes decide the run as
# much as its flags do (`input_identities`).
DATA_FLAGS = ("data_path", "eval_data_path", "target_data_path",
              "nontarget_data_path")


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

  with setting("target_seed"):
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


def format_rate(per_s: float) -> str:
  """Return a rate in whole units from 100 up and to three significant
  digits below, where a large model's few steps a second would round
  away (6.2, not 6)."""
  return f"{per_s:.0f}" if per_s >= 100 else f"{per_s:.3g}"


def progress_line(step, total, metrics, sites, steps_per_s,
                  targeted: bool = False, stop: int | None = None) -> str:
  """Return one terminal line: step, losses, CI-L0 (each stream's in a
  targeted run), speed and ETA, to the step where this launch `stop`s
  (default: `total`, the schedule's end)."""
  parts = [f"step {step}/{total}"]
  parts.extend(terms.console_losses(metrics, targeted))
  for prefix in ("target/", "nontarget/") if targeted else ("",):
    l0 = "/".join(f"{metrics[f'{prefix}ci_l0/{s.name}']:.2f}" for s in sites)
    parts.append(f"{prefix.rstrip('/')} L0 {l0}".lstrip())
  parts.append(f"{format_rate(steps_per_s)} it/s")
  stop = total if stop is None else stop
  eta = (stop - step) / max(steps_per_s, 1e-9)
  until = "" if stop == total else f" to step {stop}"
  parts.append(f"ETA {format_duration(eta)}{until}")
  return "  ".join(parts)


def host_state_of(state, sites):
  """Return the state fetched to the host, its V/U cut to their real
  shapes (the owner preset holds pad slots; no output shows them)."""
  state = transfer.fetch(state)  # collective: every process
  return state._replace(
    components=slots.real_components(state.components, sites))


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
  expected = target.expected or {}
  uv, order = {}, {}
  for site in target.sites:
    v, u = jax.device_get(sites_lib.site_factors(state.components, site))
    order[site.name] = evaluation.probe_column_order(
      ci[site.name], expected.get(site.name))
    columns = np.asarray(order[site.name])
    uv[site.name] = (np.asarray(v)[:, columns], np.asarray(u)[columns])
  evaluation.plot_probe_and_factors(fig_dir, ci, uv, order, target.expected)
  records = run_dir.read_metrics(metrics_path)
  if records:
    figures.plot_loss_curves(records, os.path.join(fig_dir, "losses.png"))
  return ci


class Prepared(NamedTuple):
  """A run checked and planned, its directory claimed (see `setup`):
  the plan, the host's frozen weights and where results go."""

  plan: assembly.Plan
  weights: Any
  output_dir: str
  placement: shardings.Placement | None = None
  # The writer's open lock on output_dir (None on other processes).
  lock: int | None = None

  @property
  def config(self) -> TrainConfig:
    return self.plan.parts.config

  @property
  def target(self):
    return self.plan.parts.target


def output_dir_of(config: TrainConfig, toy_name: str) -> str:
  """Return the run's directory: --output_dir, else `runs/<toy>`."""
  if config.output_dir is not None:
    return config.output_dir
  # The default location's parent is ours to create; a user's is not.
  os.makedirs("runs", exist_ok=True)
  return os.path.join("runs", toy_name)


def setup(config: TrainConfig, placement=None) -> Prepared:
  """Return the run planned (`assembly.parts`, `assembly.plan`) with its
  weights, after every check of user input and before its directory is
  written (with a placement: its `--place` layouts, `report_placement`).
  """
  toy, target, load = assembly.resolve_target(config)
  parts = assembly.parts(config, toy, target)
  output_dir = output_dir_of(config, toy.name)
  flags_text = resolved_flags_text()
  with output_dir_named():
    run_dir.check_run_dir(output_dir, flags_text, config.overwrite,
                          flag_defaults(), LOCATION_FLAGS)
  # The lock lasts as long as its descriptor, which nothing closes. An
  # existing run is locked before anything reads it; a new one only once
  # every check has passed, since locking creates the directory.
  writer, lock = placement_setup.is_writer(), None
  if writer and os.path.isdir(output_dir):
    with output_dir_named():
      lock = run_dir.lock_run_dir(output_dir)
  try:
    weights, save_cache, data, inputs = read_inputs(
      config, toy, target, parts, load, output_dir)
  except BaseException:
    if lock is not None:  # refused: a caller in this process may retry
      os.close(lock)
    raise
  if lm.is_lm(config) and not streams.is_targeted(config):
    print(token_data.describe(data))
  with placement_setup.flag_named():
    planned = assembly.plan(parts, weights, placement, data)
  if placement is not None:
    report_placement(planned, placement)
  if writer:
    with output_dir_named():
      if lock is None:
        lock = run_dir.lock_run_dir(output_dir)
      run_dir.prepare_run_dir(output_dir, flags_text, config.overwrite,
                              flag_defaults(), LOCATION_FLAGS)
    owned_dir.write_inputs(output_dir, inputs)
    save_cache()
  return Prepared(planned, weights, output_dir, placement, lock)


def read_inputs(config: TrainConfig, toy, target, parts, load,
                output_dir: str):
  """Return the run's frozen weights, `save_cache` (`frozen_weights`), its
  token data and the identity of the files it reads, after refusing a
  run there that has trained but cannot resume, or read other files."""
  checkpointing.check_entry(config, output_dir, target.sites,
                            parts.ci_config)
  weights, save_cache = frozen_weights(config, toy, target, load, output_dir)
  data = open_token_data(config, toy)
  inputs = input_identities(config)
  with output_dir_named():
    owned_dir.check_inputs(output_dir, inputs, config.overwrite)
  return weights, save_cache, data, inputs


def input_identities(config: TrainConfig) -> dict:
  """Return the identity (size and SHA-256, `owned_dir.file_identity`)
  of each file the run reads, keyed by the flag naming it: its token
  files, and a checkpoint LM's config and weights."""
  found = {flag: owned_dir.file_identity(getattr(config, flag))
           for flag in DATA_FLAGS if getattr(config, flag)}
  if lm.is_lm(config) and config.model_dir:
    weights = hf_checkpoint.tensor_files(config.model_dir).values()
    found["model_dir"] = owned_dir.files_identity(
      config.model_dir, ("config.json", *sorted(
        {os.path.basename(path) for path in weights})))
  return found


@contextlib.contextmanager
def output_dir_named():
  """Re-raise a run directory's refusal naming `--output_dir`, and
  `--overwrite` where it would replace the run there."""
  try:
    yield
  except run_dir.RunConflict as e:
    raise ValueError(f"--output_dir: {e} (--overwrite replaces it)") from None
  except ValueError as e:
    raise ValueError(f"--output_dir: {e}") from None


def write_refusal(path: str, error: OSError) -> str:
  """Return why `path` in the run directory could not be written, on one
  line naming `--output_dir`."""
  return f"--output_dir: {run_dir.write_refusal(path, error)}"


def frozen_weights(config: TrainConfig, toy, target, load, output_dir: str):
  """Return the target's frozen weights and `save_cache()`, which writes a
  toy target trained here to its cache (process 0, once the run directory
  is prepared)."""
  if load is not None:
    return load(), lambda: None
  target_path = config.target_path or os.path.join(output_dir, "target.npz")
  # --overwrite replaces the run, including a target cached inside it.
  use_cache = config.target_path is not None or not config.overwrite
  weights, cache = load_or_train_target(toy, config, target_path, use_cache)

  def save_cache():
    if not os.path.exists(target_path):
      run_dir.save_arrays(target_path, *cache)

  return registry.weights_for(toy, weights, target.sites), save_cache


def report_placement(planned: assembly.Plan,
                     placement: shardings.Placement) -> None:
  """Print where the preset's layouts keep what does not tile replicated
  (process 0; `--place` layouts that do not tile were refused by
  `assembly.plan`)."""
  if placement_setup.is_writer():
    for line in placement_setup.fallback_lines(
        planned.fallbacks, dict(placement.mesh.shape)):
      print(line)
    line = placement_setup.pad_line(planned.state.components,
                                    planned.parts.target.sites)
    if line:
      print(line)


def placement_batches(config: TrainConfig) -> tuple:
  """Return the batches `placement_setup.make_placement` checks against
  the mesh: `(lead shape,)`, or a targeted run's `(target lead shape,
  flag, ((flag, non-target lead shape),))`, each stream's batch split
  over it."""
  if not streams.is_targeted(config):
    return ((config.batch_size,),)
  target, nontarget = (
    (f"--{s}_batch_size", (streams.batch_size(config, s),))
    for s in (streams.TARGET, streams.NONTARGET))
  return target[1], target[0], (nontarget,)


def open_token_data(config, toy):
  """Return an LM run's token files, or a targeted run's streams' (None:
  batches sampled in the step)."""
  if streams.is_targeted(config):
    return streams.open_data(config, toy.token_model.vocab_size)
  if not lm.is_lm(config):
    return None
  return token_data.open_data(config, toy.token_model.vocab_size)


def train(prepared: Prepared, driven: bool = False):
  """Start the run (restored or warmed up), train with progress output,
  then write results.

  Every process runs this; only process 0 writes (`placement_setup`).
  `driven`: a driver (`--restarts`) stopped it and goes on by itself, so
  a stop tells nobody to rerun.
  """
  config, output_dir = prepared.config, prepared.output_dir
  parts, writer = prepared.plan.parts, placement_setup.is_writer()
  session = checkpointing.open_session(config, output_dir, parts.target.sites,
                                       parts.ci_config, parts.term_names)
  restore = checkpointing.restorer(session)
  if restore is None and config.faithfulness_warmup_steps:
    print(f"[warmup] {config.faithfulness_warmup_steps} faithfulness "
          "steps ...", flush=True)
  run = assembly.start(prepared.plan, prepared.weights, restore,
                       checkpointing.warmup_between(session))
  checkpointing.after_warmup(session, run.state)
  print_warmup(config, run.warmup_losses)
  print(f"[train] {parts.record.name}: sites "
        f"{', '.join(s.name for s in parts.target.sites)}; C={config.c}; "
        f"terms {', '.join(parts.term_names)}")
  first = int(jax.device_get(run.state.step))
  sink = wandb_sink.NO_SINK
  if writer:
    sink = wandb_sink.open_sink(flags.FLAGS.wandb_project, output_dir, config)
  per_call = steps_per_call(config)
  if per_call > 1:
    print(f"[train] up to {per_call} steps per call (--steps_per_call)")
  loop = Loop(config, parts.target, prepared.weights, run,
              compile_step(run, first, prepared.placement, per_call),
              evaluator_of(config, parts.target, run, output_dir), session,
              output_dir, writer, sink, per_call)
  if first == 0:  # fresh runs only (SPEC I44)
    evaluation.log_baseline(loop.evaluator, run.state, loop.metrics_path)
  # The loop reads the device only by explicit device_get at log and eval
  # steps, so no hidden host sync slips into the per-step path; the guard
  # makes an implicit read an error on an accelerator (CPU arrays are host
  # memory, so it never fires there). Setup (a toy target's training and
  # checks) and the final writing run before and after it, unguarded.
  with jax.transfer_guard_device_to_host("disallow"):
    state = run_steps(loop, run.state, first)
  checkpointing.close(session)
  loop.evaluator.close()
  if last_step(config) < config.num_steps:
    sink.close()
    if not driven:
      print(f"[train] stopped after step {max(first, last_step(config))} of "
            f"{config.num_steps} (--stop_after_step); rerun without it to "
            "continue")
    return
  checkpointing.check_finite(session, state, full=True)
  state = host_state_of(state, parts.target.sites)
  if writer:
    finish(config, parts.target, run.ci_fn, session.ci_config,
           prepared.weights, state, output_dir, loop.metrics_path)
    evaluation.write_final_report(output_dir, say)
    sink.close(os.path.join(output_dir, "figures"))


def prepare_selection(config: TrainConfig) -> tuple[str, int]:
  """Return the directory of a `--restarts` run, checked against a run
  already there (same flags: a resume) and holding its flags, and the open
  lock this process holds on it."""
  if jax.process_count() > 1:
    raise ValueError("--restarts runs its candidates in one process; launch "
                     "it without --num_processes")
  toy, _, _ = assembly.resolve_target(config)
  output_dir = output_dir_of(config, toy.name)
  flags_text = resolved_flags_text()
  with output_dir_named():
    run_dir.check_run_dir(output_dir, flags_text, config.overwrite,
                          flag_defaults(), LOCATION_FLAGS)
    if not config.overwrite:
      # A damaged choice is refused before the lock, not after candidates
      # have trained again.
      run_dir.read_choice(output_dir)
    lock = run_dir.lock_run_dir(output_dir)
    run_dir.prepare_run_dir(output_dir, flags_text, config.overwrite,
                            flag_defaults(), LOCATION_FLAGS)
  os.makedirs(os.path.join(output_dir, run_dir.CANDIDATES_DIR), exist_ok=True)
  return output_dir, lock


def run_candidate(config: TrainConfig, placement, output_dir: str,
                  index: int, stop_at: int) -> None:
  """Train (or resume) candidate `index`, to `stop_at` when nonzero."""
  with restarts.candidate_flags(config, output_dir, index, stop_at):
    candidate = train_flags.config_from_flags()
    try:
      prepared = setup(candidate, placement)
    except ValueError as e:
      raise restarts.SelectionError(
        f"restart candidate {index}: {e}") from None
    try:
      train(prepared, driven=True)
    finally:
      # This process opens the candidate again to continue it.
      if prepared.lock is not None:
        os.close(prepared.lock)


def select_candidate(config: TrainConfig, placement, output_dir: str) -> dict:
  """Return the recorded choice, first training each candidate to
  --select_at and choosing by held-out loss if none was made."""
  choice = run_dir.read_choice(output_dir)
  if choice is not None:
    return choice
  step, losses = config.select_at, {}
  for index in range(config.restarts):
    directory = run_dir.candidate_dir(output_dir, index)
    losses[index] = restarts.held_out_loss(directory, step)
    if losses[index] is None:
      print(f"[restarts] candidate {index} (seed "
            f"{restarts.candidate_seed(config.seed, index)}) to step {step} "
            f"in {directory}", flush=True)
      try:
        run_candidate(config, placement, output_dir, index, step)
      except checkpointing.Diverged as e:
        print(f"[restarts] candidate {index} left out: {e}", flush=True)
      losses[index] = restarts.held_out_loss(directory, step)
  chosen = restarts.choose(losses)
  choice = {"chosen": chosen, "seed": restarts.candidate_seed(config.seed,
                                                              chosen),
            "select_at": step, "metric": restarts.SELECTION_METRIC,
            "held_out_seed": held_out_seed(config),
            "losses": {str(j): loss for j, loss in losses.items()}}
  restarts.write_choice(output_dir, choice)
  shown = ", ".join("diverged" if loss is None else f"{loss:.4e}"
                    for loss in losses.values())
  print(f"[restarts] held-out losses at step {step}: {shown}; candidate "
        f"{chosen} continues", flush=True)
  return choice


def train_with_restarts(config: TrainConfig, placement,
                        output_dir: str) -> None:
  """Run a `--restarts` selection to the end (bin/restarts.py)."""
  chosen = select_candidate(config, placement, output_dir)["chosen"]
  run_candidate(config, placement, output_dir, chosen, 0)
  print(f"[restarts] the run is candidate {chosen}: "
        f"{run_dir.candidate_dir(output_dir, chosen)}")


def print_warmup(config, warmup_losses: jax.Array) -> None:
  """Print the faithfulness warmup's first and last loss, if it ran."""
  if warmup_losses.shape[0]:
    warm_first, warm_last = jax.device_get(warmup_losses)[[0, -1]]
    print(f"[warmup] {config.faithfulness_warmup_steps} faithfulness steps: "
          f"{warm_first:.3e} -> {warm_last:.3e}")


def compile_step(run: assembly.Run, first: int,
                 placement: shardings.Placement | None = None,
                 per_call: int = 1):
  """Return the run's step compiled for its state at step `first`: with
  `per_call` above 1, the call of any number of steps (`TrainStep.steps`),
  one program whatever each call's length."""
  compile_start = time.time()
  if per_call > 1:
    lowered = run.built.steps.lower(run.state, run.weights,
                                    run.step_inputs(first), np.int32(1))
  else:
    lowered = run.built.step.lower(run.state, run.weights,
                                   run.step_inputs(first))
  compiled = lowered.compile(placement.compiler_options if placement else None)
  print(f"[train] step compiled in {time.time() - compile_start:.1f}s")
  # A step that cannot be allocated may hang instead of failing: refuse it
  # before it runs.
  device_memory.check_fits(
    compiled, f"the step (--batch_size={run.plan.parts.config.batch_size})",
    "lower --batch_size (a targeted run: its streams' batch sizes), "
    "--seq_len or --c, or spread the batch over more devices")
  return compiled


def say(line: str) -> None:
  """Print a console line of the run at once."""
  print(line, flush=True)


def renderer_of(config: TrainConfig, draws: bool = True
                ) -> evaluation.Renderer:
  """Return the renderer of an evaluator's figures: process 0 draws them
  off the loop (`figure_worker`) where the evaluator `draws` any."""
  enabled = jax.process_index() == 0 and draws and bool(config.eval_every)
  return figure_worker.renderer(enabled, config.figure_cpu_share)


def evaluator_of(config: TrainConfig, target, run: assembly.Run,
                 output_dir: str) -> evaluation.Evaluator:
  """Return the run's in-loop evaluator (`evaluation.make_evaluator`); a
  targeted run's evaluates each stream on its own batches, figures and
  report from the target stream's."""
  parts = run.plan.parts
  if parts.targeted:
    dtype = engine.compute_dtype(config)
    return evaluation.combined((*(
      evaluation.make_evaluator(
        config, target, run.ci_fn,
        tuple(t for t in run.terms if t.stream == spec.name),
        parts.stream_inputs(spec.name), run.weights, output_dir,
        constrain=run.constrain, compute_dtype=dtype,
        eval_batches=run.stream_eval_batches(spec.name,
                                             config.eval_batches),
        renderer=renderer_of(config, spec.name == streams.TARGET), say=say,
        stream=spec)
      for spec in parts.step_config.streams),
      evaluation.make_task_evaluator(
        config, target, run.ci_fn, run.weights, output_dir, dtype,
        run.stream_eval_batches(streams.NONTARGET, config.eval_batches),
        say=say)))
  return evaluation.make_evaluator(
    config, target, run.ci_fn, run.terms, run.sample_inputs, run.weights,
    output_dir, constrain=run.constrain,
    eval_batches=run.eval_batches(config.eval_batches),
    compute_dtype=engine.compute_dtype(config),
    decode=(tokens_text.token_decoder(config.model_dir)
            if lm.is_lm(config) else None),
    renderer=renderer_of(config), say=say)


class Loop(NamedTuple):
  """What the training loop holds beside the state: the run, its compiled
  step and evaluator, the checkpoint session and where results go. `weights`
  are the host's frozen weights (figures); `writer`: this process writes."""

  config: TrainConfig
  target: object
  weights: object
  run: assembly.Run
  compiled: object
  evaluator: evaluation.Evaluator
  session: object
  output_dir: str
  writer: bool
  sink: wandb_sink.Sink = wandb_sink.NO_SINK
  # The most steps one call of `compiled` takes (1: the plain step).
  steps_per_call: int = 1

  @property
  def metrics_path(self) -> str:
    return os.path.join(self.output_dir, "metrics.jsonl")


def run_steps(loop: Loop, state, first: int):
  """Step from `first` to the end, logging every --log_every steps and
  saving as the session says; return the last state.

  Each call runs `call_length` steps, so every step the loop looks at
  (logs, saves, a profile edge, the end) ends a call, and the signal check
  runs after each call.
  """
  config, session = loop.config, loop.session
  window_start, window_steps = time.time(), 0
  skipped = int(jax.device_get(state.health.nonfinite_steps))
  s = first
  while s < last_step(config):
    n = call_length(config, s, loop.steps_per_call)
    run_records.profile_before_step(config, loop.output_dir, s)
    inputs = loop.run.step_inputs(s)
    state, metrics = call(loop, state, inputs, n)
    window_steps += n
    done = s + n
    if done % config.log_every == 0 or done == config.num_steps:
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
      skipped = check_nonfinite(session, state, metrics, skipped)
      step_time = (time.time() - window_start) / window_steps
      log_step(loop, state, metrics, done, step_time)
      window_start, window_steps = time.time(), 0
    run_records.profile_after_step(config, loop.output_dir, state, done)
    checkpointing.after_step(session, state, done, n)
    s = done
  return state


def call(loop: Loop, state, inputs, n: int):
  """Return the state and the last step's metrics after `n` steps on
  `inputs` (the first step's batch, or the data key the steps draw from):
  one call of the compiled step or steps."""
  if loop.steps_per_call == 1:
    return loop.compiled(state, loop.run.weights, inputs)
  return loop.compiled(state, loop.run.weights, inputs, np.int32(n))


def call_length(config: TrainConfig, s: int, per_call: int) -> int:
  """Return how many steps the call after `s` completed ones takes: up to
  `per_call`, ending at the first step the loop looks at (`looked_at`) or
  at the launch's last step."""
  end = min(s + per_call, last_step(config))
  return next(done for done in range(s + 1, end + 1)
              if done == end or looked_at(config, done)) - s


def looked_at(config: TrainConfig, done: int) -> bool:
  """Return whether the loop acts after `done` steps: it logs (evals and
  figure refreshes come only at log steps), saves, or starts or stops the
  profile."""
  window = run_records.parse_profile_steps(config.profile_steps,
                                           config.num_steps)
  return (done % config.log_every == 0
          or (config.checkpointing == "periodic"
              and done % config.save_every == 0)
          or (window is not None and done in window))


def last_step(config: TrainConfig) -> int:
  """Return the step this launch trains up to."""
  return config.stop_after_step or config.num_steps


def log_step(loop: Loop, state, metrics: dict, done: int,
             step_time: float) -> None:
  """Evaluate when due, append the step's record to metrics.jsonl, print
  its progress line and refresh the figures when due."""
  config = loop.config
  record = {"step": done, **metrics, "step_time_s": step_time}
  scalars = loop.evaluator.evaluate(
    state, done, lambda: checkpointing.stop_requested(loop.session))
  checkpointing.check_final_eval(loop.session, state, scalars, done)
  record.update(scalars)
  if loop.writer:
    run_dir.append_metrics(loop.metrics_path, record)
    loop.sink.sync()
    print(progress_line(done, config.num_steps, metrics, loop.target.sites,
                        1.0 / step_time, streams.is_targeted(config),
                        last_step(config)), flush=True)
  if config.figures_every and done % config.figures_every == 0:
    host_state = host_state_of(state, loop.target.sites)
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
  if ci:
    for line in evaluation.recovery_lines(ci, target, weights,
                                          state.components):
      print(line)
  print(f"[train] wrote {path} and {os.path.join(output_dir, 'figures')}/")


def main(argv: list[str]) -> None:
  # JAX reports each accelerator backend it fails to find at INFO level.
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; flags (and flagfile lines) take "
         "the form --name=value")
  try:
    config = train_flags.config_from_flags()
    if flags.FLAGS.wandb_project:
      wandb_sink.check_installed()
    placement_config = placement_setup.config_from_flags()
    placement_setup.start(placement_config)
    placement = placement_setup.make_placement(
      placement_config, *placement_batches(config))
    if config.restarts > 1:
      selection_dir, _ = prepare_selection(config)
    else:
      prepared = setup(config, placement)
  except (ValueError, ImportError) as e:
    fail(str(e))
  except OSError as e:  # the disk filled or vanished under the setup
    fail(write_refusal(e.filename or config.output_dir, e))
  try:
    if config.restarts > 1:
      train_with_restarts(config, placement, selection_dir)
    else:
      train(prepared)
  except restarts.SelectionError as e:
    fail(str(e))
  except checkpoint.CheckpointError as e:
    fail(str(e))
  except checkpointing.Diverged as e:
    cli.fail("train", str(e), checkpointing.DIVERGED_EXIT_CODE)
  except device_memory.DoesNotFit as e:
    fail(str(e))
  except jax.errors.JaxRuntimeError as e:
    # An allocation that fails where XLA does report it (accelerators).
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    fail(f"out of memory ({' '.join(str(e).split())[:300]}); lower "
         "--batch_size, --seq_len or --c")
  except OSError as e:  # metrics, figures or results; checkpoints are safe
    fail(write_refusal(e.filename or prepared.output_dir, e))


def entry() -> None:
  """Launch the absl app (used by the `bin/train` launcher)."""
  cli.launch("train", main, train_flags.help_groups())


if __name__ == "__main__":
  entry()
