"""Run figures: CI patterns on one-hot features, U/V factors, loss curves.

Figures are built on `matplotlib.figure.Figure` directly, never pyplot, so no
GUI backend or global figure registry is involved and plotting is safe from
any thread. Each plot function writes one small PNG atomically (the parent
directory is created if needed) and returns its path.

Per site, `ci` is `[n_features, c]`: the causal importance of every component
(column) on the one-hot input of every feature (row). `v` is `[d_in, c]` and
`u` is `[c, d_out]`, as in `decompax.core.sites.Factors` without the layer
axis.
"""

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jaxtyping import Float
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from decompax.core import probe
from decompax.io import run_dir

_DPI = 100
# Beyond this many columns, ticks show positions instead of component ids.
_MAX_LABELLED_COLUMNS = 16


def _save_png(fig: Figure, path: run_dir.Path) -> str:
  path = os.fspath(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  return run_dir.atomic_write(
    path, lambda f: fig.savefig(f, format="png", dpi=_DPI))


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
  ci_by_site: Mapping[str, np.ndarray], path: run_dir.Path, title: str
) -> str:
  """Return `path` after plotting one permuted CI heatmap per site."""
  if not ci_by_site:
    raise ValueError("plot_ci_on_features: no sites given")
  widths = [_panel_width(np.shape(ci)[1]) for ci in ci_by_site.values()]
  fig = Figure(figsize=(sum(widths), 3.2), layout="constrained")
  axes = fig.subplots(1, len(widths), squeeze=False, width_ratios=widths)[0]
  for ax, (site, ci) in zip(axes, ci_by_site.items()):
    ci = np.asarray(ci)
    vmax = max(1.0, float(np.max(ci, initial=0.0)))
    order = probe.identity_permutation(ci)
    _heatmap(fig, ax, ci[:, order], order,
             cmap="viridis", vmin=0.0, vmax=vmax)
    ax.set(title=site, xlabel="component (permuted)", ylabel="feature")
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
) -> None:
  v_shown = v[:, list(order)]
  # U is drawn transposed so components share the x axis with V.
  u_shown = u[list(order), :].T
  for ax, image, name, rows in (
      (ax_v, v_shown, "V", "d_in"), (ax_u, u_shown, "U^T", "d_out")):
    _heatmap(fig, ax, image, order, **_signed_style(image))
    ax.set(title=f"{site} {name}", xlabel="component", ylabel=rows)


def plot_components(
  uv_by_site: Mapping[str, tuple[np.ndarray, np.ndarray]],
  path: run_dir.Path,
  column_order: Mapping[str, Sequence[int]] | None = None,
) -> str:
  """Return `path` after plotting V and U of every site side by side.

  `column_order[site]` lists the components to show, in order (a prefix such
  as the alive components is fine); sites without one show all components.
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
    _plot_factors(
      fig, ax_v, ax_u, site, np.asarray(v), np.asarray(u), orders[site])
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
