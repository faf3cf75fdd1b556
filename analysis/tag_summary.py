"""The report's part-of-speech comparison of components with neurons, from
a run's tagged harvest (`docs/tag_profiles.md`).

`record(harvest)` turns `tag_comparison.comparisons` into the JSON the
report page reads (`render/tag_report.py`): per site and for the total, per
baseline, both unit sets' summaries, weighted by activity and unweighted,
and the bootstrap interval of each difference components − baseline; and
every unit's purity per site and baseline, which the purity figure draws.
A harvest with context statistics (`harvesting.has_context`) adds, per
site and unit set, the context measure (`context`: activity-weighted mean
purity, token-implied purity and excess, and the median excess) and the
robust summaries (`robust`: unweighted and weighted median purity and the
share of activity at purity ≥ 0.5, each with its bootstrap interval, the
always-on units apart), and per site the matched baselines' q and k
(`calibration`); an older harvest's record has none of these keys.
`write(run_path)` stores both beside the report, where a harvest with tag
statistics exists; `rebuild_report(run_path)` writes that and then the
report itself, the one sequence `bin/harvest` and `bin/report` both run.
"""

import json
import os
from typing import NamedTuple

import numpy as np

from decompax.analysis import harvesting as harvest_lib
from decompax.analysis import tag_comparison
from decompax.io import harvest_store
from decompax.io import tensor_store
from decompax.measures import tag_context, tag_metrics, tag_profile
from decompax.render import run_report as report
from decompax.render import tag_report as tag_page

# Bootstrap resamples of the report's intervals.
N_BOOT = 1000
WEIGHTINGS = ("weighted", "unweighted")


def _value(x: float) -> float | None:
  return float(x) if np.isfinite(x) else None


def summary_record(summary: tag_metrics.Summary) -> dict:
  """Return a unit set's summary as the stored records hold it (NaN as
  None)."""
  return {"units": summary.units,
          **{name: _value(getattr(summary, name))
             for name in tag_metrics.SCALARS},
          "coverage": [int(x) for x in summary.coverage]}


def _interval(interval: tag_metrics.Interval) -> list:
  return [_value(interval.estimate), _value(interval.low),
          _value(interval.high)]


def _purities(coarse: np.ndarray) -> list[float]:
  """Return the purity of each unit with activity (from its per-group
  class counts `[g, u, k]`), rounded for the page."""
  share, _ = tag_metrics.purity(np.asarray(coarse).sum(axis=0))
  return [round(float(x), 4) for x in share[np.isfinite(share)]]


def _weighted_mean(values: np.ndarray, weights: np.ndarray) -> float | None:
  total = weights.sum()
  return _value(float((values * weights).sum() / total)) if total > 0 else None


def context_row(unit_set: tag_comparison.UnitSet, seed: int = 0,
                n_boot: int = N_BOOT) -> dict:
  """Return a unit set's context measure and robust summaries as the
  report stores them (the set must have context statistics)."""
  stats, context = unit_set.stats, unit_set.context
  counts = tag_profile.class_counts(stats)
  measured = tag_context.context_purity(counts, context.implied)
  mass = counts.sum(axis=1)
  alive = mass > 0
  w = mass[alive]
  robust = tag_metrics.robust_summary(stats.coarse, stats.base_coarse,
                                      context.on, seed, n_boot)
  return {
    "units": int(alive.sum()),
    "purity": _weighted_mean(measured.purity[alive], w),
    "implied_purity": _weighted_mean(measured.implied_purity[alive], w),
    "excess": _weighted_mean(measured.excess[alive], w),
    "median_excess": _value(float(np.median(measured.excess[alive])))
    if alive.any() else None,
    "robust": {name: _interval(i) for name, i in robust.intervals.items()},
    "robust_units": robust.units,
    "always_on": [int(u) for u in robust.always_on],
    "always_on_share": _value(robust.always_on_share)}


def context_record(harvest: harvest_lib.Harvest, seed: int = 0,
                   n_boot: int = N_BOOT,
                   map_fn: tag_comparison.MapFn = map) -> dict:
  """Return per site (one with baselines) and unit set its `context_row`;
  {} for a harvest without context statistics."""
  if not harvest_lib.has_context(harvest.manifest):
    return {}
  jobs = [(site, u) for site in harvest.sites
          if tag_comparison.baselines_of(site)
          for u in tag_comparison.unit_sets(harvest, site)]
  rows = map_fn(lambda job: context_row(job[1], seed, n_boot), jobs)
  out: dict[str, dict] = {}
  for (site, u), row in zip(jobs, rows):
    out.setdefault(site, {})[u.name] = row
  return out


def record(harvest: harvest_lib.Harvest, seed: int = 0,
           n_boot: int = N_BOOT,
           map_fn: tag_comparison.MapFn = map) -> dict:
  """Return the comparison as the report stores it (ValueError for a
  harvest without tag statistics); `map_fn` runs the comparisons."""
  rows = []
  for row in tag_comparison.comparisons(harvest, seed, n_boot, map_fn):
    c = row.comparison
    rows.append({
      "site": row.site, "baseline": row.baseline,
      "components": {w: summary_record(c.a[w]) for w in WEIGHTINGS},
      "units": {w: summary_record(c.b[w]) for w in WEIGHTINGS},
      "difference": {w: {name: _interval(c.difference[w][name])
                         for name in tag_metrics.SCALARS}
                     for w in WEIGHTINGS}})
  purities: dict[str, dict[str, list[float]]] = {}
  for site, fields in harvest.sites.items():
    pairs = [(kind, key) for kind, key in tag_comparison.baselines_of(site)
             if key in harvest.baselines]
    if not pairs:
      continue
    # The components the comparison counts: those that fired.
    alive = fields["tag_coarse"][:, fields["fired"] > 0]
    purities[site] = {"components": _purities(alive), **{
      kind: _purities(harvest.baselines[key]["tag_coarse"])
      for kind, key in pairs}}
  tags = harvest.manifest["tags"]
  context = context_record(harvest, seed, n_boot, map_fn)
  extra = {"context": context,
           "calibration": tags.get("calibration", {})} if context else {}
  return {"classes": list(tags["classes"]), "n_boot": n_boot,
          "documents": len(tags["documents"]),
          "groups": int(tags["groups"]),
          "positions": int(harvest.manifest["positions"]),
          "rows": rows, "purities": purities, **extra}


def write(run_path: str, n_boot: int = N_BOOT,
          map_fn: tag_comparison.MapFn = map) -> str | None:
  """Return the path of the comparison written beside the run's report
  (and its figure), or None where the run has no finished harvest with
  tag statistics; ValueError naming a damaged one."""
  manifest = os.path.join(run_path, harvest_store.HARVEST_DIR,
                          harvest_store.MANIFEST)
  # Only a finished harvest with tag statistics is read: another one, even
  # a damaged one, is no concern of the comparison.
  try:
    with open(manifest, encoding="utf-8") as f:
      tagged = "tags" in json.load(f)
  except (OSError, ValueError):
    return None
  if not tagged:
    return None
  again = f"rerun bin/harvest --run_dir={run_path} --overwrite"
  try:
    harvest = harvest_lib.load_harvest(run_path)
  except tensor_store.StoreError as e:
    raise ValueError(f"a harvest array cannot be read ({e}); {again}"
                     ) from None
  directory = os.path.join(run_path, report.REPORT_DIR)
  value = record(harvest, n_boot=n_boot, map_fn=map_fn)
  tag_page.plot_purities(value, os.path.join(directory, tag_page.FIGURE))
  return tag_page.write(directory, value)


class Rebuilt(NamedTuple):
  """The files `rebuild_report` wrote: the comparison (None where the run
  has no tagged harvest) and the report's page."""

  comparison: str | None
  page: str


def rebuild_report(run_path: str, n_boot: int = N_BOOT,
                   map_fn: tag_comparison.MapFn = map) -> Rebuilt:
  """Rewrite the run's report with its part-of-speech comparison, where a
  finished harvest with tag statistics exists: the comparison first, since
  the page reads it (its comparisons run through `map_fn`). ValueError
  naming a damaged harvest, and `run_report.NotARun` for a directory no
  run wrote."""
  comparison = write(run_path, n_boot, map_fn)
  return Rebuilt(comparison, report.write_report(run_path))
