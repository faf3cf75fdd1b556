"""The report's part-of-speech section: components against neurons
(`docs/tag_profiles.md`), stored as `report/tag_comparison.json` beside the
page with its figure `report/tag_purity.png` (`analysis/tag_summary.py`
computes both from a tagged harvest), and rendered here as HTML.

Per site and for the total, per baseline (neurons, gates, rotated
neurons, heads), weighted by activity and unweighted: median purity, the
share of units with purity ≥ 0.8 and ≥ 0.5, mean lift, each with the
difference components − baseline and its bootstrap interval over
documents; a verdict per measure (higher, lower, or no clear difference:
the interval straddles zero); and per coarse class the units that hold
90% of its activity. The MLP baselines include the neurons matched to each
site (`density_matched`, `top_k`). Where the comparison has them (harvests
with context statistics), per site and unit set: the context measure
(purity against token-implied purity, and their difference, the excess)
and the robust summaries (unweighted and weighted median purity, the
share of activity at purity ≥ 0.5, each with its bootstrap interval, the
always-on units counted apart), with each site's q and k.
"""

import html
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from decompax.io import report_files

FILE = "tag_comparison.json"
FIGURE = "tag_purity.png"
# The measures of a row, as the table heads them.
MEASURES = (("median_purity", "median purity"),
            ("share_pure", "share ≥ 0.8"),
            ("share_mostly_pure", "share ≥ 0.5"),
            ("mean_lift", "mean lift"))
# The figure's colours per unit set, components first.
COLOURS = {"components": "#c0392b", "neurons": "#2471a3", "gates": "#7d3c98",
           "rotated": "#7f8c8d", "heads": "#229954",
           "density_matched": "#5dade2", "top_k": "#f5b041"}
# The robust summaries, as the table heads them.
ROBUST = (("median_purity", "median purity"),
          ("weighted_median_purity", "weighted median purity"),
          ("activity_share_mostly_pure", "activity share at purity ≥ 0.5"))
BINS = 20
PANELS_PER_ROW = 4


def write(directory: str, record: Mapping[str, Any]) -> str:
  """Return the path of the comparison after writing it atomically into
  the report's `directory`."""
  return report_files.save_text(os.path.join(directory, FILE),
                                 json.dumps(record))


def read(directory: str) -> dict | None:
  """Return the comparison stored in the report's `directory` (None where
  there is none)."""
  path = os.path.join(directory, FILE)
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def verdict(interval: Sequence[float | None]) -> str:
  """Return what a difference components − baseline says: `higher` when
  its interval lies above zero, `lower` below, else `unclear`."""
  _, low, high = interval
  if low is not None and low > 0:
    return "higher"
  if high is not None and high < 0:
    return "lower"
  return "unclear"


def _number(x: float | None, digits: int = 3) -> str:
  return "n/a" if x is None else f"{x:.{digits}g}"


def _measure_cells(row: Mapping[str, Any], weighting: str) -> str:
  cells = []
  for name, _ in MEASURES:
    mine = row["components"][weighting][name]
    theirs = row["units"][weighting][name]
    estimate, low, high = row["difference"][weighting][name]
    said = verdict(row["difference"][weighting][name])
    cells.append(
      f"<td>{_number(mine)}</td><td>{_number(theirs)}</td>"
      f"<td class='{said}'>{_number(estimate)} [{_number(low)}, "
      f"{_number(high)}]</td>")
  return "".join(cells)


def _sentence(row: Mapping[str, Any]) -> str:
  """Return the row's verdict as a sentence (weighted measures)."""
  said = {name: verdict(row["difference"]["weighted"][name])
          for name, _ in MEASURES}
  higher = [label for name, label in MEASURES if said[name] == "higher"]
  lower = [label for name, label in MEASURES if said[name] == "lower"]
  parts = []
  if higher:
    parts.append("components higher by " + ", ".join(higher))
  if lower:
    parts.append(f"{row['baseline']} higher by " + ", ".join(lower))
  if not parts:
    return "no clear difference"
  return "; ".join(parts)


def _interval_cell(interval: Sequence[float | None]) -> str:
  estimate, low, high = interval
  return (f"<td>{_number(estimate)} [{_number(low)}, {_number(high)}]"
          "</td>")


def context_html(record: Mapping[str, Any]) -> str:
  """Return the tables of the context measure and the robust summaries
  ("" for a comparison without them)."""
  if not record.get("context"):
    return ""
  esc = lambda v: html.escape(str(v), quote=True)  # noqa: E731
  calibration = record.get("calibration", {})
  context, robust = [], []
  for site, sets in record["context"].items():
    c = calibration.get(site, {})
    matched = (f"q {_number(c.get('q'))}, k {c.get('k')}" if c else "")
    for name, row in sets.items():
      lead = f"<tr><td>{esc(site)}</td><td>{esc(name)}</td>"
      context.append(
        f"{lead}<td>{row['units']}</td><td>{_number(row['purity'])}</td>"
        f"<td>{_number(row['implied_purity'])}</td>"
        f"<td>{_number(row['excess'])}</td>"
        f"<td>{_number(row['median_excess'])}</td><td>{esc(matched)}</td>"
        "</tr>")
      robust.append(
        f"{lead}<td>{row['robust_units']}</td><td>{len(row['always_on'])}"
        f" ({_number(row['always_on_share'])})</td>" + "".join(
          _interval_cell(row["robust"][n]) for n, _ in ROBUST) + "</tr>")
  return (
    "<h3>Context: purity against token-implied purity</h3><p>A unit's "
    "<i>token-implied purity</i> is the purity of the class profile its "
    "activity would have if at each position it spread over the classes "
    "as that token does over all harvested positions; the <i>excess</i> "
    "is purity − token-implied purity (about 0: the unit tells no more "
    "than its token). Means weighted by activity; q, k: the density-"
    "matched neurons' share of positions and the top-k neurons' k.</p>"
    "<table class=tags><tr><th>site</th><th>units</th><th>n</th>"
    "<th>purity</th><th>token-implied</th><th>excess</th>"
    f"<th>median excess</th><th>matched</th></tr>{''.join(context)}</table>"
    "<h3>Robust summaries</h3><p>Each with its 95% bootstrap interval over "
    "documents; units on at more than 90% of positions (always on) are "
    "left out and counted apart with their share of the set's activity."
    "</p><table class=tags><tr><th>site</th><th>units</th><th>n</th>"
    "<th>always on (activity share)</th>" + "".join(
      f"<th>{esc(label)}</th>" for _, label in ROBUST)
    + f"</tr>{''.join(robust)}</table>")


def section_html(record: Mapping[str, Any], figure: str | None) -> str:
  """Return the report's section for a stored comparison; `figure` is the
  purity figure's relative path (None: not drawn)."""
  esc = lambda v: html.escape(str(v), quote=True)  # noqa: E731
  heads = "".join(f"<th colspan=3>{esc(label)}<br>comp. · base · Δ "
                  "[95%]</th>" for _, label in MEASURES)
  body = []
  for row in record["rows"]:
    for weighting in ("weighted", "unweighted"):
      body.append(
        f"<tr><td>{esc(row['site'])}</td><td>{esc(row['baseline'])}</td>"
        f"<td>{weighting}</td><td>{row['components'][weighting]['units']} · "
        f"{row['units'][weighting]['units']}</td>"
        f"{_measure_cells(row, weighting)}</tr>")
  verdicts = "".join(
    f"<li><b>{esc(r['site'])}</b> against {esc(r['baseline'])}: "
    f"{esc(_sentence(r))}</li>" for r in record["rows"])
  classes = record["classes"]
  coverage = "".join(
    f"<tr><td>{esc(r['site'])}</td><td>{esc(r['baseline'])}</td>" + "".join(
      f"<td>{a} · {b}</td>" for a, b in zip(
        r["components"]["weighted"]["coverage"],
        r["units"]["weighted"]["coverage"])) + "</tr>"
    for r in record["rows"])
  picture = (f"<figure><img src=\"{esc(figure)}\" alt=\"purity "
             "distributions\"><figcaption>Purity of every unit with "
             "activity, per site: components against the baselines of its "
             "layer</figcaption></figure>" if figure else "")
  return (
    "<h2>Part of speech: components against neurons</h2>"
    f"<p>Over the harvest's {record['positions']} positions of "
    f"{record['documents']} documents. A unit's <i>purity</i> is its top "
    "coarse class's share of its activity (a component's CI; a neuron's "
    "positive activation), its <i>lift</i> that purity over the class's "
    "share of all positions. Components: those that fired. Weighted: each "
    "unit counts by its share of the set's activity; unweighted: once. Δ is "
    "components − baseline with a 95% percentile interval from "
    f"{record['n_boot']} bootstrap resamples of the documents; "
    "<span class=higher>green</span>: the interval lies above zero, "
    "<span class=lower>red</span>: below.</p>"
    f"<h3>Verdict (weighted)</h3><ul>{verdicts}</ul>"
    f"<table class=tags><tr><th>site</th><th>baseline</th><th>weighting</th>"
    f"<th>units<br>comp. · base</th>{heads}</tr>{''.join(body)}</table>"
    "<h3>Units holding 90% of each class's activity (comp. · base)</h3>"
    "<table class=tags><tr><th>site</th><th>baseline</th>" + "".join(
      f"<th>{esc(c)}</th>" for c in classes) + f"</tr>{coverage}</table>"
    f"{context_html(record)}{picture}")


STYLE = """
.tags td.higher, span.higher { background: #d5f5d5; }
.tags td.lower, span.lower { background: #f8d7d7; }
"""


def plot_purities(record: Mapping[str, Any], path: str) -> str:
  """Draw the purity distribution of each unit set per site, components
  beside the baselines (a histogram each, as a share of its units), one
  panel per site, four to a row; return the PNG's path."""
  sites = list(record["purities"])
  cols = min(max(len(sites), 1), PANELS_PER_ROW)
  rows = max(-(-len(sites) // cols), 1)
  fig = Figure(figsize=(4.0 * cols, 3.2 * rows))
  edges = np.linspace(0, 1, BINS + 1)
  for i, site in enumerate(sites):
    ax = fig.add_subplot(rows, cols, i + 1)
    sets = record["purities"][site]
    width = (edges[1] - edges[0]) / (len(sets) + 0.5)
    for j, (name, values) in enumerate(sets.items()):
      counts, _ = np.histogram(values, edges)
      share = counts / max(len(values), 1)
      ax.bar(edges[:-1] + j * width, share, width, align="edge",
             color=COLOURS.get(name, "#999999"),
             label=f"{name} ({len(values)})")
    ax.set_title(site, fontsize=8)
    ax.set_xlabel("purity (top class's share)")
    ax.set_xlim(0, 1)
    if i % cols == 0:
      ax.set_ylabel("share of units")
    ax.legend(fontsize=6)
  fig.tight_layout()
  return report_files.save_png(fig, path, dpi=100)
