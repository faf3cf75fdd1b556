"""Every unit's part-of-speech label from a tagged harvest, as the browser
and the README gallery show it (`docs/tag_profiles.md`).

A unit is a site's component or a baseline's unit (an MLP neuron, gate,
rotated neuron or attention head), its statistics under its store key in
the harvest. Its label: its top coarse class and top fine tag, each with
its purity (share of the unit's activity) and lift (purity over the
class's or tag's share of all positions), its share of the set's
activity, and its heaviest tags and (previous class, class) bigrams; in a
harvest with context statistics also its token-implied purity and the
excess of its purity over it (`measures/tag_context.py`), None elsewhere.
"""

from typing import Any

import numpy as np

from decompax.analysis import harvesting as harvest_lib
from decompax.analysis import tag_comparison
from decompax.measures import tag_context, tag_metrics, tag_profile

# Tags and bigrams listed per unit, heaviest first.
TOP = 3


def tagged(harvest: harvest_lib.Harvest) -> bool:
  """Return whether the harvest holds tag statistics."""
  return "tags" in harvest.manifest


def unit_sets(harvest: harvest_lib.Harvest) -> dict[str, dict]:
  """Return every unit set's harvested fields by store key: the sites'
  (components), then the baselines' (tag statistics only)."""
  return {**harvest.sites, **harvest.baselines}


def _number(x: float) -> float | None:
  return float(x) if np.isfinite(x) else None


def labels(harvest: harvest_lib.Harvest, key: str) -> list[dict[str, Any]]:
  """Return the label of every unit of the set `key` (a site or a baseline
  key; KeyError for neither), in unit order. A dead unit (no activity)
  has class and tag None and NaN-free fields None."""
  tags = harvest.manifest["tags"]
  names, classes = tags["tags"], tags["classes"]
  fields = unit_sets(harvest)[key]
  stats = tag_comparison.tag_stats(fields)
  p = tag_metrics.profiles(stats)
  implied, excess = _context(fields, stats)
  share = p.mass / max(float(p.mass.sum()), 1e-300)
  top_tags, tag_shares = tag_metrics.top_shares(np.asarray(stats.fine), TOP)
  before, at, bigram_shares = tag_metrics.top_bigrams(
    np.asarray(stats.bigram), TOP)
  rows = []
  for u in range(len(p.mass)):
    alive = p.top_class[u] >= 0
    rows.append({
      "unit": u, "activity": float(share[u]),
      "class": classes[p.top_class[u]] if alive else None,
      "purity": _number(p.purity[u]), "lift": _number(p.lift[u]),
      "tag": names[p.top_tag[u]] if alive else None,
      "tag_purity": _number(p.tag_purity[u]),
      "tag_lift": _number(p.tag_lift[u]),
      "implied_purity": _number(implied[u]), "excess": _number(excess[u]),
      "top_tags": [[names[t], float(s)] for t, s in
                   zip(top_tags[u], tag_shares[u]) if s > 0],
      "top_bigrams": [[classes[b], classes[a], float(s)] for b, a, s in
                      zip(before[u], at[u], bigram_shares[u]) if s > 0],
    })
  return rows


def _context(fields: dict, stats: tag_profile.TagStats
             ) -> tuple[np.ndarray, np.ndarray]:
  """Return every unit's token-implied purity and excess (NaN where the
  harvest has no context statistics)."""
  if "tag_implied" not in fields:
    nan = np.full(len(stats.fine), np.nan)
    return nan, nan
  measured = tag_context.context_purity(tag_profile.class_counts(stats),
                                        fields["tag_implied"])
  return measured.implied_purity, measured.excess


def baseline_kind(key: str) -> str:
  """Return the kind of a baseline key (`neurons`, `gates`, `rotated`,
  `heads`): its last part."""
  return key.rsplit(".", 1)[-1]
