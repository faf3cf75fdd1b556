"""Components against neurons, by part of speech, from a finished harvest
(`docs/tag_profiles.md`).

A harvest over a tagged token file holds every site's tag statistics of
its components and, per layer whose MLP has a decomposed site, those of
the MLP's neurons, gates and rotated neurons, and per layer with a
decomposed attention site, those of its heads
(`analysis/harvest_baselines.py`). Here a site's alive components (those
that fired over the harvest) are compared with each baseline of the site's
layer (and the neurons matched to the site itself: kept at their top-q
positions, or the k most active at each position), and, per baseline kind,
all those sites' components together with all those layers' units (the
total). `unit_sets` gives each
site's unit sets with their context statistics, where the harvest has
them, for the context measure and the robust summaries.
"""

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Optional

import numpy as np

from decompax.analysis import harvesting as harvest_lib
from decompax.analysis import harvest_baselines, harvest_settings
from decompax.measures import tag_context, tag_metrics, tag_profile
from decompax.targets import glu_weights

TOTAL = "total"


class Row(NamedTuple):
  """One comparison: a site's (or the total's) components against one
  baseline."""

  site: str
  baseline: str  # a `harvest.BASELINES` kind
  comparison: tag_metrics.Comparison


def tag_stats(fields: dict[str, np.ndarray]) -> tag_profile.TagStats:
  """Return the tag statistics of one store key's harvested fields."""
  return tag_profile.TagStats(*(fields[f] for f in harvest_settings.TAG_FIELDS))


def alive_components(fields: dict[str, np.ndarray]) -> tag_profile.TagStats:
  """Return a site's tag statistics restricted to the components that
  fired (CI above the harvest's threshold) at least once."""
  return tag_profile.select_units(tag_stats(fields), fields["fired"] > 0)


def baselines_of(site: str) -> tuple[tuple[str, str], ...]:
  """Return `(kind, store key)` of each baseline a site is compared with:
  an MLP site's layer's neurons, the neurons matched to the site
  (`SITE_BASELINES`), its layer's gates and rotated neurons (an expert's
  site's, its expert's), an attention site's layer's heads (none for
  other sites)."""
  parsed = glu_weights.parse_site(site)
  if parsed is None:
    return ()
  layer, role, _ = parsed
  if role in glu_weights.EXPERT_ROLES:
    unit = (layer, glu_weights.site_expert(site))
  elif role in ("gate", "up", "down"):
    unit = layer
  else:
    return ((harvest_settings.HEADS, f"layers.{layer}.self_attn.heads"),)
  first, *rest = harvest_settings.BASELINES
  prefix = harvest_baselines.mlp_prefix(unit)
  return ((first, f"{prefix}.{first}"),
          *((kind, f"{site}.{kind}")
            for kind in harvest_settings.SITE_BASELINES),
          *((kind, f"{prefix}.{kind}") for kind in rest))


class UnitSet(NamedTuple):
  """One of a site's unit sets (its components that fired, or a baseline)
  with its context statistics (None where the harvest has none)."""

  name: str  # "components" or a baseline kind
  stats: tag_profile.TagStats
  context: Optional[tag_context.ContextStats]


def _context(fields: dict[str, np.ndarray], keep: Any = slice(None)
             ) -> Optional[tag_context.ContextStats]:
  if not all(f in fields for f in harvest_settings.CONTEXT_FIELDS):
    return None
  return tag_context.ContextStats(*(
    fields[f][keep] for f in harvest_settings.CONTEXT_FIELDS))


def unit_sets(harvest: harvest_lib.Harvest, site: str) -> list[UnitSet]:
  """Return a site's unit sets: its components that fired, then each of
  its baselines the harvest holds (`baselines_of`)."""
  fields = harvest.sites[site]
  alive = fields["fired"] > 0
  out = [UnitSet("components", alive_components(fields),
                 _context(fields, alive))]
  for kind, key in baselines_of(site):
    if key in harvest.baselines:
      units = harvest.baselines[key]
      out.append(UnitSet(kind, tag_stats(units), _context(units)))
  return out


# How the comparisons are spread: the builtin `map` runs them one after
# another; a binary passes a thread pool's (numpy releases the GIL in the
# bootstraps' sorts and reductions), since threads are a process's policy.
MapFn = Callable[[Callable[[Any], Any], Iterable[Any]], Iterator[Any]]


def comparisons(harvest: harvest_lib.Harvest, seed: int = 0,
                n_boot: int = 1000, map_fn: MapFn = map) -> list[Row]:
  """Return, per site and baseline kind, then per kind for the total, the
  comparison of components against that baseline, each run through
  `map_fn`; ValueError for a harvest without tag statistics."""
  if "tags" not in harvest.manifest:
    raise ValueError("the harvest has no tag statistics: harvest a token "
                     "file with a tag stream (./dev data brown writes one)")
  pairs = []
  mine: dict[str, list] = {}
  theirs: dict[str, dict[str, tag_profile.TagStats]] = {}
  for site, fields in harvest.sites.items():
    keys = [(kind, key) for kind, key in baselines_of(site)
            if key in harvest.baselines]
    if not keys:
      continue
    components = alive_components(fields)
    for kind, key in keys:
      units = tag_stats(harvest.baselines[key])
      pairs.append((site, kind, components, units))
      mine.setdefault(kind, []).append(components)
      theirs.setdefault(kind, {})[key] = units
  for kind, parts in mine.items():
    pairs.append((TOTAL, kind, tag_profile.concat_units(parts),
                  tag_profile.concat_units(list(theirs[kind].values()))))
  compare = lambda pair: Row(pair[0], pair[1], tag_metrics.compare(
    pair[2], pair[3], seed, n_boot))
  return list(map_fn(compare, pairs))
