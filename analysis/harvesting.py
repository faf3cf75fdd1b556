"""Harvest what a finished run's components do (`bin/harvest`).

Streams batches through the decomposition (token windows of a token file
for language models, the toy's own input distribution for toys), jitted
one batch at a time so memory does not grow with the harvest, and writes
`<run_dir>/harvest/` through `io/harvest_store.py`: one zarr array per
site and statistic, and `manifest.json` last, which marks the harvest
complete. Per component:
firing density and mean CI, a log-spaced CI histogram, co-activation counts
with every component of its site, the top-k contexts by CI (token windows
with the component's CI on each token, or a toy's input rows), and the
divergence from the clean model when it alone is ablated, summed over the
positions where it fires (measured on the first `ablation_batches`, each
ablating only the components that fired in it, with progress lines: one
forward of a whole batch per component, the harvest's dominant cost on a
language model, whose default is therefore none). When
the token file has a tag stream, also every component's part-of-speech
statistics, its CI as the activity (`measures/tag_profile.py`, fields
`TAG_FIELDS`; `docs/tag_profiles.md`) and those of the baselines, the
neurons of every MLP with a decomposed site (`BASELINES`; of a mixture of
experts, every expert with one, its neurons weighted by its routing weight)
and the heads of every attention with one (`HEADS`), with the tag
vocabulary, its coarse classes, the documents and the baselines' keys in
the manifest's `tags`.

An interrupted harvest resumes from `harvest/state.npz` when rerun with the
same settings; asked to stop (`stop`), it saves that state at the next batch
boundary and raises `Stopped`. The record it returns compares its
throughput with a plain clean forward over the same batches.

This module is the driver: the batch loop, its resume and stop, the
ablation pass and the manifest, and `load_harvest`, which reads one back.
Its parts answer one question each: the settings (`harvest_settings`), the
batches (`harvest_batches`), the baselines (`harvest_baselines`) and the
totals a batch adds to, placed on a mesh (`harvest_accumulate`).
"""

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from decompax.analysis import (
  explore, harvest_accumulate, harvest_baselines, harvest_batches,
  harvest_settings)
from decompax.io import harvest_store
from decompax.measures import ci_counts
from decompax.measures import component_stats as stats_lib
from decompax.placement import shardings, transfer


class Stopped(Exception):
  """The harvest stopped when asked, its progress saved: `done` batches
  (0: none yet, nothing saved)."""

  def __init__(self, done: int, total: int):
    super().__init__(f"stopped after batch {done} of {total}")
    self.done, self.total = done, total


def _progress(done: int, total: int, started: float, first: int) -> str:
  rate = (done - first) / max(time.time() - started, 1e-9)
  eta = (total - done) / rate if rate > 0 else float("inf")
  return (f"[harvest] batch {done}/{total}  {rate:.1f} batches/s  "
          f"ETA {eta:.0f}s")


def _fresh_window(shapes: tuple[dict, dict], placed: harvest_accumulate.Placed
                  ) -> Callable[[], tuple[dict, dict]]:
  def fresh():
    zeros = lambda x: jnp.zeros(x.shape, x.dtype)  # noqa: E731
    return ({site: stats_lib.zero_stats(shape)
             for site, shape in shapes[0].items()},
            jax.tree.map(zeros, shapes[1]))

  if placed.statistics is None:
    return fresh
  return jax.jit(fresh, out_shardings=placed.statistics)


def _never() -> bool:
  return False


class _Pipeline(NamedTuple):
  """A harvest's batches, tag positions, baseline weights and jitted
  functions (`jitted`), set up once; `shapes` are its window's."""

  batch: Callable[[int], Any]
  positions: Callable[[int], Any]
  extra: dict[str, Any]
  accumulate: Any
  ablation: Any
  clean: Any
  shapes: tuple[dict, dict]
  tag_record: dict
  chunk: int


def _pipeline(run: explore.LoadedRun, settings: harvest_settings.Settings,
              chunk: int, placed: harvest_accumulate.Placed) -> _Pipeline:
  batch = harvest_batches.batch_source(run, settings, placed.inputs)
  tags = harvest_batches.tag_source(settings, placed.inputs)
  positions = (lambda i: None) if tags is None else tags.read
  layers = () if tags is None else harvest_baselines.baseline_layers(run)
  heads = () if tags is None else harvest_baselines.head_layers(run)
  sites = () if tags is None else harvest_baselines.site_mlps(run)
  extra = harvest_baselines.baseline_weights(run, settings, layers, heads)
  mlp = (harvest_baselines.mlp_form(run) if layers
         else harvest_baselines.MlpForm())
  calibration = harvest_accumulate.calibrate(run, placed, batch(0), sites,
                                             layers, mlp,
                                             extra) if sites else {}
  if tags is not None:
    extra = {**extra, "mix": jnp.asarray(tags.mix, jnp.float32),
             "calibration": calibration}
  if placed.statistics is not None:
    extra = transfer.put(extra, jax.tree.map(lambda _: placed.statistics,
                                             extra))
  stats_fn, accumulate, ablation_fn, clean_fn = harvest_accumulate.jitted(
    run, settings, chunk, placed,
    None if tags is None else tags.coarse_of, layers, heads,
    harvest_baselines.n_heads(run) if heads else 0, mlp, sites)
  shapes, _ = jax.eval_shape(stats_fn, placed.weights, placed.components,
                             placed.ci_params, batch(0), positions(0), extra)
  tag_record = {} if tags is None else {"tags": {
    **tags.record,
    "baselines": list(
      harvest_baselines.baseline_keys(layers, heads, mlp, sites)),
    "calibration": calibration_record(calibration)}}
  return _Pipeline(batch, positions, extra, accumulate, ablation_fn,
                   clean_fn, shapes, tag_record, chunk)


def calibration_record(calibration: dict[str, dict[str, jax.Array]]
                       ) -> dict[str, dict[str, float | int | None]]:
  """Return what the manifest says of each site's calibration: its q
  (None where no component fired on the batch) and its k."""
  out = {}
  for site, c in transfer.fetch(calibration).items():
    q = float(c["q"])
    out[site] = {"q": q if np.isfinite(q) else None, "k": int(c["k"])}
  return out


def harvest(run: explore.LoadedRun, settings: harvest_settings.Settings,
            out: str, save_every_s: float = 60.0, ablation_chunk: int = 16,
            overwrite: bool = False,
            say: Callable[[str], None] = print,
            placement: Optional[shardings.Placement] = None,
            stop: Callable[[], bool] = _never,
            progress_every_s: float = harvest_settings.ABLATION_PROGRESS_S
            ) -> dict:
  """Run the harvest into `out` (resuming a saved one, or replacing one
  made with other settings when `overwrite`) and return its record: the
  arrays written and the throughput beside a clean forward ({} when `out`
  already holds this harvest, complete). With `placement`, on its mesh
  (`place`; ValueError when the batch does not split over it).

  `stop()` is asked before each batch and each chunk of ablations: when
  true, the progress since the last save is saved and `Stopped` raised (a
  batch whose ablations were cut short is left for the resumed harvest;
  once every batch is done, the harvest finishes instead, without timing
  the clean forward). The ablations say their progress every
  `progress_every_s` seconds.
  """
  harvest_settings.check_cadence(save_every_s, ablation_chunk)
  placed = harvest_accumulate.place(run, settings, placement)
  harvest_store.prepare(out, say)
  pipe = _pipeline(run, settings, ablation_chunk, placed)
  totals = harvest_accumulate.empty_totals(*pipe.shapes)
  done = harvest_store.resume(out, totals, dataclasses.asdict(settings),
                              overwrite)
  if done < 0:
    say(f"[harvest] {out} is complete; nothing to do")
    return {}
  if done:
    say(f"[harvest] resuming after batch {done}")
  harvest_seconds, timed_start = _run_batches(
    run, settings, out, placed, pipe, totals, done, save_every_s,
    _Ablating(say, stop, progress_every_s))
  written = harvest_store.write_store(out, totals,
                                      harvest_settings.FIELDS
                                      + harvest_settings.TAG_FIELDS
                                      + harvest_settings.CONTEXT_FIELDS)
  if stop():  # timing the clean forward is all that is left
    return {"arrays": written, **pipe.tag_record}
  return {"arrays": written, **pipe.tag_record, **throughput(
    pipe.clean, placed.weights, pipe.batch, harvest_seconds,
    settings.n_batches - timed_start)}


class _Ablating(NamedTuple):
  """How a harvest talks and stops: `say` its lines, `stop()` asked
  between batches and chunks of ablations, `every_s` the seconds between
  the ablations' progress lines."""

  say: Callable[[str], None]
  stop: Callable[[], bool]
  every_s: float


def _ablation_progress(batch: int, batches: int, done: int, total: int,
                       since: tuple[float, int]) -> str:
  """Return a progress line, the rate counted from `since` (a time and the
  components done then)."""
  rate = (done - since[1]) / max(time.time() - since[0], 1e-9)
  eta = (total - done) / rate if rate > 0 else float("inf")
  return (f"[harvest] ablation batch {batch}/{batches}: component "
          f"{done}/{total}  {rate:.1f} components/s  ETA {eta:.0f}s")


def _ablate(run: explore.LoadedRun, settings: harvest_settings.Settings,
            placed: harvest_accumulate.Placed,
            pipe: _Pipeline, i: int, inputs: Any, ci: Any,
            talk: _Ablating) -> Optional[dict]:
  """Return batch `i`'s ablation sums per site (`empty_ablation`), one
  chunk of the components that fired at a time, saying the progress by
  the clock; None when `talk.stop()` came first."""
  ci = transfer.fetch(ci)
  site_of, index_of = harvest_accumulate.fired_components(
    run, ci, settings.threshold)
  n, chunk = len(site_of), pipe.chunk
  talk.say(f"[harvest] ablation batch {i + 1}/{settings.ablation_batches}: "
           f"the {n} of {sum(s.c for s in run.target.sites)} components "
           f"that fired, {chunk} at a time")
  sums = harvest_accumulate.empty_ablation(run)
  clean = pipe.clean(placed.weights, inputs)
  # The rate from the end of the first chunk, which compiles.
  said = time.time()
  since = said, 0
  for at in range(0, n, chunk):
    if talk.stop():
      return None
    block = slice(at, at + chunk)
    divergence = transfer.fetch(pipe.ablation(
      placed.weights, placed.components, inputs, clean,
      *(jnp.asarray(harvest_accumulate.padded(x[block], chunk))
        for x in (site_of, index_of))))
    harvest_accumulate.add_ablation(sums, run, site_of[block], index_of[block],
                                    divergence, ci, settings.threshold)
    done = min(at + chunk, n)
    if time.time() - said >= talk.every_s or done == n:
      talk.say(_ablation_progress(i + 1, settings.ablation_batches, done, n,
                                  since))
      said = time.time()
    if at == 0 and done < n:
      since = time.time(), done
  return sums


def _add_ablations(run: explore.LoadedRun, settings: harvest_settings.Settings,
                   out: str,
                   placed: harvest_accumulate.Placed, pipe: _Pipeline,
                   totals: dict, i: int, inputs: Any, ci: Any, talk: _Ablating,
                   saved_done: int) -> None:
  """Add batch `i`'s ablations to `totals` (which hold the batches before
  it); stopped before they end, save those totals and raise `Stopped`:
  the resumed harvest redoes batch `i`."""
  sums = _ablate(run, settings, placed, pipe, i, inputs, ci, talk)
  if sums is None:
    if i > saved_done:
      harvest_store.save_state(out, totals, i, dataclasses.asdict(settings))
    raise Stopped(i, settings.n_batches)
  for site, t in sums.items():
    for name, value in t.items():
      totals[site][name] += value


def _save(out: str, totals: dict, window: Any, i: int,
          settings: harvest_settings.Settings) -> None:
  harvest_accumulate.add_window(totals, window)
  harvest_store.save_state(out, totals, i, dataclasses.asdict(settings))


def _run_batches(run: explore.LoadedRun, settings: harvest_settings.Settings,
                 out: str,
                 placed: harvest_accumulate.Placed, pipe: _Pipeline,
                 totals: dict, done: int,
                 save_every_s: float, talk: _Ablating) -> tuple[float, int]:
  """Add batches `done`… to `totals`, saving the state by the clock and
  when stopped (`Stopped`); return the seconds the timed batches took and
  the first of them."""
  fresh_window = _fresh_window(pipe.shapes, placed)
  # Batches accumulate on the device, with no host sync, until the next
  # save, ablation batch or the end fetches the window into the host
  # totals; `held` is the window's first batch.
  window, held = fresh_window(), done
  started, first, timed_from = time.time(), done, None
  saved, saved_done = started, done
  timed_start = max(first + 1, settings.ablation_batches)
  for i in range(done, settings.n_batches):
    if talk.stop():
      if i > saved_done:
        _save(out, totals, window, i, settings)
      raise Stopped(i, settings.n_batches)
    # Timed from the first batch after the compile and the ablations,
    # which a clean forward does not do.
    if i == timed_start:
      jax.block_until_ready(window)
      timed_from = time.time()
    ablating = i < settings.ablation_batches
    if ablating and i > held:  # the totals before batch i, should it stop
      harvest_accumulate.add_window(totals, window)
      window, held = fresh_window(), i
    inputs = pipe.batch(i)
    window, ci = pipe.accumulate(window, placed.weights, placed.components,
                                 placed.ci_params, inputs, pipe.positions(i),
                                 pipe.extra)
    if ablating:
      _add_ablations(run, settings, out, placed, pipe, totals, i, inputs, ci,
                     talk, saved_done)
    # Saves go by the clock: a fixed batch count would, on a small model,
    # spend most of the harvest writing state.
    if (time.time() - saved >= save_every_s
        and i + 1 < settings.n_batches):
      _save(out, totals, window, i + 1, settings)
      window, held = fresh_window(), i + 1
      saved, saved_done = time.time(), i + 1
    if (i + 1) % max(1, settings.n_batches // 10) == 0:
      talk.say(_progress(i + 1, settings.n_batches, started, first))
  jax.block_until_ready(window)
  harvest_seconds = time.time() - timed_from if timed_from else 0.0
  harvest_accumulate.add_window(totals, window)
  return harvest_seconds, timed_start


def throughput(clean_fn, weights, batch, harvest_seconds: float,
               timed_batches: int) -> dict:
  """Return the harvest's batches/s beside a clean forward's over the same
  batches (timed now, after one compiling call), with the weights the
  harvest used."""
  if timed_batches <= 0 or harvest_seconds <= 0:
    return {}
  jax.block_until_ready(clean_fn(weights, batch(0)))
  t0 = time.time()
  # Dispatched back to back, as the harvest's batches are.
  outputs = [clean_fn(weights, batch(i))
             for i in range(1, timed_batches + 1)]
  jax.block_until_ready(outputs)
  clean_seconds = time.time() - t0
  return {"harvest_batches_per_s": timed_batches / harvest_seconds,
          "clean_batches_per_s": timed_batches / clean_seconds,
          "ratio_to_clean": clean_seconds / harvest_seconds}


def write_manifest(out: str, run_path: str, run: explore.LoadedRun,
                   settings: harvest_settings.Settings, record: dict) -> str:
  """Write `manifest.json` (last: its presence marks the harvest done)."""
  manifest = {
    "run_dir": os.path.abspath(run_path),
    "settings": dataclasses.asdict(settings),
    "sites": {s.name: s.c for s in run.target.sites},
    "positions": settings.n_batches * settings.batch_size * settings.seq_len,
    "histogram_bands": {"floor": ci_counts.LOG_DENSITY_MIN,
                        "bins": ci_counts.LOG_DENSITY_BINS},
    **record,
  }
  return harvest_store.write_manifest(out, manifest)


class Harvest(NamedTuple):
  """A completed harvest read back: its manifest and, per site, every
  statistic as a host array; per baseline key (`BASELINES`), its tag
  statistics."""

  manifest: dict
  sites: dict[str, dict[str, np.ndarray]]
  baselines: dict[str, dict[str, np.ndarray]]


def has_context(manifest: dict) -> bool:
  """Return whether a harvest holds the context statistics and matched
  baselines (`TAG_REVISION` 1; older tag harvests do not: harvest again
  with `--overwrite` for them)."""
  return manifest["settings"].get("tag_revision", 0) >= 1


def load_harvest(run_path: str) -> Harvest:
  """Return the harvest of the run at `run_path`; ValueError when it has
  none, or an unfinished one (no manifest yet)."""
  manifest = harvest_store.read_manifest(run_path)
  tagged = "tags" in manifest
  tag_fields = (harvest_settings.TAG_FIELDS + (harvest_settings.CONTEXT_FIELDS
                                               if has_context(manifest)
                                               else ())) if tagged else ()
  sites = {site: harvest_store.read_arrays(run_path, site,
                                           harvest_settings.FIELDS + tag_fields)
           for site in manifest["sites"]}
  baselines = {key: harvest_store.read_arrays(run_path, key, tag_fields)
               for key in (manifest["tags"].get("baselines", [])
                           if tagged else [])}
  return Harvest(manifest, sites, baselines)
