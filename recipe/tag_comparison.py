"""Components against neurons, by part of speech, from a finished harvest
(`docs/tag_profiles.md`).

A harvest over a tagged token file holds every site's tag statistics of
its components and, per layer whose MLP has a decomposed site, those of
the MLP's neurons, gates and rotated neurons (`recipe/harvest.py`). Here a
site's alive components (those that fired over the harvest) are compared
with each baseline of the site's layer, and all MLP sites' components
together with all those layers' baselines (the total).
"""

from typing import NamedTuple

import numpy as np

from decompax.losses import tag_metrics, tag_profile
from decompax.recipe import harvest as harvest_lib
from decompax.targets import glu_lm

TOTAL = "total"


class Row(NamedTuple):
  """One comparison: a site's (or the total's) components against one
  baseline."""

  site: str
  baseline: str  # a `harvest.BASELINES` kind
  comparison: tag_metrics.Comparison


def tag_stats(fields: dict[str, np.ndarray]) -> tag_profile.TagStats:
  """Return the tag statistics of one store key's harvested fields."""
  return tag_profile.TagStats(*(fields[f] for f in harvest_lib.TAG_FIELDS))


def alive_components(fields: dict[str, np.ndarray]) -> tag_profile.TagStats:
  """Return a site's tag statistics restricted to the components that
  fired (CI above the harvest's threshold) at least once."""
  return tag_profile.select_units(tag_stats(fields), fields["fired"] > 0)


def mlp_layer(site: str) -> int | None:
  """Return the layer of an MLP site (None for any other site)."""
  parsed = glu_lm.parse_site(site)
  if parsed is None or parsed[1] not in ("gate", "up", "down"):
    return None
  return parsed[0]


def comparisons(harvest: harvest_lib.Harvest, seed: int = 0,
                n_boot: int = 1000) -> list[Row]:
  """Return, per MLP site and baseline kind, then for the total, the
  comparison of components against that baseline; ValueError for a
  harvest without tag statistics."""
  if "tags" not in harvest.manifest:
    raise ValueError("the harvest has no tag statistics: harvest a token "
                     "file with a tag stream (bin/prepare_brown writes one)")
  rows, mine, theirs = [], [], {kind: [] for kind in harvest_lib.BASELINES}
  layers = []
  for site, fields in harvest.sites.items():
    layer = mlp_layer(site)
    if layer is None or f"layers.{layer}.mlp.neurons" not in harvest.baselines:
      continue
    components = alive_components(fields)
    mine.append(components)
    for kind in harvest_lib.BASELINES:
      units = tag_stats(harvest.baselines[f"layers.{layer}.mlp.{kind}"])
      rows.append(Row(site, kind, tag_metrics.compare(
        components, units, seed, n_boot)))
    if layer not in layers:
      layers.append(layer)
      for kind in harvest_lib.BASELINES:
        theirs[kind].append(
          tag_stats(harvest.baselines[f"layers.{layer}.mlp.{kind}"]))
  if mine:
    total = tag_profile.concat_units(mine)
    for kind in harvest_lib.BASELINES:
      rows.append(Row(TOTAL, kind, tag_metrics.compare(
        total, tag_profile.concat_units(theirs[kind]), seed, n_boot)))
  return rows
