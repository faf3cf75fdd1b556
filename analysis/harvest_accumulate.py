"""A harvest's running totals: their placement on a mesh (`place`), the
per-site baselines calibrated on the first batch (`calibrate`), the empty
totals, the per-batch statistics added to them (`add_window`), the ablation
sums over the components that fired, and the one jitted function that
computes a batch's statistics (`jitted`).

On a `Placement` (one process's devices) each batch splits over the mesh's
batch axes, data-parallel, and the decomposition, CI parameters and frozen
weights lie where the placement table puts them (the `ddp` preset:
replicated, enough for a harvest). The statistics are then reductions over
devices: counts equal the one-device harvest's exactly, sums up to the
order of the additions.
"""

from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from decompax.analysis import (
  explore, harvest_baselines, harvest_batches, harvest_settings)
from decompax.core import step_records
from decompax.measures import component_stats as stats_lib
from decompax.measures import tag_context, tag_profile, unit_activity
from decompax.placement import shardings, transfer
from decompax.placement import table as table_lib
from decompax.targets import brown_tags


def calibrate(run: explore.LoadedRun, placed: "Placed", inputs: Any,
              sites: tuple[tuple[str, harvest_baselines.MlpUnit], ...],
              layers: tuple[harvest_baselines.MlpUnit, ...],
              mlp: harvest_baselines.MlpForm,
              extra: dict[str, Any]) -> dict[str, dict[str, jax.Array]]:
  """Return per site of `sites` its matched baselines' settings, from one
  batch (`inputs`, the harvest's first): `q`, the median firing density
  (CI above 0) of the site's components that fire on it; `threshold`, the
  value each of its MLP's neurons exceeds at the share q of the batch's
  positions (`unit_activity.top_share_thresholds`); `k`, the ceiling of
  the site's mean CI-L0 on it."""
  wanted = harvest_baselines.mlp_taps(layers, mlp)

  @jax.jit
  def measure(weights, components, ci_params, inputs, extra):
    ci, taps = explore.lower_ci_and_taps(
      run.target, run.ci_fn, weights, components, ci_params, inputs, wanted)
    out = {}
    for site, unit in sites:
      rotation = extra["rotation"][layers.index(unit)]
      neurons = harvest_baselines.mlp_activity(taps, unit, rotation,
                                               mlp)["neurons"]
      q = unit_activity.median_alive_density(ci[site])
      out[site] = {
        "q": q, "threshold": unit_activity.top_share_thresholds(neurons, q),
        "k": jnp.ceil(unit_activity.mean_l0(ci[site])).astype(jnp.int32)}
    return out

  return measure(placed.weights, placed.components, placed.ci_params, inputs,
                 extra)


class Placed(NamedTuple):
  """A harvest's arrays where it computes: the frozen weights, the
  decomposition, and the layouts of each batch and of the statistics (None
  for the default device) with the hook that pins the CI to its layout."""

  weights: Any
  components: Any
  ci_params: Any
  inputs: Any
  statistics: Optional[NamedSharding]
  constrain: step_records.Constrain


def _specs(layout: table_lib.Layout, tree: Any, axes_fn: Callable,
           sizes: dict[str, int], prefix: str) -> Any:
  return jax.tree_util.tree_map_with_path(
    lambda path, leaf: table_lib.partition_spec(
      layout, axes_fn(path, leaf), tuple(leaf.shape), sizes,
      shardings.path_text(path, prefix)), tree)


def _largest(path: Any, leaf: Any) -> tuple[str, ...]:
  del path
  return ("largest",) * leaf.ndim


def place(run: explore.LoadedRun, settings: harvest_settings.Settings,
          placement: Optional[shardings.Placement] = None) -> Placed:
  """Return the run's arrays laid out on `placement` (None: left where they
  are).

  Batches split over the `inputs` layout's batch axes; V/U take the
  `compute` layout, CI parameters `ci_weights` and frozen weights `frozen`
  (all replicated under `ddp`), and the statistics are replicated. Raises
  ValueError naming `batch_size` when a batch does not split over the mesh,
  and `table.LayoutError` where a `--place` layout does not tile.
  """
  d = run.decomposition
  if placement is None:
    return Placed(run.weights, d.components, d.ci_params, None, None,
                  step_records.no_constraint)
  mesh, table, _ = placement
  sizes = dict(mesh.shape)
  shape = harvest_batches.batch_shape(run, settings)
  lead = tuple(run.target.batch_lead_shape(shape))
  try:
    inputs = shardings.batch_specs(table, shape, lead, sizes)
  except table_lib.LayoutError as e:
    if e.entry:  # an authored layout: the caller names its override
      raise
    raise ValueError(f"batch_size={settings.batch_size}: {e}") from None
  specs = (shardings.weights_specs(table, run.weights, sizes),
           _specs(table.layout("compute"), d.components,
                  shardings.component_axes, sizes, "components"),
           _specs(table.layout("ci_weights"), d.ci_params, _largest, sizes,
                  "ci_params"))
  weights, components, ci_params = (
    transfer.put(tree, shardings.named(mesh, spec)) for tree, spec in zip(
      (run.weights, d.components, d.ci_params), specs))
  return Placed(weights, components, ci_params,
                shardings.named(mesh, inputs),
                NamedSharding(mesh, PartitionSpec()),
                shardings.make_constrain(table, mesh, lead))


def empty_totals(shapes: dict[str, stats_lib.BatchStats],
                 tag_shapes: Optional[dict] = None) -> dict[str, dict]:
  """Return zero accumulators per site, shaped like one batch's statistics
  (counts in int64, top contexts empty; tag statistics where `tag_shapes`
  has the site)."""
  totals = {}
  for site, s in shapes.items():
    c = s.fired.shape[0]
    totals[site] = {
      "fired": np.zeros(c, np.int64),
      "ci_sum": np.zeros(c, np.float64),
      "histogram": np.zeros(s.histogram.shape, np.int64),
      "coactive": np.zeros(s.coactive.shape, np.int64),
      "top_ci": np.full(s.top_ci.shape, -np.inf, np.float32),
      "top_context": np.full(s.top_context.shape, stats_lib.NO_TOKEN,
                             s.top_context.dtype),
      "top_context_ci": np.zeros(s.top_context_ci.shape, np.float32),
      "ablation_sum": np.zeros(c, np.float64),
      "ablation_count": np.zeros(c, np.int64),
    }
  for key, (shape, _) in (tag_shapes or {}).items():
    zero = tag_profile.zero_tag_stats(shape.fine.shape[0], *_tag_sizes(shape))
    context = tag_context.zero_context_stats(*shape.fine.shape[:1],
                                             shape.coarse.shape[2])
    totals.setdefault(key, {}).update(zip(harvest_settings.TAG_FIELDS, zero))
    totals[key].update(zip(harvest_settings.CONTEXT_FIELDS, context))
  return totals


def _tag_sizes(shape: tag_profile.TagStats) -> tuple[int, int, int]:
  g, _, k = shape.coarse.shape
  return shape.fine.shape[1], k, g


def add_window(totals: dict,
               window: tuple[dict[str, stats_lib.BatchStats], dict]
               ) -> None:
  """Add the device's statistics of the batches since the last flush (and
  their tag statistics) into the host totals (counts in int64 and sums in
  float64, so a long harvest neither overflows nor loses its small
  increments)."""
  stats, tags = window
  for site, (s, c) in transfer.fetch(tags).items():
    t = totals[site]
    summed = tag_profile.add_tag_stats(
      tag_profile.TagStats(*(t[f] for f in harvest_settings.TAG_FIELDS)), s)
    t.update(zip(harvest_settings.TAG_FIELDS, summed))
    context = tag_context.add_context_stats(
      tag_context.ContextStats(*(t[f]
                                 for f in harvest_settings.CONTEXT_FIELDS)), c)
    t.update(zip(harvest_settings.CONTEXT_FIELDS, context))
  for site, s in transfer.fetch(stats).items():
    t = totals[site]
    t["fired"] += s.fired
    t["ci_sum"] += s.ci_sum
    t["histogram"] += s.histogram
    t["coactive"] += s.coactive
    top = stats_lib.merge_top(
      tuple(map(jnp.asarray, (t["top_ci"], t["top_context"],
                              t["top_context_ci"]))),
      tuple(map(jnp.asarray, (s.top_ci, s.top_context, s.top_context_ci))))
    t["top_ci"], t["top_context"], t["top_context_ci"] = map(np.asarray, top)


def fired_components(run: explore.LoadedRun, ci: dict[str, np.ndarray],
                     threshold: float) -> tuple[np.ndarray, np.ndarray]:
  """Return `(site_of, index_of)` of every component that fired on a batch
  (CI above `threshold` at some position), in the run's site order: the
  only ones whose ablation adds to the harvest, summed where they fire."""
  site_of, index_of = [], []
  for k, site in enumerate(run.target.sites):
    fired = np.flatnonzero(
      (ci[site.name] > threshold).reshape(-1, site.c).any(axis=0))
    site_of.append(np.full(len(fired), k, np.int32))
    index_of.append(fired.astype(np.int32))
  return np.concatenate(site_of), np.concatenate(index_of)


def empty_ablation(run: explore.LoadedRun) -> dict[str, dict]:
  """Return one batch's ablation sums and counts per site, zero."""
  return {s.name: {"ablation_sum": np.zeros(s.c, np.float64),
                   "ablation_count": np.zeros(s.c, np.int64)}
          for s in run.target.sites}


def add_ablation(sums: dict, run: explore.LoadedRun, site_of: np.ndarray,
                 index_of: np.ndarray, divergence: np.ndarray,
                 ci: dict[str, np.ndarray], threshold: float) -> None:
  """Add the divergence of each listed component's ablation (`divergence[j]`
  that of component `index_of[j]` of site `site_of[j]`), summed over the
  positions where that component fires, and those positions' count."""
  names = [s.name for s in run.target.sites]
  for j, (k, c) in enumerate(zip(site_of, index_of)):
    fired = ci[names[k]][..., c] > threshold
    sums[names[k]]["ablation_sum"][c] += np.sum(divergence[j] * fired)
    sums[names[k]]["ablation_count"][c] += np.sum(fired)


def padded(x: np.ndarray, size: int) -> np.ndarray:
  """Return `x` (not empty) padded to `size` with its last entry, so every
  chunk of components runs one compiled program."""
  return np.concatenate([x, np.repeat(x[-1:], size - len(x))])


def _window_layout(placed: Optional[Placed]) -> tuple[Callable, dict]:
  """Return the CI's constraint and the window's jit options on `placed`."""
  if placed is None or placed.statistics is None:
    return step_records.no_constraint, {}
  # A fixed layout, so the donated window is reused in place and each
  # flush reads it from one device.
  return placed.constrain, {"out_shardings": (placed.statistics, None)}


def jitted(run: explore.LoadedRun, settings: harvest_settings.Settings,
           chunk: int, placed: Optional[Placed] = None,
           coarse_of: Optional[np.ndarray] = None,
           layers: tuple[harvest_baselines.MlpUnit, ...] = (),
           heads: tuple[int, ...] = (), n_head: int = 0,
           mlp: harvest_baselines.MlpForm = harvest_baselines.MlpForm(),
           sites: tuple[tuple[str, harvest_baselines.MlpUnit], ...] = ()):
  """Return the jitted batch statistics, the accumulation of one batch
  into the device's window of statistics, the ablation of `chunk`
  components (site and index each, beside the clean output) and the plain
  clean forward, which the throughput is compared with. With `placed`, the CI
  keeps its layout and the window stays replicated.

  The window is `(statistics, tag statistics)` per site; the second is
  empty unless `coarse_of` is given, and then each batch comes with its
  positions' `(tags, previous tags, groups)` and the tag statistics hold
  the baselines of `layers`, `heads` and `sites` (reading `extra` besides
  the forward; MLPs of form `mlp`), each a pair (tags, context)."""
  target, ci_fn = run.target, run.ci_fn
  constrain, kept = _window_layout(placed)

  def stats(weights, components, ci_params, inputs, positions=None,
            extra=None):
    ci, taps = explore.lower_ci_and_taps(
      target, ci_fn, weights, components, ci_params, inputs,
      harvest_baselines.baseline_taps(layers, heads, mlp)
      if coarse_of is not None else ())
    ci = constrain("ci_activations", ci)
    batch = {site: stats_lib.batch_stats(
      value, inputs, settings.threshold, settings.top_k, settings.before,
      settings.after) for site, value in ci.items()}
    if coarse_of is None:
      return (batch, {}), ci
    activity = _unit_activity(ci, taps, (layers, heads, n_head, mlp, sites),
                              extra)
    return (batch, _tag_batch(activity, inputs, positions, coarse_of,
                              settings.tag_groups, extra)), ci

  def accumulate(window, weights, components, ci_params, inputs,
                 positions=None, extra=None):
    (batch, tags), ci = stats(weights, components, ci_params, inputs,
                              positions, extra)
    add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
    return ({site: stats_lib.add_stats(window[0][site], batch[site])
             for site in window[0]},
            {site: add(window[1][site], tags[site]) for site in window[1]}
            ), ci

  def ablation(weights, components, inputs, clean_output, site_of,
               index_of):
    lead = tuple(target.batch_lead_shape(inputs))
    return stats_lib.ablation_divergence(
      target, weights, components, inputs, clean_output, lead, site_of,
      index_of, chunk)

  def clean(weights, inputs):
    return target.clean_forward(weights, inputs, ci_fn.input_taps)[0]

  return (jax.jit(stats), jax.jit(accumulate, donate_argnums=0, **kept),
          jax.jit(ablation), jax.jit(clean))


def _unit_activity(ci: dict[str, jax.Array], taps: dict[str, jax.Array],
                   units: tuple, extra: dict) -> dict[str, jax.Array]:
  """Return the activity of every unit set a tag harvest measures: the
  sites' CI, then the baselines of `units` (`layers, heads, n_head, mlp,
  sites`, as `jitted` takes them); no baselines add nothing."""
  layers, heads, n_head, mlp, sites = units
  activity = {**ci, **harvest_baselines.baseline_activity(
    taps, layers, heads, n_head, extra, mlp)}
  activity.update(harvest_baselines.site_activity(
    activity, sites, extra.get("calibration")))
  return activity


def _tag_batch(activity: dict[str, jax.Array], inputs: jax.Array,
               positions: tuple, coarse_of: np.ndarray, n_groups: int,
               extra: dict[str, Any]) -> dict[str, tuple]:
  """Return each unit set's tag and context statistics of one batch."""
  return {key: (tag_profile.batch_tag_stats(
    value, *positions, jnp.asarray(coarse_of), len(brown_tags.COARSE),
    n_groups), tag_context.batch_context_stats(value, inputs, extra["mix"]))
          for key, value in activity.items()}
