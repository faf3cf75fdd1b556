"""Recovery of the toys' known mechanisms over a grid of flagfiles and seeds.

Run: `./dev bench recovery --grid=tms_5-2:0-4,resid_mlp1:0-2 --jobs=2`.
Each (flagfile, seed) cell is a whole training run of `bin/train` in its own
process, written to `<out_dir>/<variant>/<flagfile>_s<seed>/`; at most
`--jobs` run at once. A cell whose run has written `decomposition.npz` is
read, not rerun; an unfinished one resumes where its checkpoints stop
(rerunning the bench continues the grid). `--variant` names a change to the
recipe and `--extra` holds its flags, appended after the flagfile and seed.

Per cell and site it records, from the final decomposition on the toy's
one-feature probes (SPEC §10, §11): the alive components (CI > 0.1 on some
probe), the CI error against the site's expected pattern (identity, or dense
over `k` columns) with the forms a broken site takes (`measures/probe.py`:
shared components, split or weak features, extra dense components), and for
TMS embeddings MMCS and ML2R; per cell the final
faithfulness loss and the summed wall time of its launches; the bench
measures on the CPU and leaves an accelerator to the cells' runs. A cell
*recovers* when every site's pattern error is 0. Results go to
`<out_dir>/<variant>/recovery.md` and `recovery.json`. Weak features come
with how strongly the site reads them next to the rest (`weak_read`): a
site leaves a feature it barely carries partly masked at little cost.

`--snapshot` trains nothing and measures each cell where it stands, an
unfinished one at its newest checkpoint, and prints the tables with each
row's step without recording them: a long cell's progress between stretches.

A cell run with `--extra=--restarts=K,--select_at=R` is a `bin/train`
selection (bin/restarts.py): K candidates to step R, the lowest held-out
loss continues. The cell is measured on the chosen candidate's run, its
table row names the candidate, and its wall time is the whole selection's.

A SIGTERM to the bench reaches the running cells' runs, which save a
checkpoint and exit; no further cell starts, and the bench names the
stopped cells and exits with the runs' requeue code, 75, so that a
scheduler requeues it. Rerunning the same command continues every cell
where it stopped. A cell also continues on another machine: copy its
directory (only its newest checkpoint is needed) and its `.wall` file to
the same place under that checkout, and rerun the command from the
repository root with the same `--out_dir`, which the run records as part
of its flags.
"""

import concurrent.futures
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
from absl import app, flags

from decompax.analysis import explore
from decompax.evals import eval_step
from decompax.io import decomposition as decomposition_lib
from decompax.io import run_dir
from decompax.measures import probe

ROOT = pathlib.Path(__file__).resolve().parents[1]

_GRID = flags.DEFINE_list(
  "grid", ["tms_5-2:0-4"], "Cells as `<flagfile>:<seeds>`, seeds a range "
  "`0-4` or a `+`-joined list `0+3`; the flagfile is named by its name "
  "(`tms_5-2`) or its path (`flags/tms_5-2.flags`).")
_VARIANT = flags.DEFINE_string(
  "variant", "baseline", "Name of the recipe variant; its runs and tables "
  "live under <out_dir>/<variant>/.")
_EXTRA = flags.DEFINE_string(
  "extra", "", "Flags appended to every cell's command, comma-separated, e.g. "
  "`--extra=--faithfulness_warmup_steps=200,--p_start=2`; a comma not "
  "followed by `--` stays inside its flag's value (`--p_knots=0:1,1:0.5`).")
_JOBS = flags.DEFINE_integer(
  "jobs", max(1, (os.cpu_count() or 1)), "Runs at once (at most the cores).")
_SNAPSHOT = flags.DEFINE_bool(
  "snapshot", False, "Train nothing: measure every cell where it stands, an "
  "unfinished one at its newest checkpoint (its row names the step), and "
  "print the tables without recording them.")
_OUT_DIR = flags.DEFINE_string(
  "out_dir", str(ROOT / "runs" / "recovery"), "Where runs and tables go.")


def parse_seeds(text: str) -> list[int]:
  """Return the seeds of `0-4` or `0+3+7`."""
  range_form = re.fullmatch(r"(\d+)-(\d+)", text)
  if range_form:
    low, high = (int(x) for x in range_form.groups())
    if low <= high:
      return list(range(low, high + 1))
  elif re.fullmatch(r"\d+(\+\d+)*", text):
    return [int(x) for x in text.split("+")]
  raise app.UsageError(f"--grid: seeds {text!r} are neither a rising range "
                       "like 0-4 nor a list like 0+3+7")


def split_extra(text: str) -> list[str]:
  """Split `--a=1,--b=x,y` into its flags, keeping commas inside values."""
  return [flag for flag in re.split(r",(?=--)", text) if flag]


def parse_grid(entries: list[str]) -> list[tuple[str, int]]:
  """Return the (flagfile, seed) cells named by `--grid`."""
  cells = []
  for entry in entries:
    path, _, seeds = entry.partition(":")
    # `flags/tms_5-2.flags` is what `bin/train --flagfile` takes; accept it too.
    name = pathlib.PurePath(path).name.removesuffix(".flags")
    if not (ROOT / "flags" / f"{name}.flags").is_file():
      raise app.UsageError(f"--grid: no flagfile flags/{name}.flags")
    if not seeds:
      raise app.UsageError(f"--grid: {entry!r} names no seeds; write "
                           f"{name}:0-2")
    cells += [(name, s) for s in parse_seeds(seeds)]
  return cells


def cell_dir(variant_dir: pathlib.Path, name: str, seed: int) -> pathlib.Path:
  return variant_dir / f"{name}_s{seed}"


def _add_wall(directory: pathlib.Path, seconds: float) -> float:
  path = directory.with_suffix(".wall")
  total = seconds + (float(path.read_text()) if path.exists() else 0.0)
  path.write_text(f"{total:.1f}\n")
  return total


def final_run(directory: pathlib.Path) -> tuple[pathlib.Path, dict | None]:
  """Return the directory of the cell's final run and, for a `--restarts`
  cell that has chosen, its choice record: the chosen candidate's run."""
  choice = run_dir.read_choice(directory)
  if choice is None:
    return directory, None
  chosen = run_dir.candidate_dir(directory, choice["chosen"])
  return pathlib.Path(chosen), choice


class Stopped(Exception):
  """A cell left for a rerun to continue: its run saved and exited for a
  requeue, or the bench was stopping before it started."""


# bin/train's exit after a stop signal has saved its step (EX_TEMPFAIL, 75):
# the run asks to be rerun, which resumes it.
REQUEUE_EXIT_CODE = os.EX_TEMPFAIL

_running: set[subprocess.Popen] = set()
_stopping = threading.Event()


def stop(signum, frame=None) -> None:
  """Pass a stop signal on to the running cells and start no more."""
  del frame
  _stopping.set()
  for child in list(_running):
    child.send_signal(signum)


def run_logged(command: list[str], log: pathlib.Path) -> int:
  """Run `command` with output appended to `log`; return its exit code."""
  if _stopping.is_set():
    raise Stopped("not started: the bench is stopping")
  with open(log, "a") as out:
    child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                             cwd=ROOT)
    _running.add(child)
    # A stop that came between the launch and the line above missed it.
    if _stopping.is_set():
      child.send_signal(signal.SIGTERM)
    try:
      return child.wait()
    finally:
      _running.discard(child)


def run_cell(variant_dir: pathlib.Path, name: str, seed: int,
             extra: list[str], say) -> None:
  """Run (or resume) one cell's run to completion; raise on a failed run."""
  directory = cell_dir(variant_dir, name, seed)
  if (final_run(directory)[0] / "decomposition.npz").exists():
    return
  command = [sys.executable, "-P", str(ROOT / "bin" / "train"),
             f"--flagfile={ROOT / 'flags' / f'{name}.flags'}",
             f"--seed={seed}", f"--output_dir={directory}", *extra]
  log = directory.with_suffix(".log")
  say(f"[recovery] start {directory.name} (log {log})")
  start = time.time()
  code = run_logged(command, log)
  total = _add_wall(directory, time.time() - start)
  if code == REQUEUE_EXIT_CODE:
    raise Stopped(f"{directory.name} stopped for a requeue; see {log}")
  if code != 0:
    raise RuntimeError(f"{directory.name} exited {code}; see {log}")
  say(f"[recovery] done  {directory.name} in {total / 60:.1f} min")


def held_out_loss(directory: pathlib.Path, step: int) -> float | None:
  """Return the run's held-out total loss at `step`, None before it."""
  return run_dir.metric_at(directory, step, "eval/loss/total")


def _final_faithfulness(directory: pathlib.Path) -> float:
  value = float("nan")
  for record in run_dir.read_metrics(directory / "metrics.jsonl"):
    value = record.get("loss/faithfulness", value)
  return value


def _decomposition(directory: pathlib.Path, snapshot: bool
                   ) -> tuple[decomposition_lib.Decomposition, bool]:
  """Return the run's final decomposition, or under `snapshot` its newest
  checkpoint's where the run has not finished, and whether it is final."""
  final = directory / "decomposition.npz"
  if final.exists():
    return decomposition_lib.load_npz(final), True
  if not snapshot:
    raise FileNotFoundError(f"{directory} has not finished; run its cell "
                            "to the end, or measure it with --snapshot")
  if (directory / run_dir.CANDIDATES_DIR).is_dir():
    raise FileNotFoundError(f"{directory} is still choosing among its "
                            "--restarts candidates; a snapshot measures the "
                            "chosen one, so run the cell past --select_at")
  if not (directory / "checkpoints").is_dir():
    raise FileNotFoundError(f"{directory} has no checkpoint yet; run its "
                            "cell first")
  return (decomposition_lib.load_decomposition(directory / "checkpoints"),
          False)


def measure_cell(cell: pathlib.Path, name: str, snapshot: bool = False
                 ) -> dict:
  """Return the cell's per-site recovery metrics from its finished run
  (under --restarts, the chosen candidate's, with the choice); under
  `snapshot`, from an unfinished run's newest checkpoint, with its step."""
  directory, choice = final_run(cell)
  # Whether it is final is read once: a run that finishes while it is
  # measured keeps the label of the decomposition that was loaded.
  decomposition, final = _decomposition(directory, snapshot)
  run = explore.load_run(str(directory), decomposition)
  target, weights, sites = run.target, run.weights, decomposition.sites
  ci = jax.device_get(probe.probe_ci(
    target, run.ci_fn, weights, decomposition.components,
    decomposition.ci_params))
  read_vectors = jax.device_get(probe.probe_read_vectors(target, weights))
  # The eval's own recovery scalars, so the bench and the run's log agree.
  scalars = eval_step.probe_scalars(ci, jax.device_get(
    eval_step.feature_factors(target, weights, decomposition.components)),
    target.expected)
  per_site = {}
  for site in sites:
    expected = target.expected[site.name]
    site_ci = np.asarray(ci[site.name])
    row = {"pattern": expected.pattern if expected.pattern == "identity"
           else f"dense k={expected.k}",
           "alive": len(probe.alive_components(site_ci)),
           "error": int(scalars[f"{expected.pattern}_ci_error/{site.name}"]),
           "breaks": _breaks(site_ci, read_vectors[site.name], expected)}
    if f"mmcs/{site.name}" in scalars:
      row.update(mmcs=scalars[f"mmcs/{site.name}"],
                 ml2r=scalars[f"ml2r/{site.name}"])
    per_site[site.name] = row
  # The cell's launches, every candidate's time included.
  wall = cell.with_suffix(".wall")
  result = {"flagfile": name, "sites": per_site,
            "recovered": all(r["error"] == 0 for r in per_site.values()),
            "faithfulness": _final_faithfulness(directory),
            "wall_s": float(wall.read_text()) if wall.exists() else None}
  if choice is not None:
    result["selection"] = choice
  if not final:
    result["step"] = decomposition.step
  return result


def _breaks(ci: np.ndarray, read_vectors: np.ndarray, expected) -> dict:
  """Return how a site departs from its pattern; for weak identity
  features, how strongly the site reads them next to the rest; for shared
  components, how parallel the reads of the features they serve are."""
  breaks = probe.pattern_breaks(ci, expected)._asdict()
  reads = np.linalg.norm(read_vectors, axis=-1)
  ratio = probe.weak_read_ratio(ci, reads) if breaks.get("weak") else None
  # NaN (every feature weak) has no rest to compare with, and no JSON.
  if ratio is not None and np.isfinite(ratio):
    breaks["weak_read"] = ratio
  shared = probe.shared_reads(ci, read_vectors) if breaks.get("shared") \
    else None
  if shared is not None:
    breaks.update(shared_cosine=shared.cosine,
                  shared_as_parallel=shared.as_parallel,
                  feature_pairs=shared.pairs)
  return breaks


def _features(n: int) -> str:
  return f"{n} feature" + ("" if n == 1 else "s")


def describe_breaks(breaks: dict[str, float]) -> str:
  """Return the nonzero forms of a site's failure in a few words, with how
  near the threshold a weak feature or missing column came and how strongly
  the site reads its weak features next to the rest."""
  parts = []
  if breaks.get("shared"):
    parts.append(f"{breaks['shared']} shared by "
                 f"{_features(breaks['shared_features'])}"
                 + _shared_reads(breaks))
  if breaks.get("split"):
    parts.append(f"{_features(breaks['split'])} split")
  if breaks.get("weak"):
    parts.append(f"{breaks['weak']} weak" + _peak_and_read(breaks))
  if breaks.get("extra"):
    parts.append(f"{breaks['extra']} extra on "
                 f"{_features(breaks['extra_features'])}")
  if breaks.get("missing"):
    columns = "column" if breaks["missing"] == 1 else "columns"
    parts.append(f"{breaks['missing']} block {columns} never kept"
                 + _peak_and_read(breaks))
  return ", ".join(parts)


def _shared_reads(breaks: dict[str, float]) -> str:
  # Tables written before the shared features' reads were recorded have none.
  if breaks.get("shared_cosine") is None:
    return ""
  return (f" (reads at cosine {breaks['shared_cosine']:.3f} or more; "
          f"{breaks['shared_as_parallel']} of the site's "
          f"{breaks['feature_pairs']} pairs as parallel)")


def _peak_and_read(breaks: dict[str, float]) -> str:
  # Tables written before the peak or the weak features' read was recorded
  # have none, as has a site whose every feature is weak.
  notes = []
  if breaks.get("lowest_peak") is not None:
    notes.append(f"lowest peak {breaks['lowest_peak']:.3f}")
  if breaks.get("weak_read") is not None:
    notes.append(f"read {breaks['weak_read']:.2f}x the rest's")
  return f" ({', '.join(notes)})" if notes else ""


def _site_cell(row: dict) -> str:
  text = f"{row['alive']} / {row['error']}"
  if "mmcs" in row:
    text += f" ({row['mmcs']:.3f}, {row['ml2r']:.3f})"
  # Cells tabled before the breakdown existed have none.
  if row["error"] and row.get("breaks"):
    text += f": {describe_breaks(row['breaks'])}"
  return text


def markdown(results: dict[tuple[str, int], dict], variant: str,
             extra: list[str]) -> str:
  """Return the grid's tables: one per flagfile, then the tally."""
  lines = [f"# Recovery: variant `{variant}`", "",
           f"Extra flags: `{' '.join(extra) or 'none'}`. Per site: alive "
           "components / pattern error (MMCS, ML2R where the site has a "
           "feature axis), then how a broken site fails: components shared "
           "by several features, features split over several components, "
           "weak features (no CI reaches 0.9; `read` compares how far they "
           "move the site's output with the other features), or a dense "
           "site's extra components past its block. A seed recovers when "
           "every error is 0.", ""]
  names = sorted({name for name, _ in results})
  for name in names:
    cells = sorted((s, r) for (n, s), r in results.items() if n == name)
    sites = list(cells[0][1]["sites"])
    patterns = [cells[0][1]["sites"][s]["pattern"] for s in sites]
    lines += [f"## {name}", "",
              "| seed | " + " | ".join(f"{s} ({p})" for s, p in
                                      zip(sites, patterns))
              + " | faithfulness | wall min | recovered |",
              "|---" * (len(sites) + 4) + "|"]
    for seed, r in cells:
      wall = "" if r["wall_s"] is None else f"{r['wall_s'] / 60:.1f}"
      at = f" (step {r['step']})" if "step" in r else ""
      lines.append(
        f"| {seed}{at} | "
        + " | ".join(_site_cell(r["sites"][s]) for s in sites)
        + f" | {r['faithfulness']:.2e} | {wall} | "
        + ("yes" if r["recovered"] else "no")
        + (f" (candidate {r['selection']['chosen']})" if "selection" in r
           else "") + " |")
    lines.append("")
  lines += ["## Tally", "", "| flagfile | recovered |", "|---|---|"]
  for name in names:
    outcomes = [r["recovered"] for (n, _), r in results.items() if n == name]
    lines.append(f"| {name} | {sum(outcomes)} of {len(outcomes)} |")
  return "\n".join(lines) + "\n"


def earlier_cells(variant_dir: pathlib.Path) -> dict[tuple[str, int], dict]:
  """Return the cells an earlier invocation tabled for this variant."""
  path = variant_dir / "recovery.json"
  if not path.exists():
    return {}
  cells = json.loads(path.read_text())["cells"]
  return {(c["flagfile"], c["seed"]): {k: v for k, v in c.items()
                                       if k != "seed"} for c in cells}


def write_tables(variant_dir: pathlib.Path, results: dict, variant: str,
                 extra: list[str]) -> None:
  """Write the variant's tables: this invocation's cells over those an
  earlier one tabled, so a grid run in parts keeps every finished cell."""
  results = {**earlier_cells(variant_dir), **results}
  rows = [{"seed": seed, **r} for (name, seed), r in sorted(results.items())]
  texts = {"recovery.json": json.dumps(
    {"variant": variant, "extra": extra, "cells": rows}, indent=1) + "\n",
    "recovery.md": markdown(results, variant, extra)}
  for file_name, text in texts.items():
    run_dir.atomic_write(variant_dir / file_name,
                         lambda f, text=text: f.write(text.encode()))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if _JOBS.value < 1:
    raise app.UsageError("--jobs must be at least 1")
  # The cells' runs own the accelerator: a TPU admits one process at a
  # time, and on a GPU this one would reserve most of its memory. The probes
  # that measure a finished cell are small, so they run on the CPU; the
  # cells inherit the environment, not this setting.
  jax.config.update("jax_platforms", "cpu")
  cells = parse_grid(_GRID.value)
  extra = split_extra(_EXTRA.value)
  variant_dir = pathlib.Path(_OUT_DIR.value) / _VARIANT.value
  variant_dir.mkdir(parents=True, exist_ok=True)
  lock = threading.Lock()
  signal.signal(signal.SIGTERM, stop)

  def say(text):
    with lock:
      print(text, flush=True)

  results, failures, stopped = {}, [], []

  def one(cell):
    name, seed = cell
    if not _SNAPSHOT.value:
      run_cell(variant_dir, name, seed, extra, say)
    result = measure_cell(cell_dir(variant_dir, name, seed), name,
                          snapshot=_SNAPSHOT.value)
    with lock:
      results[cell] = result
      # The tables record finished cells; a snapshot's go to the screen.
      if not _SNAPSHOT.value:
        write_tables(variant_dir, results, _VARIANT.value, extra)
    at = f" at step {result['step']}" if "step" in result else ""
    say(f"[recovery] {name} seed {seed}{at}: "
        f"{'recovered' if result['recovered'] else 'not recovered'}; "
        + ", ".join(f"{s} {_site_cell(r)}" for s, r in result["sites"].items()))

  with concurrent.futures.ThreadPoolExecutor(_JOBS.value) as pool:
    for cell, future in [(c, pool.submit(one, c)) for c in cells]:
      try:
        future.result()
      except Stopped as e:
        stopped.append(f"{cell[0]} seed {cell[1]}: {e}")
        say(f"[recovery] stopped {stopped[-1]}")
      except Exception as e:  # a failed cell must not stop the grid
        failures.append(f"{cell[0]} seed {cell[1]}: {e}")
        say(f"[recovery] FAILED {failures[-1]}")
  print(markdown(results, _VARIANT.value, extra) if results else "")
  finish(failures, stopped)


def finish(failures: list[str], stopped: list[str]) -> None:
  """Exit 1 if a cell failed, else with the requeue code if one stopped."""
  rerun = (f"{len(stopped)} cell(s) stopped; rerun the same command to "
           "continue them" if stopped else "")
  if failures:
    sys.exit(f"{len(failures)} cell(s) failed: " + "; ".join(failures)
             + (f"; {rerun}" if rerun else ""))
  if stopped:
    print(rerun, file=sys.stderr)
    sys.exit(REQUEUE_EXIT_CODE)


if __name__ == "__main__":
  app.run(main)
