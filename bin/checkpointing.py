"""Checkpoint policy of `bin/train`: resume, saves, preemption (SPEC §12).

With `--checkpointing=periodic` a run saves label 0 after its warmup (or
fine-tune init), every `--save_every` steps, at the end, and when SIGTERM or
SIGINT arrives: the signal only sets a flag, serviced at the next step
boundary by saving the completed step and exiting with `REQUEUE_EXIT_CODE`
(75, EX_TEMPFAIL). A signal during setup or the faithfulness warmup exits
with the same code without saving (I40): the warmup looks for it between
chunks of steps about half a second long (`warmup_between`). Rerunning the
same command restores the newest readable checkpoint, skips the warmup and
continues on the same trajectory: the step draws its batch and keys from
`(seed, step)` (I36).

A checkpoint written while term states were stored by position
(`term_states/<j>/...`) resumes, its arrays read under the terms' names.

`--checkpointing=none` writes nothing under `checkpoints/` and leaves a
marker that refuses re-entry (I39). `--init_from` restores only a parent's
decomposition onto a fresh run after checking that it matches (I38).

Tests inject faults through the environment variable `DECOMPAX_FAULT`:
`sigterm_before_warmup`, `sigterm_after_step=K` (the process signals itself
after the call that takes step K),
and SIGKILLs around the save of label K: `kill_mid_save=K` (after its first
item is written), `kill_after_save=K` (committed, nothing pruned yet) and
`kill_mid_prune=K` (an old step hidden for deletion, not yet deleted).
"""

import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from decompax.core import ci_fns, health, sites as sites_lib, slots, warmup
from decompax.io import checkpoint, decomposition, resume, run_dir
from decompax.bin import run_records
from decompax.recipe.checks import parse_init_from

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again", what schedulers requeue
# A diverged run: rerunning the same command would diverge again, so this
# is not a requeue.
DIVERGED_EXIT_CODE = 3
NONE_MARKER = "NO_CHECKPOINTS"
FAULT_ENV = "DECOMPAX_FAULT"
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Session(NamedTuple):
  """One launch of a run as far as checkpoints are concerned."""

  config: Any
  output_dir: str
  directory: str
  mode: str  # "fresh", "resume" or "init_from"
  sites: tuple[sites_lib.SiteSpec, ...]
  ci_config: ci_fns.CIConfig
  stop: threading.Event
  handlers: dict
  # What `Health.first_part` indexes (`health.part_names` of the terms).
  part_names: tuple[str, ...] = ()


class Diverged(Exception):
  """The run took a non-finite step; the message is one line."""


_state_finite = jax.jit(health.all_finite)


def _newest_good(session: Session) -> str:
  if session.config.checkpointing == "none":
    return "none (--checkpointing=none)"
  step = checkpoint.latest_step(session.directory)
  if step is None:
    return "none"
  return checkpoint.step_path(session.directory, step)


def divergence(session: Session, state, full: bool = False) -> str | None:
  """Return why `state` must not be saved or trained on, or None.

  Under `--on_nonfinite=stop` any recorded non-finite step counts; under
  skip those updates were dropped and the state stays usable until
  `--max_skipped_in_a_row` of them come in a row. With `full` (before a
  save) every state leaf is checked as well, which also catches a warmup
  that diverged.
  """
  config = session.config
  record = jax.device_get(state.health)
  first = health.describe(record, session.part_names)

  def newest():  # only once a reason is found: it lists the checkpoints
    return f"newest good checkpoint: {_newest_good(session)}"

  if config.on_nonfinite == "stop" and record.nonfinite_steps > 0:
    return (f"diverged at {first}; nothing saved from it; "
            f"{newest()}; lower --lr, or rerun with --on_nonfinite=skip to "
            "drop such updates")
  if (config.on_nonfinite == "skip"
      and record.streak >= config.max_skipped_in_a_row):
    return (f"diverged: {int(record.streak)} updates in a row were not "
            f"finite (the run's first: {first}); {newest()}; lower --lr or "
            "raise --max_skipped_in_a_row")
  skipped = int(record.nonfinite_steps)
  if (config.on_nonfinite == "skip"
      and skipped > config.max_skipped_share * config.num_steps):
    return (f"diverged: {skipped} updates were not finite and skipped, "
            f"more than --max_skipped_share={config.max_skipped_share:g} of "
            f"the {config.num_steps} steps (the run's first: {first}); "
            f"{newest()}; lower --lr or raise --max_skipped_share")
  if full and not bool(jax.device_get(_state_finite(state))):
    return (f"diverged: the state of step {int(jax.device_get(state.step))}"
            f" is not finite; nothing saved from it; {newest()}; lower --lr "
            "and --faithfulness_warmup_lr")
  return None


def check_finite(session: Session, state, full: bool = False) -> None:
  """Raise Diverged when `divergence` finds a reason."""
  reason = divergence(session, state, full)
  if reason is not None:
    raise Diverged(reason)


def check_final_eval(session: Session, state, scalars: dict,
                     done: int) -> None:
  """Raise Diverged when the run's last eval (step --num_steps) holds a
  non-finite value: what the run would report as its result is garbage,
  even if every update stayed finite or was skipped. Nothing of that step
  is logged or saved."""
  config = session.config
  if done != config.num_steps:
    return
  bad = [k for k, v in scalars.items()
         if isinstance(v, float) and not math.isfinite(v)]
  if not bad:
    return
  more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
  skipped = int(jax.device_get(state.health.nonfinite_steps))
  dropped = (f"; {skipped} of its {done} updates were skipped as "
             "non-finite" if skipped else "")
  raise Diverged(
    f"diverged: the final eval (step {done}) is not finite ({bad[0]} = "
    f"{scalars[bad[0]]}{more}){dropped}; nothing saved from it; newest "
    f"good checkpoint: {_newest_good(session)}; lower --lr")


def _writer() -> bool:
  # Process 0 alone writes run files; io.checkpoint coordinates the shards.
  return jax.process_index() == 0


def _say(message: str) -> None:
  if _writer():
    print(f"[checkpoint] {message}", flush=True)


def checkpoint_dir(output_dir: str) -> str:
  """Return where a run directory keeps its checkpoints."""
  return os.path.join(output_dir, checkpoint.CHECKPOINT_DIR)


def _fault(name: str) -> int | None:
  """Return the step of fault `name` in DECOMPAX_FAULT (-1: no step)."""
  for part in os.environ.get(FAULT_ENV, "").split(","):
    key, _, value = part.partition("=")
    if key == name:
      return int(value) if value else -1
  return None


def parent_step_dir(text: str) -> str:
  """Return the step directory `--init_from` names; ValueError if unusable."""
  parent, step = parse_init_from(text)
  directory = checkpoint_dir(parent)
  if not os.path.isdir(directory):
    directory = parent  # a checkpoint directory named directly
  if step is None:
    step = checkpoint.latest_step(directory)
    if step is None:
      raise ValueError(f"--init_from {text}: no checkpoint in {directory}")
  path = checkpoint.step_path(directory, step)
  if not os.path.isdir(path):
    have = checkpoint.committed_steps(directory)
    raise ValueError(f"--init_from {text}: no checkpoint of step {step} in "
                     f"{directory} (it has {have or 'none'})")
  checkpoint.read_index(path)
  return path


def _earlier_run(output_dir: str) -> str | None:
  """Return what shows that a run already trained in `output_dir` (records
  or results, which a fresh start would discard), or None."""
  if os.path.exists(os.path.join(output_dir, "decomposition.npz")):
    return "its decomposition.npz"
  records = run_dir.read_metrics(
    os.path.join(output_dir, run_dir.METRICS_FILE))
  if records:
    return (f"{run_dir.METRICS_FILE} records up to step "
            f"{max(r.get('step', 0) for r in records)}")
  return None


def check_entry(config, output_dir: str, sites, ci_config) -> None:
  """Raise ValueError, writing nothing, unless this launch may proceed.

  Refuses re-entering a `--checkpointing=none` run, resuming a finished
  run, starting afresh over a run that has trained but whose checkpoints
  are gone (its records would be lost without a word), and an
  `--init_from` parent that is missing or structurally different.
  """
  if config.overwrite:
    latest = None
  else:
    if os.path.exists(os.path.join(output_dir, NONE_MARKER)):
      raise ValueError(
        f"output dir {output_dir} holds a --checkpointing=none run, which "
        "cannot be re-entered; pass --overwrite or choose another "
        "--output_dir")
    latest = checkpoint.latest_step(checkpoint_dir(output_dir))
    earlier = None if latest is not None else _earlier_run(output_dir)
    if earlier is not None:
      raise ValueError(
        f"output dir {output_dir} holds a run that has trained ({earlier}) "
        "but no checkpoint to resume it from; pass --overwrite to train it "
        "again from step 0, or choose another --output_dir")
  # A run killed between its final save and its final records resumes into
  # the finish alone.
  finished = os.path.exists(os.path.join(output_dir, "decomposition.npz"))
  if latest is not None and latest >= config.num_steps and finished:
    raise ValueError(
      f"output dir {output_dir} already holds the finished run (step "
      f"{latest} of {config.num_steps}); pass --overwrite to redo it or "
      "choose another --output_dir")
  if config.init_from and latest is None:
    path = parent_step_dir(config.init_from)
    mismatch = resume.structure_mismatch(
      checkpoint.item_metadata(path, checkpoint.DECOMPOSITION), sites,
      ci_config)
    if mismatch:
      raise ValueError(f"--init_from {config.init_from}: {mismatch}; sites, "
                       "C and the CI function must match the parent's")


def _install_handlers(stop: threading.Event) -> dict:
  def handle(signum, frame):
    del frame
    if stop.is_set() and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C stops at once
    stop.set()

  return {s: signal.signal(s, handle) for s in _SIGNALS}


def open_session(config, output_dir: str, sites, ci_config,
                 term_names: tuple[str, ...] = ()) -> Session:
  """Start checkpointing for this launch and record it in the run dir;
  `term_names` (the run's loss terms in order) name a non-finite step's
  first bad part."""
  directory = checkpoint_dir(output_dir)
  if config.checkpointing == "none":
    if _writer():
      run_dir.atomic_write(os.path.join(output_dir, NONE_MARKER),
                           lambda f: f.write(b"--checkpointing=none\n"))
    mode = "fresh"
  else:
    for name in checkpoint.remove_partial(directory):
      _say(f"removed {name}, left by an interrupted save")
    mode = ("resume" if checkpoint.committed_steps(directory)
            else "init_from" if config.init_from else "fresh")
  if _writer():
    run_records.record_launch(output_dir, mode)
  stop = threading.Event()
  session = Session(config, output_dir, directory, mode, sites, ci_config,
                    stop, _install_handlers(stop),
                    health.part_names(term_names))
  if _fault("sigterm_before_warmup") is not None:
    os.kill(os.getpid(), signal.SIGTERM)
  return session


def close(session: Session) -> None:
  """Give the signals back to their previous handlers."""
  for signum, handler in session.handlers.items():
    signal.signal(signum, handler)


def _restore_own(session: Session, template, term_names: tuple[str, ...],
                 shardings):
  step, state = resume.restore_state(
    session.directory, template, session.sites, session.ci_config,
    term_names, shardings, _say)
  _say(f"resumed from step {step} "
       f"({checkpoint.step_path(session.directory, step)})")
  return step, state


def _restore_parent(session: Session, template, reinit, shardings):
  path = parent_step_dir(session.config.init_from)
  item = resume.restore_decomposition(path, template, shardings,
                                      session.sites)
  _say(f"fine-tuning from the decomposition of {path}")
  return 0, reinit(item["components"], item["ci_params"])


def restorer(session: Session) -> Callable | None:
  """Return `restore(template, reinit, shardings, term_names) -> state` for
  `assembly.start`, or None.

  None means a fresh run (warmup, then label 0). `reinit(components,
  ci_params)` builds a fresh state around a restored decomposition;
  `term_names` are the run's loss terms in order (they read a checkpoint
  that stored term states by position).
  `shardings` (a state of `NamedSharding`s, or None: the template's own
  devices) is where each leaf is read to, shard by shard, so a placed run
  never holds a whole copy of its state on one device.
  """
  if session.mode == "fresh":
    _truncate_metrics(session, 0)
    return None

  def restore(template, reinit, shardings=None, term_names=()):
    if session.mode == "resume":
      step, state = _restore_own(session, template, term_names, shardings)
    else:
      step, state = _restore_parent(session, template, reinit, shardings)
    _truncate_metrics(session, step)
    return state

  return restore


def _truncate_metrics(session: Session, step: int) -> None:
  # The loop logs a step-0 baseline whenever it starts at step 0, so a
  # resume from label 0 drops the old one rather than duplicating it.
  if _writer():
    run_dir.truncate_metrics(
      os.path.join(session.output_dir, run_dir.METRICS_FILE),
      step if step > 0 else -1)


def _exit_for_requeue(session: Session, message: str) -> None:
  _say(message)
  close(session)
  sys.exit(REQUEUE_EXIT_CODE)


def stop_requested(session: Session) -> bool:
  """Return whether a stop signal is pending (agreed across processes).

  An eval pass may poll this to abandon itself before the step boundary.
  """
  if jax.process_count() == 1:
    return session.stop.is_set()
  from jax.experimental import multihost_utils
  # bin/train disallows implicit device-to-host copies; this one is meant.
  with jax.transfer_guard("allow"):
    flags = multihost_utils.process_allgather(np.array(session.stop.is_set()))
  return bool(np.any(flags))


def _agreed(session: Session, seconds: float) -> tuple[bool, float]:
  """Return whether a stop is pending and the longest of the processes'
  `seconds`, the same on every process (a collective when there are
  several), so each takes the same next step."""
  if jax.process_count() == 1:
    return session.stop.is_set(), seconds
  from jax.experimental import multihost_utils
  with jax.transfer_guard("allow"):
    rows = multihost_utils.process_allgather(
      np.array([float(session.stop.is_set()), seconds]))
  return bool(np.any(rows[:, 0])), float(np.max(rows[:, 1]))


def warmup_between(session: Session) -> warmup.Between:
  """Return the look between chunks of a fresh run's faithfulness warmup
  (`core.warmup`): on a stop signal it exits for a requeue at that step
  boundary. Nothing is saved: a warmup cut short is no run's step 0, and
  the rerun starts it over (I40)."""
  total, last = session.config.faithfulness_warmup_steps, [0]

  def between(done: int, seconds: float) -> int:
    length, last[0] = done - last[0], done
    stop, seconds = _agreed(session, seconds)
    if stop:
      _exit_for_requeue(
        session, f"stop signal during the faithfulness warmup, after {done} "
        f"of its {total} steps: nothing saved, the rerun warms up from the "
        f"start (exit {REQUEUE_EXIT_CODE})")
    return warmup.next_chunk(length, seconds)

  return between


def after_warmup(session: Session, state) -> None:
  """Exit unsaved if a signal came during setup; else save label 0 if new."""
  if stop_requested(session):
    _exit_for_requeue(session, "stop signal during setup or warmup: exiting "
                      f"without saving (exit {REQUEUE_EXIT_CODE})")
  if session.mode != "resume" and session.config.checkpointing == "periodic":
    save(session, state)


def after_step(session: Session, state, done: int, steps: int = 1) -> None:
  """Save when due; on a stop signal save and exit for a requeue. `done`
  ends a call of `steps` steps (the loop's `--steps_per_call`).

  A signal at the last step only lets the run finish normally.
  """
  fault = _fault("sigterm_after_step")
  if fault is not None and done - steps < fault <= done:
    os.kill(os.getpid(), signal.SIGTERM)
  config = session.config
  periodic = config.checkpointing == "periodic"
  final = done == config.num_steps
  stop = not final and stop_requested(session)
  if periodic and (stop or final or done % config.save_every == 0):
    save(session, state)
  if stop:
    what = "saved" if periodic else "not saved (--checkpointing=none)"
    _exit_for_requeue(session, f"stop signal: step {done} {what}; exiting "
                      f"with {REQUEUE_EXIT_CODE} for a requeue")


def _killer(fault: str, step: int) -> Callable[..., None] | None:
  """Return a callback that SIGKILLs this process when DECOMPAX_FAULT names
  `fault` at `step`, else None."""
  if _fault(fault) != step:
    return None

  def kill(*args):
    del args
    os.kill(os.getpid(), signal.SIGKILL)

  return kill


def save(session: Session, state) -> str:
  """Write `state` as its step's checkpoint and prune old ones.

  Raises Diverged, writing and pruning nothing, for a non-finite state.
  """
  check_finite(session, state, full=True)
  config = session.config
  step = int(jax.device_get(state.step))
  metadata = {
    checkpoint.DECOMPOSITION: decomposition.decomposition_metadata(
      session.sites, session.ci_config, target=config.target,
      config=decomposition.to_json(config)),
    checkpoint.TRAINING: {"step": step},
  }
  path = checkpoint.save(session.directory, step,
                         checkpoint.split_state(state), metadata,
                         after_item=_killer("kill_mid_save", step),
                         real_shape=slots.real_shape_of(session.sites))
  if (kill := _killer("kill_after_save", step)) is not None:
    kill()
  if not config.keep_all:
    checkpoint.prune(session.directory, config.keep_last,
                     protect=(config.num_steps,),
                     after_hide=_killer("kill_mid_prune", step))
  _say(f"saved step {step}")
  return path
