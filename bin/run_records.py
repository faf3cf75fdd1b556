"""Run records beside the resolved flags, and the optional profiler window.

`run_info.json` in the run directory lists every launch of the run (a fresh
start and each resume): when, how, on which devices, with which library
versions and git revision of decompax. `--profile_steps=START:END` writes an
in-process `jax.profiler` trace of that step window to `<run>/profile`.
"""

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys

import jax

from decompax.analysis import explore
from decompax.bin import placement_flags
from decompax.io import checkpoint, run_dir
from decompax.recipe.checks import parse_profile_steps
from decompax.recipe.config import TrainConfig

RUN_INFO_FILE = "run_info.json"
PROFILE_DIR = "profile"
LIBRARIES = ("decompax", "jax", "jaxlib", "optax", "chex", "numpy",
             "tensorstore", "ml_dtypes", "absl-py", "jaxtyping")


def library_versions() -> dict[str, str | None]:
  """Return the installed version of each library a run depends on."""
  versions: dict[str, str | None] = {"python": platform.python_version()}
  for name in LIBRARIES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return versions


def git_revision() -> dict[str, str | bool | None]:
  """Return the commit of the decompax checkout and whether it has edits."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def git(*args):
    try:
      done = subprocess.run(["git", "-C", root, *args], capture_output=True,
                            text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
      return None
    return done.stdout.strip()

  revision = git("rev-parse", "HEAD")
  status = git("status", "--porcelain", "--untracked-files=no")
  return {"revision": revision,
          "dirty": None if status is None else bool(status)}


def launch_record(mode: str) -> dict:
  """Return what describes this launch of the run."""
  devices = jax.devices()
  return {
    "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"),
    "mode": mode,
    "argv": sys.argv,
    "host": platform.node(),
    "devices": f"{len(devices)} x {devices[0].device_kind}",
    "processes": jax.process_count(),
    "versions": library_versions(),
    "git": git_revision(),
  }


def record_launch(output_dir: str, mode: str) -> None:
  """Append this launch to `<output_dir>/run_info.json` (atomically).

  Raises CheckpointError naming the file when the disk refuses the write:
  `bin/train` reports that on one line once training has begun.
  """
  path = os.path.join(output_dir, RUN_INFO_FILE)
  launches = []
  if os.path.exists(path):
    try:
      with open(path, encoding="utf-8") as f:
        launches = list(json.load(f).get("launches", []))
    except (OSError, ValueError, AttributeError):
      launches = []  # an unreadable record is replaced, never fatal
  launches.append(launch_record(mode))
  text = json.dumps({"launches": launches}, indent=1)
  try:
    run_dir.atomic_write(path, lambda f: f.write(text.encode("utf-8")))
  except OSError as e:
    raise checkpoint.CheckpointError(
      f"--output_dir: {run_dir.write_refusal(path, e)}") from None


def profile_before_step(config, output_dir: str, index: int) -> None:
  """Start the trace when step `index` (0-based) opens the window."""
  window = parse_profile_steps(config.profile_steps, config.num_steps)
  if window is not None and index == window[0]:
    jax.profiler.start_trace(os.path.join(output_dir, PROFILE_DIR))


def profile_after_step(config, output_dir: str, state, done: int) -> None:
  """Stop the trace once `done` steps close the window."""
  window = parse_profile_steps(config.profile_steps, config.num_steps)
  if window is None or done != window[1]:
    return
  jax.block_until_ready(state)
  try:
    jax.profiler.stop_trace()
  except RuntimeError:
    return  # resumed inside the window: no trace was started
    print(f"[profile] steps {window[0]}..{window[1] - 1} traced into "
          f"{os.path.join(output_dir, PROFILE_DIR)}/", flush=True)


# The flags a run's flags.txt may set: its settings and bin/train's
# scale-out flags (tests/bin/test_run_records.py holds this to the list
# bin/train records).
RECORDED_FLAGS = frozenset(
  {f.name for f in dataclasses.fields(TrainConfig)}
  | set(placement_flags.NAMES))


def check_flags_file(path: str) -> list[str]:
  """Raise ValueError where the run's flags.txt does not read back as
  bin/train wrote it: a line that is no `--name=value`, or a setting whose
  value its flag refuses, or only names that bin/train records no flag of.
  Return the names it sets that bin/train records no flag of (a flag since
  removed, or a damaged line)."""
  flags_path = os.path.join(path, run_dir.FLAGS_FILE)
  if not os.path.isfile(flags_path):
    return []   # no run: said by whoever opens it as one
  with open(flags_path, encoding="utf-8", errors="replace") as f:
    lines = [line.strip() for line in f]
  for number, line in enumerate(lines, 1):
    if line and not (line.startswith("--") and "=" in line):
      raise ValueError(f"line {number}, {line[:80]!r}, is not --name=value")
  explore.run_config(path)
  names = [line[2:].partition("=")[0] for line in lines if line]
  unknown = [name for name in names if name not in RECORDED_FLAGS]
  if unknown and len(unknown) == len(names):
    raise ValueError(f"it sets no flag of bin/train, only "
                     f"{', '.join('--' + n for n in unknown)}")
  return unknown
