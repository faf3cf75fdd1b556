"""Weights & Biases logging of a run (`bin/train --wandb_project=NAME`).

The sink logs exactly what `metrics.jsonl` holds: each `sync()` reads the
records appended since the last one and logs their numeric values at their
steps, so the two never disagree. The run's settings are the W&B config;
the end of the run adds its figures. `wandb.json` in the run directory
keeps the W&B run id and the last step logged, so a resumed run continues
the same W&B run without logging a step twice. `WANDB_MODE=offline` writes
everything under the run directory without a network (`wandb sync` uploads
it later). Needs the `decompax[wandb]` extra; process 0 logs.
"""

import dataclasses
import glob
import json
import os
from typing import Any, NamedTuple, Optional

from decompax.io import run_dir

STATE_FILE = "wandb.json"


class Sink(NamedTuple):
  """`sync()` logs the new metrics records; `close(figures_dir)` logs the
  figures and ends the W&B run."""

  sync: Any
  close: Any


NO_SINK = Sink(lambda: None, lambda figures_dir=None: None)


def check_installed() -> None:
  """Raise ImportError naming the extra when wandb is missing."""
  try:
    import wandb  # noqa: F401, PLC0415
  except ImportError:
    raise ImportError("--wandb_project needs the wandb package: pip install "
                      "'decompax[wandb]'") from None


def _read_state(path: str) -> dict:
  if os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  return {}


def _write_state(path: str, state: dict) -> None:
  run_dir.atomic_write(path, lambda f: f.write(json.dumps(state).encode()))


def open_sink(project: str, output_dir: str, config: Any,
              name: Optional[str] = None) -> Sink:
  """Return the sink of a run in `output_dir` logging to W&B `project`
  (NO_SINK for an empty project)."""
  if not project:
    return NO_SINK
  import wandb  # noqa: PLC0415 (optional extra)
  state_path = os.path.join(output_dir, STATE_FILE)
  state = _read_state(state_path)
  run = wandb.init(
    project=project, name=name or os.path.basename(os.path.normpath(
      output_dir)), dir=output_dir, id=state.get("id"), resume="allow",
    # The console stays the process's own: W&B logs what metrics.jsonl
    # holds, and a wrapped stdout would outlive the run in a test process.
    settings=wandb.Settings(console="off"),
    config=dataclasses.asdict(config) if dataclasses.is_dataclass(config)
    else dict(config))
  state = {"id": run.id, "step": state.get("step", -1)}
  _write_state(state_path, state)
  metrics_path = os.path.join(output_dir, run_dir.METRICS_FILE)

  def sync() -> None:
    if not os.path.isfile(metrics_path):
      return
    last = state["step"]
    for record in run_dir.read_metrics(metrics_path):
      step = int(record["step"])
      if step > state["step"]:
        run.log(run_dir.scalar_values(record), step=step)
        last = step
    if last != state["step"]:
      state["step"] = last
      _write_state(state_path, state)

  def close(figures_dir: Optional[str] = None) -> None:
    sync()
    if figures_dir and os.path.isdir(figures_dir):
      images = {f"figures/{os.path.splitext(os.path.basename(p))[0]}":
                wandb.Image(p)
                for p in sorted(glob.glob(os.path.join(figures_dir, "*.png")))}
      if images:
        run.log(images, step=max(state["step"], 0))
    run.finish()

  return Sink(sync, close)
