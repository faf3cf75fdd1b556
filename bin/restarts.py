"""`bin/train --restarts=K --select_at=R`: several candidate runs, one kept.

A decomposition can settle in a local optimum where one rank-1 component
serves several features (docs/recovery.md). Such a run ends with a higher
training loss than the recovering ones, so a selection by the loss alone
can avoid it without reading any recovery metric. Candidate `j` is a whole
run of the same flags with seed `seed + 1000·j`, in
`<output_dir>/candidates/r<j>`, trained to step `R`; every candidate is
evaluated on the held-out batches of one seed (`--eval_seed`, default
`--seed`), and the one with the lowest held-out total loss at `R` continues
to `--num_steps` in its own directory. `<output_dir>` holds the flags of the
whole selection, `restarts.json` (the losses and the choice, written once)
and the candidates.

Each phase is an ordinary run, with its own checkpoints, so rerunning the
command resumes wherever it stopped: finished candidates are read, not
rerun, and a recorded choice is kept.
"""

import contextlib
import json
import os

from absl import flags

from decompax.io import run_dir
from decompax.recipe.config import TrainConfig, candidate_seed, held_out_seed
# What the candidates are compared on: the held-out total loss.
SELECTION_METRIC = "eval/loss/total"


def held_out_loss(directory: str, step: int) -> float | None:
  """Return the run's held-out total loss logged at `step`, None if it has
  none (not there yet)."""
  return run_dir.metric_at(directory, step, SELECTION_METRIC)


class SelectionError(ValueError):
  """The selection cannot go on: a candidate's setup refused its input, or
  every candidate diverged."""


def choose(losses: dict[int, float | None]) -> int:
  """Return the candidate with the lowest loss (the first among equals);
  None marks a candidate that diverged, never chosen. Raise SelectionError
  if every one did."""
  finite = sorted(j for j, loss in losses.items() if loss is not None)
  if not finite:
    raise SelectionError(f"all {len(losses)} restart candidates diverged "
                         "before the selection step; see their logs")
  return min(finite, key=lambda j: losses[j])


@contextlib.contextmanager
def candidate_flags(config: TrainConfig, output_dir: str, index: int,
                    stop_at: int):
  """Set the flags of candidate `index` (its seed, directory and shared eval
  seed; one run, stopped at `stop_at` when nonzero) for the body, which
  builds its config and `flags.txt` from them; restore them after."""
  values = {"seed": candidate_seed(config.seed, index),
            "eval_seed": held_out_seed(config),
            "output_dir": run_dir.candidate_dir(output_dir, index),
            "restarts": 1, "select_at": 0, "stop_after_step": stop_at,
            "overwrite": False}
  before = {name: flags.FLAGS[name].value for name in values}
  try:
    for name, value in values.items():
      flags.FLAGS[name].value = value
    yield
  finally:
    for name, value in before.items():
      flags.FLAGS[name].value = value


def write_choice(output_dir: str, choice: dict) -> None:
  """Record the choice atomically: a crash leaves it whole or absent."""
  text = json.dumps(choice, indent=1) + "\n"
  run_dir.atomic_write(os.path.join(output_dir, run_dir.CHOICE_FILE),
                       lambda f: f.write(text.encode("utf-8")))
