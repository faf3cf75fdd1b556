"""A gallery of components for the README, picked by a stated rule from a
run's tagged harvest (`bin/gallery`).

The rule (`pick`): among the components that fired, keep the most active
ones, those whose share of their site's activity (summed CI) is at least
`active` of the site's mean; rank them by their excess of purity over
token-implied purity (`measures/tag_context.py`), highest first, ties by
purity (their top coarse class's share of their activity), then by
activity: a component that tells more than the token it sits on comes
before one as pure whose tokens alone explain it. Take them in that
order, at most `per_class` of each top class, until `count` are taken. A
harvest without context statistics (made before them) ranks by purity
alone, and the stated rule says so. Each entry is written as markdown
(`entry_markdown`): its site and index, its label (class, top tag,
purity, token-implied purity where known, lift) and its first `contexts`
top contexts by CI from the harvest, decoded to text with the position
where it fires in bold.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from decompax.analysis import harvesting as harvest_lib
from decompax.analysis import unit_labels

COUNT, PER_CLASS, ACTIVE, CONTEXTS = 6, 2, 1.0, 3
# Characters markdown would read as markup, escaped in context text.
_MARKUP = set("\\`*_[]<>#|~")


class Pick(NamedTuple):
  """One component of the gallery with its label."""

  site: str
  component: int
  label: dict


def rule(count: int = COUNT, per_class: int = PER_CLASS,
         active: float = ACTIVE, by_excess: bool = True) -> str:
  """Return the rule `pick` follows, as the gallery states it (ranked by
  excess over token-implied purity, or, `by_excess` false, by purity)."""
  ranked = (
    f"the {count} with the highest excess of purity (top coarse class's "
    "share of their CI) over token-implied purity (the purity their CI "
    "would have if each position's class followed its token's mix), then "
    "the purest" if by_excess else
    f"the {count} purest (top coarse class's share of their CI)")
  return (f"Among the components that fired, those with at least {active:g}"
          f"× their site's mean share of its CI, {ranked}, at most "
          f"{per_class} per class.")


def check_active(active: float) -> None:
  """Raise ValueError unless `active` is a finite multiple >= 0: NaN
  fails every comparison, so the rule would keep nothing and state
  "at least nan×"."""
  if not (math.isfinite(active) and active >= 0):
    raise ValueError(f"active must be a finite multiple >= 0 of a site's "
                     f"mean share of its CI, got {active!r}")


def pick(harvest: harvest_lib.Harvest, count: int = COUNT,
         per_class: int = PER_CLASS, active: float = ACTIVE) -> list[Pick]:
  """Return the gallery's components by `rule` (see the module
  docstring); ValueError for a harvest without tag statistics, or an
  `active` that is no multiple (negative, NaN or infinite)."""
  check_active(active)
  if not unit_labels.tagged(harvest):
    raise ValueError("the harvest has no tag statistics: harvest a token "
                     "file with a tag stream (./dev data brown writes one)")
  candidates = []
  for site, fields in harvest.sites.items():
    labels = unit_labels.labels(harvest, site)
    floor = active / len(labels)
    for c, label in enumerate(labels):
      if (fields["fired"][c] > 0 and label["class"] is not None
          and label["activity"] >= floor):
        candidates.append(Pick(site, c, label))
  excess = lambda p: p.label["excess"] if p.label["excess"] is not None \
    else -np.inf  # noqa: E731
  candidates.sort(key=lambda p: (-excess(p), -p.label["purity"],
                                 -p.label["activity"], p.site, p.component))
  taken: list[Pick] = []
  per: dict[str, int] = {}
  for p in candidates:
    if per.get(p.label["class"], 0) < per_class:
      taken.append(p)
      per[p.label["class"]] = per.get(p.label["class"], 0) + 1
    if len(taken) == count:
      break
  return taken


def _text(piece: str) -> str:
  """Return a token's text for markdown: markup escaped, line breaks as ⏎."""
  piece = piece.replace("\n", "⏎")
  return "".join("\\" + ch if ch in _MARKUP else ch for ch in piece)


def context_markdown(ids: np.ndarray, focus: int,
                     decode: Callable[[int], str]) -> str:
  """Return one context window as text, its firing token in bold (ids
  below 0, outside the window, dropped)."""
  before = "".join(_text(decode(int(i))) for i in ids[:focus] if i >= 0)
  at = _text(decode(int(ids[focus])))
  after = "".join(_text(decode(int(i))) for i in ids[focus + 1:] if i >= 0)
  # Bold cannot open or close on a space: keep the spaces outside it.
  lead = at[:len(at) - len(at.lstrip())]
  trail = at[len(at.rstrip()):]
  core = at.strip() or "␣"
  return f"…{before}{lead}**{core}**{trail}{after}…"


def entry_markdown(harvest: harvest_lib.Harvest, p: Pick,
                   decode: Callable[[int], str],
                   contexts: int = CONTEXTS) -> str:
  """Return one gallery entry as markdown: a heading line with the
  component's label, then its top contexts as a list."""
  fields = harvest.sites[p.site]
  focus = int(harvest.manifest["settings"]["before"])
  shown = [context_markdown(fields["top_context"][p.component][j], focus,
                            decode)
           for j in range(fields["top_context"].shape[1])
           if fields["top_ci"][p.component][j] > 0][:contexts]
  label = p.label
  implied = ("" if label["excess"] is None else
             f", token-implied {label['implied_purity']:.2f}")
  head = (f"**{p.site} c{p.component}** — {label['class']} · "
          f"`{label['tag']}`: purity {label['purity']:.2f}{implied}, lift "
          f"{label['lift']:.2f} (top tag {label['tag_purity']:.2f}, share "
          f"of the site's CI {label['activity']:.3f})")
  return "\n".join([head, "", *(f"- {c}" for c in shown)])


def gallery_markdown(harvest: harvest_lib.Harvest, run_name: str,
                     decode: Callable[[int], str], count: int = COUNT,
                     per_class: int = PER_CLASS, active: float = ACTIVE,
                     contexts: int = CONTEXTS) -> str:
  """Return the whole gallery: its rule, then one entry per pick."""
  picks = pick(harvest, count, per_class, active)
  by_excess = harvest_lib.has_context(harvest.manifest)
  entries = [entry_markdown(harvest, p, decode, contexts) for p in picks]
  return "\n\n".join([
    f"Gallery of `{run_name}` ({harvest.manifest['positions']} harvested "
    f"positions). {rule(count, per_class, active, by_excess)} Bold: the "
    "token where "
    "the component's CI is highest.", *entries]) + "\n"
