"""Tests for decompax.io.figures."""

import numpy as np
import pytest

from decompax.core.target import Expected
from decompax.io import figures

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
