"""Run figures: CI patterns on one-hot features, U/V factors, loss curves,
and a prompt's attribution graph.

Figures are built on `matplotlib.figure.Figure` directly, never pyplot, so no
GUI backend or global figure registry is involved and plotting is safe from
any thread. Each plot function draws its figure and hands it to
`io.report_files`, which writes one small PNG atomically; it returns the
PNG's path. The PNG's directory is created if its own parent exists, so a
deleted run directory is never recreated.

Per site, `ci` is `[n_features, c]`: the causal importance of every component
(column) on the one-hot input of every feature (row). `v` is `[d_in, c]` and
`u` is `[c, d_out]`, as in `decompax.core.sites.Factors` without the layer
axis.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import matplotlib
import numpy as np
from jaxtyping import Float
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.collections import LineCollection, PathCollection
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from decompax.core.target import Expected
from decompax.io import report_files, run_dir
from decompax.measures import probe

_DPI = 100
# Beyond this many columns, ticks show positions instead of component ids.
_MAX_LABELLED_COLUMNS = 16


def _save_png(fig: Figure, path: run_dir.Path) -> str:
  # One level only: a render that outlives its run fails instead of
  # recreating the deleted run directory.
  return report_files.save_png(fig, path, _DPI, parents=False)


def _panel_width(n_cols: int) -> float:
  # Wide enough to tell columns apart for small C, capped so C=1000 stays cheap.
  return min(max(1.5 + 0.08 * n_cols, 3.0), 10.0)


def _heatmap(
  fig: Figure,
  ax: Axes,
  image: Float[np.ndarray, "h w"],
  columns: Sequence[int],
  **style: Any,
) -> None:
  """Draw `image` with a colorbar; x ticks name the original columns."""
  mappable = ax.imshow(
    image, aspect="auto", interpolation="nearest", **style)
  fig.colorbar(mappable, ax=ax)
  ax.yaxis.set_major_locator(MaxNLocator(integer=True))
  if len(columns) <= _MAX_LABELLED_COLUMNS:
    ax.set_xticks(range(len(columns)), labels=[str(c) for c in columns])
  else:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_ci_on_features(
  ci_by_site: Mapping[str, np.ndarray], path: run_dir.Path, title: str,
  ylabel: str = "feature",
  expected: Mapping[str, Expected] | None = None,
) -> str:
  """Return `path` after plotting one permuted CI heatmap per site (rows:
  probe features, or token positions for a batch-mean LM CI).

  Columns follow each site's `expected` pattern (SPEC §11): the identity
  permutation, or descending column mass for dense sites; identity for
  sites it does not name.
  """
  if not ci_by_site:
    raise ValueError("plot_ci_on_features: no sites given")
  widths = [_panel_width(np.shape(ci)[1]) for ci in ci_by_site.values()]
  fig = Figure(figsize=(sum(widths), 3.2), layout="constrained")
  axes = fig.subplots(1, len(widths), squeeze=False, width_ratios=widths)[0]
  for ax, (site, ci) in zip(axes, ci_by_site.items()):
    ci = np.asarray(ci)
    vmax = max(1.0, float(np.max(ci, initial=0.0)))
    pattern = (expected or {}).get(site)
    order = probe.pattern_permutation(ci, pattern)
    _heatmap(fig, ax, ci[:, order], order,
             cmap="viridis", vmin=0.0, vmax=vmax)
    xlabel = ("component (by CI mass)" if pattern is not None
              and pattern.pattern == "dense" else "component (permuted)")
    ax.set(title=site, xlabel=xlabel, ylabel=ylabel)
  fig.suptitle(title)
  return _save_png(fig, path)


def _signed_style(image: np.ndarray) -> dict[str, Any]:
  limit = float(np.max(np.abs(image), initial=0.0)) or 1.0
  return {"cmap": "RdBu_r", "vmin": -limit, "vmax": limit}


def _plot_factors(
  fig: Figure,
  ax_v: Axes,
  ax_u: Axes,
  site: str,
  v: Float[np.ndarray, "d_in c"],
  u: Float[np.ndarray, "c d_out"],
  order: Sequence[int],
  labels: Sequence[int],
) -> None:
  v_shown = v[:, list(order)]
  # U is drawn transposed so components share the x axis with V.
  u_shown = u[list(order), :].T
  for ax, image, name, rows in (
      (ax_v, v_shown, "V", "d_in"), (ax_u, u_shown, "U^T", "d_out")):
    _heatmap(fig, ax, image, labels, **_signed_style(image))
    ax.set(title=f"{site} {name}", xlabel="component", ylabel=rows)


def plot_components(
  uv_by_site: Mapping[str, tuple[np.ndarray, np.ndarray]],
  path: run_dir.Path,
  column_order: Mapping[str, Sequence[int]] | None = None,
  column_labels: Mapping[str, Sequence[int]] | None = None,
) -> str:
  """Return `path` after plotting V and U of every site side by side.

  `column_order[site]` lists the components to show, in order (a prefix such
  as the alive components is fine); sites without one show all components.
  `column_labels[site]` names the shown columns (default: their indices),
  e.g. the original ids of factors that were already gathered.
  """
  if not uv_by_site:
    raise ValueError("plot_components: no sites given")
  column_order = column_order or {}
  orders = {site: list(column_order.get(site, range(np.shape(v)[1])))
            for site, (v, _) in uv_by_site.items()}
  width = 2 * _panel_width(max(max(len(o), 1) for o in orders.values()))
  fig = Figure(figsize=(width, 2.6 * len(uv_by_site)), layout="constrained")
  axes = fig.subplots(len(uv_by_site), 2, squeeze=False)
  for (ax_v, ax_u), (site, (v, u)) in zip(axes, uv_by_site.items()):
    labels = list((column_labels or {}).get(site, orders[site]))
    _plot_factors(fig, ax_v, ax_u, site, np.asarray(v), np.asarray(u),
                  orders[site], labels)
  return _save_png(fig, path)


def _series(
  metrics: Sequence[Mapping[str, Any]], key: str
) -> tuple[list[float], list[float]]:
  """Return the steps and values of `key`, keeping what log scale can show."""
  points = [(r["step"], r[key]) for r in metrics if "step" in r and key in r]
  points = [(float(s), float(v)) for s, v in points
            if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
  return [s for s, _ in points], [v for _, v in points]


def plot_loss_curves(
  metrics: Sequence[Mapping[str, Any]], path: run_dir.Path
) -> str:
  """Return `path` after plotting every `loss/*` metric against `step`."""
  keys = sorted({k for r in metrics for k in r if k.startswith("loss/")})
  fig = Figure(figsize=(6.0, 3.6), layout="constrained")
  ax = fig.subplots()
  for key in keys:
    steps, values = _series(metrics, key)
    if steps:
      ax.plot(steps, values, label=key, linewidth=1.0)
  ax.set(yscale="log", xlabel="step", ylabel="loss")
  if ax.lines:
    ax.legend(fontsize="small")
  else:
    ax.text(0.5, 0.5, "no positive loss/ metrics", ha="center",
            transform=ax.transAxes)
  return _save_png(fig, path)


def _site_grid(n_rows: int, n_sites: int, width: float = 3.4,
               height: float = 2.6) -> tuple[Figure, np.ndarray]:
  # Fixed margins instead of a layout engine: constrained layout redraws
  # the figure several times, which doubles the cost of these grids.
  fig = Figure(figsize=(width * n_sites, height * n_rows))
  fig.subplots_adjust(left=0.95 / (width * n_sites), right=0.98,
                      bottom=0.75 / (height * n_rows),
                      top=1 - 0.3 / (height * n_rows), wspace=0.45,
                      hspace=0.7)
  return fig, fig.subplots(n_rows, n_sites, squeeze=False)


def _plot_counts(ax: Axes, edges: np.ndarray, counts: np.ndarray,
                 title: str, xlabel: str) -> None:
  """Bar-plot `[below, bins…, above]` counts on `edges`, log count axis."""
  counts = np.asarray(counts, np.float64)
  inside = counts[1:-1]
  ax.stairs(np.maximum(inside, 0.5), edges, fill=True, baseline=0.5)
  outside = []
  if counts[0]:
    outside.append(f"<{edges[0]:g}: {int(counts[0])}")
  if counts[-1]:
    outside.append(f">{edges[-1]:g}: {int(counts[-1])}")
  if outside:
    xlabel += f"\n(outside: {', '.join(outside)})"
  ax.set(title=title, xlabel=xlabel, ylabel="count", yscale="log")


def _role_label(label: str, role: str) -> str:
  # A dual-role CI function's figures come in pairs that differ only here;
  # in the axis labels, since long site names already fill the titles.
  return f"{role}-role {label}" if role else label


def plot_ci_histograms(
  lower: Mapping[str, np.ndarray], lower_edges: np.ndarray,
  pre: Mapping[str, np.ndarray], pre_edges: np.ndarray, path: run_dir.Path,
  role: str = "",
) -> str:
  """Return `path` after plotting per site the histograms of lower CI (top
  row) and CI pre-activations (bottom row) from `[below, bins…, above]`
  counts; a CI `role` given is named in every panel's axis label."""
  if not lower:
    raise ValueError("plot_ci_histograms: no sites given")
  fig, axes = _site_grid(2, len(lower))
  for col, site in enumerate(lower):
    _plot_counts(axes[0, col], lower_edges, lower[site], site,
                 _role_label("CI (lower)", role))
    _plot_counts(axes[1, col], pre_edges, pre[site], site,
                 _role_label("CI pre-activation", role))
  return _save_png(fig, path)


def plot_component_density(
  density: Mapping[str, np.ndarray], mean_ci: Mapping[str, np.ndarray],
  path: run_dir.Path, threshold: float,
) -> str:
  """Return `path` after plotting per site each component's firing density
  (fraction of positions with CI above `threshold`, top) and mean CI
  (bottom), components sorted by density."""
  if not density:
    raise ValueError("plot_component_density: no sites given")
  fig, axes = _site_grid(2, len(density))
  for col, site in enumerate(density):
    order = np.argsort(-np.asarray(density[site]), kind="stable")
    ranks = np.arange(len(order))
    ax = axes[0, col]
    ax.bar(ranks, np.maximum(np.asarray(density[site])[order], 1e-12),
           width=1.0)
    ax.set(title=site, yscale="log", ylim=(1e-6, 1.5),
           ylabel=f"P(CI > {threshold:g})", xlabel="component (by density)")
    ax = axes[1, col]
    ax.bar(ranks, np.asarray(mean_ci[site])[order], width=1.0)
    ax.set(ylabel="mean CI", xlabel="component (by density)", ylim=(0, 1))
  return _save_png(fig, path)


def plot_log_density(
  counts: Mapping[str, np.ndarray], floor: float, path: run_dir.Path,
  role: str = "",
) -> str:
  """Return `path` after plotting per site the share of positions in each
  log-spaced CI band (`[C, 1 + n_bands]` counts, column 0 below `floor`),
  components sorted by their mean band; a CI `role` given is named in every
  panel's axis label."""
  if not counts:
    raise ValueError("plot_log_density: no sites given")
  fig, axes = _site_grid(1, len(counts), width=3.8, height=3.2)
  axes = axes[0]
  for ax, (site, table) in zip(axes, counts.items()):
    table = np.asarray(table, np.float64)
    share = table / np.maximum(table.sum(axis=1, keepdims=True), 1.0)
    order = np.argsort(-(share * np.arange(share.shape[1])).sum(1),
                       kind="stable")
    image = np.log10(np.maximum(share[order].T, 1e-7))
    mappable = ax.imshow(image, aspect="auto", origin="lower",
                         interpolation="nearest", cmap="magma", vmin=-7, vmax=0)
    fig.colorbar(mappable, ax=ax, label="log10 share of positions")
    n_bands = share.shape[1] - 1
    # Row k >= 1 is the band starting at floor^(1 − (k−1)/n_bands).
    rows = sorted({int(r) for r in np.linspace(n_bands / 4, n_bands, 4)})
    labels = [f"{floor ** (1 - (r - 1) / n_bands):.0e}" for r in rows]
    ax.set_yticks([0, *rows], labels=[f"<{floor:.0e}", *labels])
    ax.set(title=site, xlabel="component (by mean band)",
           ylabel=_role_label("CI band", role))
  return _save_png(fig, path)


def _curve_label(key: str, prefixes: tuple[str, ...]) -> str:
  for prefix in prefixes:
    if key.startswith(prefix):
      return key[len(prefix):] or key
  return key


def plot_metric_curves(
  metrics: Sequence[Mapping[str, Any]], prefix: str | tuple[str, ...],
  path: run_dir.Path, ylabel: str, log: bool = True,
) -> str:
  """Return `path` after plotting every metric named `prefix*` (one of the
  prefixes, when a tuple) against step, labelled without its prefix."""
  prefixes = (prefix,) if isinstance(prefix, str) else tuple(prefix)
  keys = sorted({k for r in metrics for k in r if k.startswith(prefixes)})
  fig = Figure(figsize=(4.3, 3.0))
  fig.subplots_adjust(left=0.2, right=0.97, bottom=0.15, top=0.95)
  ax = fig.subplots()
  for key in keys:
    points = [(float(r["step"]), float(r[key])) for r in metrics
              if "step" in r and isinstance(r.get(key), (int, float))
              and math.isfinite(r[key]) and (r[key] > 0 or not log)]
    if points:
      steps, values = zip(*points)
      ax.plot(steps, values, label=_curve_label(key, prefixes), linewidth=1.0,
              marker="." if len(points) < 30 else None)
  ax.set(xlabel="step", ylabel=ylabel, yscale="log" if log else "linear")
  if ax.lines:
    ax.legend(fontsize="small")
  else:
    ax.text(0.5, 0.5, f"no {' or '.join(prefixes)} metrics yet", ha="center",
            transform=ax.transAxes)
  return _save_png(fig, path)


# Attribution graphs, as `analysis.attribution.graph_json` gives them: node 0
# the output logit, `site == "logit"`; edges name their nodes by index.
_LOGIT = "logit"
# Edge colours by sign (raises the target, lowers it) and the widest edge.
_RAISES, _LOWERS, _MAX_EDGE_WIDTH = "#2166ac", "#b2182b", 4.0
# Share of a position's width its nodes of one site spread over.
_CELL = 0.8


class GraphArtists(NamedTuple):
  """What `draw_attribution_graph` drew: one marker per node (offsets in
  node order) and one line per edge (drawn by |weight|, weakest first)."""

  nodes: PathCollection
  edges: LineCollection


def graph_layout(nodes: Sequence[Mapping[str, Any]], sites: Sequence[str]
                 ) -> Float[np.ndarray, "n 2"]:
  """Return each node's (x, y): x its position, y its site's index in
  `sites` (the output one above the last), nodes sharing a site and
  position spread over `_CELL` of the position in component order."""
  row = {site: i for i, site in enumerate(sites)} | {_LOGIT: len(sites)}
  cells: dict[tuple[int, int], list[int]] = {}
  for i, node in enumerate(nodes):
    if node["site"] not in row:
      raise ValueError(f"node {i}'s site {node['site']!r} is not one of "
                       f"the sites given ({list(sites)})")
    cells.setdefault((row[node["site"]], node["position"]), []).append(i)
  xy = np.zeros((len(nodes), 2))
  for (y, position), members in cells.items():
    members.sort(key=lambda i: nodes[i]["component"])
    step = _CELL / len(members)
    for k, i in enumerate(members):
      xy[i] = (position + (k - (len(members) - 1) / 2) * step, y)
  return xy


def _edge_lines(edges: Sequence[Mapping[str, Any]],
                xy: Float[np.ndarray, "n 2"]) -> LineCollection:
  """Return the edges as lines, width ∝ |weight| (the widest
  `_MAX_EDGE_WIDTH`), coloured by sign, weakest first so the strong lie
  on top."""
  weight = np.asarray([e["weight"] for e in edges], np.float64)
  order = np.argsort(np.abs(weight), kind="stable")
  largest = float(np.max(np.abs(weight), initial=0.0)) or 1.0
  segments = [(xy[edges[i]["source"]], xy[edges[i]["target"]])
              for i in order]
  return LineCollection(
    segments, linewidths=_MAX_EDGE_WIDTH * np.abs(weight[order]) / largest,
    colors=[_RAISES if weight[i] > 0 else _LOWERS for i in order],
    alpha=0.7, zorder=1)


def _n_positions(nodes: Sequence[Mapping[str, Any]]) -> int:
  """Return the positions a graph's x axis spans: up to its last node's."""
  return max([n["position"] for n in nodes], default=0) + 1


def draw_attribution_graph(
  ax: Axes, graph: Mapping[str, Any], sites: Sequence[str],
  labels: Sequence[str] | None = None,
) -> GraphArtists:
  """Draw an attribution graph on `ax` and return its artists: positions
  on x (ticks `labels[p]` under each position where given), `sites` in
  forward order up y with the output logit at the top, a node per alive
  component (coloured by its CI) and an edge per graph edge."""
  nodes, edges = graph["nodes"], graph["edges"]
  xy = graph_layout(nodes, sites)
  lines = ax.add_collection(_edge_lines(edges, xy))
  ci = [n["ci"] if n["ci"] is not None else 1.0 for n in nodes]
  colours = [(0, 0, 0, 1) if n["site"] == _LOGIT else c for n, c in
             zip(nodes, matplotlib.colormaps["viridis"](np.clip(ci, 0, 1)))]
  markers = ax.scatter(xy[:, 0], xy[:, 1], s=14, c=colours, zorder=2,
                       linewidths=0)
  positions = range(_n_positions(nodes))
  ax.set_xticks(list(positions), labels=[
    f"{p}\n{labels[p]}" if labels is not None else str(p)
    for p in positions])
  ax.set_yticks(range(len(sites) + 1),
                labels=[*sites, f"logit of {graph['token']}"])
  ax.set(xlim=(-0.6, len(positions) - 0.4), ylim=(-0.6, len(sites) + 0.6),
         xlabel="position")
  ax.legend(handles=[Line2D([], [], color=_RAISES, label="raises"),
                     Line2D([], [], color=_LOWERS, label="lowers")],
            loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
  return GraphArtists(markers, lines)


def plot_attribution_graph(
  graph: Mapping[str, Any], sites: Sequence[str], path: run_dir.Path,
  labels: Sequence[str] | None = None, title: str = "",
) -> str:
  """Return `path` after drawing `graph` (`draw_attribution_graph`), sized
  to its positions and sites, written atomically into an existing
  directory (any, not only a run's: nothing is recorded beside it)."""
  n_positions = _n_positions(graph["nodes"])
  fig = Figure(figsize=(max(6.0, 2.5 + 0.45 * n_positions),
                        1.5 + 0.5 * (len(sites) + 1)), layout="constrained")
  ax = fig.subplots()
  draw_attribution_graph(ax, graph, sites, labels)
  fig.colorbar(ScalarMappable(Normalize(0, 1), "viridis"), ax=ax,
               label="node CI", shrink=0.6, location="right")
  ax.set_title(title or f"attribution graph: {len(graph['nodes'])} nodes, "
               f"{len(graph['edges'])} edges")
  return report_files.save_loose_png(fig, path, _DPI)
