"""Tests for decompax.render.figures: the figures drawn, written through
decompax.io.report_files."""

import numpy as np
import pytest

from decompax.core.target import Expected
from decompax.render import figures

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _is_png(path):
  with open(path, "rb") as f:
    return f.read(8) == _PNG_SIGNATURE


def _no_temp_files(directory):
  return not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_plot_ci_on_features_writes_png(tmp_path):
  ci = {"linear1": np.eye(3, 5, dtype=np.float32),
        "linear2": np.full((3, 2), 0.5, np.float32)}
  path = tmp_path / "figures" / "ci.png"
  assert figures.plot_ci_on_features(ci, path, "CI") == str(path)
  assert _is_png(path)
  assert _no_temp_files(path.parent)


@pytest.mark.parametrize("order", [None, {"linear1": [2, 0]}])
def test_plot_components_writes_png(tmp_path, order):
  rng = np.random.default_rng(1)
  uv = {"linear1": (rng.normal(size=(4, 3)), rng.normal(size=(3, 2))),
        "linear2": (np.zeros((2, 3)), np.zeros((3, 4)))}
  path = tmp_path / "uv.png"
  assert figures.plot_components(uv, path, order) == str(path)
  assert _is_png(path)
  assert _no_temp_files(tmp_path)


@pytest.mark.parametrize("metrics", [
  [{"step": 0, "loss/a": 1.0, "loss/b": 0.0, "lr": 1e-3},
   {"step": 1, "loss/a": 0.5, "loss/b": float("nan")},
   {"step": 2, "loss/b": 0.1}],
  [],
])
def test_plot_loss_curves_writes_png(tmp_path, metrics):
  path = tmp_path / "loss.png"
  assert figures.plot_loss_curves(metrics, path) == str(path)
  assert _is_png(path)
  assert _no_temp_files(tmp_path)


def test_eval_tier_figures_write_pngs(tmp_path):
  rng = np.random.default_rng(2)
  edges = np.linspace(0.0, 1.0, 6)
  counts = {"a": np.array([0, 5, 0, 2, 1, 9, 0]),
            "b": np.array([3, 1, 1, 1, 1, 1, 4])}
  paths = [
    figures.plot_ci_histograms(counts, edges, counts, edges,
                               tmp_path / "hist.png"),
    figures.plot_component_density(
      {"a": rng.uniform(size=5), "b": np.zeros(3)},
      {"a": rng.uniform(size=5), "b": np.zeros(3)},
      tmp_path / "density.png", 0.1),
    figures.plot_log_density({"a": rng.integers(0, 9, size=(5, 10))}, 1e-9,
                             tmp_path / "log_density.png"),
    figures.plot_metric_curves(
      [{"step": 0, "eval/recon/zero": 1.0}, {"step": 5, "eval/recon/zero": 0.5,
                                             "eval/recon/ci": 0.0}],
      "eval/recon/", tmp_path / "curves.png", "divergence"),
    figures.plot_metric_curves([], "eval/ce/", tmp_path / "empty.png", "ce",
                               log=False),
  ]
  for path in paths:
    assert _is_png(path)
  assert _no_temp_files(tmp_path)


def test_plot_components_labels_gathered_columns(tmp_path):
  uv = {"a": (np.ones((3, 2)), np.ones((2, 4)))}
  path = figures.plot_components(uv, tmp_path / "uv.png",
                                 column_labels={"a": [7, 3]})
  assert _is_png(path)


def test_a_deleted_run_directory_is_not_recreated(tmp_path):
  run = tmp_path / "run"
  with pytest.raises(FileNotFoundError):
    figures.plot_loss_curves([], run / "figures" / "losses.png")
  assert not run.exists()
  run.mkdir()  # a live run: its figures directory is made on first use
  figures.plot_loss_curves([], run / "figures" / "losses.png")
  assert _is_png(run / "figures" / "losses.png")


def test_plot_ci_on_features_takes_each_sites_expected_pattern(tmp_path):
  ci = {"linear1": np.eye(3, 5, dtype=np.float32),
        "hidden": np.tile(np.array([0.0, 1.0, 0.0, 1.0], np.float32), (3, 1))}
  path = tmp_path / "ci.png"
  assert figures.plot_ci_on_features(
    ci, path, "CI", expected={"hidden": Expected("dense", 2)}) == str(path)
  assert _is_png(path)


# An attribution graph as `attribution.graph_json` gives it.
GRAPH = {"token": 3, "position": 2, "share": 0.9, "logit": 1.0,
         "nodes": [{"site": "logit", "position": 2, "component": 3,
                    "ci": None},
                   {"site": "b", "position": 2, "component": 1, "ci": 0.9},
                   {"site": "a", "position": 0, "component": 4, "ci": 0.5},
                   {"site": "a", "position": 0, "component": 2, "ci": 1.0}],
         "edges": [{"source": 1, "target": 0, "weight": 2.0},
                   {"source": 2, "target": 1, "weight": -0.5},
                   {"source": 3, "target": 0, "weight": 1.0}]}


def test_graph_layout_puts_sites_up_and_positions_across():
  xy = figures.graph_layout(GRAPH["nodes"], ["a", "b"])
  assert xy[0].tolist() == [2, 2] and xy[1].tolist() == [2, 1]
  # Two nodes of one site and position: side by side, in component order.
  assert xy[3, 0] < 0 < xy[2, 0] and xy[2, 1] == xy[3, 1] == 0
  with pytest.raises(ValueError, match="'b' is not one of"):
    figures.graph_layout(GRAPH["nodes"], ["a"])


def test_draw_attribution_graph_draws_every_node_and_edge():
  from matplotlib.figure import Figure  # noqa: PLC0415
  ax = Figure().subplots()
  drawn = figures.draw_attribution_graph(ax, GRAPH, ["a", "b"],
                                         labels=["x", "y", "z"])
  assert len(drawn.nodes.get_offsets()) == 4
  segments = drawn.edges.get_segments()
  assert len(segments) == 3
  # Weakest first; width ∝ |weight|, the strongest the widest.
  np.testing.assert_allclose(drawn.edges.get_linewidths(),
                             [1.0, 2.0, 4.0])
  np.testing.assert_allclose(segments[-1], [[2, 1], [2, 2]])
  colours = [tuple(c[:3]) for c in drawn.edges.get_colors()]
  assert colours[0] != colours[1] == colours[2]  # the negative edge differs
  assert ax.get_yticklabels()[-1].get_text() == "logit of 3"
  assert ax.get_xticklabels()[1].get_text() == "1\ny"


def test_plot_attribution_graph_writes_png(tmp_path):
  path = tmp_path / "graph.png"
  assert figures.plot_attribution_graph(GRAPH, ["a", "b"], path) == str(path)
  assert _is_png(path)
  # Written anywhere, not as a run's file: nothing else beside it.
  assert [p.name for p in tmp_path.iterdir()] == ["graph.png"]
