"""Where a tagged harvest's units are most active, with every token's tag:
the contexts the browser and the gallery show beside a unit's label.

A harvest keeps its components' top contexts as token ids alone and its
baselines (neurons, gates, rotated neurons, heads) as tag statistics
alone. Here the harvest's first batches, the very windows it read
(`harvest.batch_source`, `harvest.tag_source`'s stream), are streamed
again through the decomposition's CI and the baselines' activities
(`harvest.baseline_activity`), keeping each unit's `k` most active
positions as offsets into the token file. A context is then a window of
the token file around such a position, cut to the harvested window, with
the token ids and the fine tags read straight from the file and its tag
stream, so components and neurons are shown alike over the same sample.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Int

from decompax.analysis import (
  explore, harvest_accumulate, harvest_baselines, harvest_batches,
  harvest_settings)
from decompax.io import tokens as tokens_lib

# Batches of the harvest streamed again by default: a sample, not the
# whole harvest, so the first request of a large run takes seconds.
SAMPLE_BATCHES = 8


class Top(NamedTuple):
  """One unit set's most active positions over the sample, per unit."""

  activity: Float[np.ndarray, "u k"]  # descending; 0 for no activity
  offset: Int[np.ndarray, "u k"]  # the position in the token file
  start: Int[np.ndarray, "u k"]  # its window's first position


class Context(NamedTuple):
  """A window of the token file around one of a unit's top positions."""

  activity: float
  ids: tuple[int, ...]
  tags: tuple[int, ...]  # fine tag ids, into the stream's vocabulary
  focus: int  # index in `ids` of the position


def settings_of(manifest: dict) -> harvest_settings.Settings:
  """Return the settings a harvest was made with, from its manifest."""
  return harvest_settings.Settings(**manifest["settings"])


def top_positions(run: explore.LoadedRun, settings: harvest_settings.Settings,
                  k: int, batches: int = SAMPLE_BATCHES) -> dict[str, Top]:
  """Return per unit set (each site's components, each baseline key) its
  units' `k` most active positions over the harvest's first `batches`
  batches (all of them where it has fewer)."""
  layers = harvest_baselines.baseline_layers(run)
  heads = harvest_baselines.head_layers(run)
  n_head = harvest_baselines.n_heads(run) if heads else 0
  extra = harvest_baselines.baseline_weights(run, settings, layers, heads)
  mlp = (harvest_baselines.mlp_form(run) if layers
         else harvest_baselines.MlpForm())
  wanted = harvest_baselines.baseline_taps(layers, heads, mlp)
  d = run.decomposition
  read = harvest_batches.batch_source(run, settings)
  # The matched neurons as the harvest measured them: calibrated again on
  # its first batch.
  sites = harvest_baselines.site_mlps(run) if settings.tag_revision else ()
  extra["calibration"] = harvest_accumulate.calibrate(
    run, harvest_accumulate.place(run, settings), read(0), sites, layers, mlp,
    extra) if sites else {}

  @jax.jit
  def best(inputs, extra):
    ci, taps = explore.lower_ci_and_taps(
      run.target, run.ci_fn, run.weights, d.components, d.ci_params,
      inputs, wanted)
    activity = {**ci, **harvest_baselines.baseline_activity(
      taps, layers, heads, n_head, extra, mlp)}
    activity.update(harvest_baselines.site_activity(activity, sites,
                                                    extra["calibration"]))
    out = {}
    for key, a in activity.items():
      flat = a.reshape(-1, a.shape[-1]).T
      out[key] = jax.lax.top_k(flat.astype(jnp.float32),
                               min(k, flat.shape[1]))
    return out

  n_tokens = tokens_lib.open_tokens(settings.data_path).header.num_tokens
  t = settings.seq_len
  kept: dict[str, Top] = {}
  for i in range(min(batches, settings.n_batches)):
    positions = harvest_batches.window_positions(settings, i, n_tokens)
    offsets = positions.reshape(-1)
    window = np.repeat(positions[:, 0], t)
    for key, (values, index) in jax.device_get(
        best(read(i), extra)).items():
      found = Top(np.asarray(values, np.float64), offsets[index],
                  window[index])
      kept[key] = found if key not in kept else _merge(kept[key], found, k)
  return kept


def _merge(a: Top, b: Top, k: int) -> Top:
  """Return the `k` most active of two units' position lists."""
  joined = Top(*(np.concatenate([x, y], axis=1) for x, y in zip(a, b)))
  order = np.argsort(-joined.activity, axis=1, kind="stable")[:, :k]
  return Top(*(np.take_along_axis(x, order, 1) for x in joined))


def contexts(top: Top, unit: int, ids: np.ndarray, tags: np.ndarray,
             seq_len: int, before: int, after: int) -> list[Context]:
  """Return a unit's contexts where it is active, most active first: the
  `before` tokens before each position and `after` after it, inside its
  harvested window; `ids` and `tags` are the token file's and its tag
  stream's (memory-mapped) arrays."""
  out = []
  for value, at, start in zip(top.activity[unit], top.offset[unit],
                              top.start[unit]):
    if not value > 0:
      continue
    lo = max(int(at) - before, int(start))
    hi = min(int(at) + after + 1, int(start) + seq_len)
    out.append(Context(float(value), tuple(int(x) for x in ids[lo:hi]),
                       tuple(int(x) for x in tags[lo:hi]), int(at) - lo))
  return out
