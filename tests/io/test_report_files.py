"""The report's files (io/report_files.py): PNGs and text written
atomically, recorded as the run's, their directories made as asked."""

import os

import numpy as np
import pytest
from matplotlib.figure import Figure
from PIL import Image

from decompax.io import report_files, run_dir


def _figure() -> Figure:
  fig = Figure(figsize=(1.0, 0.5))
  fig.add_subplot().plot([0, 1], [1, 0])
  return fig


def _recorded(directory) -> list[str]:
  with open(os.path.join(directory, run_dir.RECORD_FILE),
            encoding="utf-8") as f:
    return f.read().split()


def test_save_text_writes_utf8_makes_its_directories_and_records_the_name(
    tmp_path):
  path = tmp_path / "report" / "deep" / "page.html"
  text = "ünïcode — page\n"
  assert report_files.save_text(path, text) == str(path)
  assert path.read_bytes() == text.encode("utf-8")
  assert _recorded(path.parent) == ["page.html"]
  report_files.save_text(path, "again")
  assert path.read_text() == "again"
  assert _recorded(path.parent) == ["page.html"]


def test_save_png_writes_the_figure_at_its_dpi(tmp_path):
  path = tmp_path / "figures" / "a.png"
  report_files.save_png(_figure(), path, dpi=40)
  with Image.open(path) as image:
    assert image.format == "PNG" and image.size == (40, 20)
  assert _recorded(path.parent) == ["a.png"]


def test_save_png_without_parents_makes_one_level_only(tmp_path):
  report_files.save_png(_figure(), tmp_path / "one" / "a.png", 20,
                        parents=False)
  assert (tmp_path / "one" / "a.png").is_file()
  with pytest.raises(FileNotFoundError):
    report_files.save_png(_figure(), tmp_path / "gone" / "two" / "a.png", 20,
                          parents=False)
  assert not (tmp_path / "gone").exists()


def test_save_loose_png_records_nothing_and_needs_its_directory(tmp_path):
  path = report_files.save_loose_png(_figure(), tmp_path / "g.png", 30)
  with Image.open(path) as image:
    assert np.asarray(image).shape[:2] == (15, 30)
  assert not (tmp_path / run_dir.RECORD_FILE).exists()
  with pytest.raises(FileNotFoundError):
    report_files.save_loose_png(_figure(), tmp_path / "no" / "g.png", 30)


def test_make_dirs_makes_missing_parents_and_keeps_existing(tmp_path):
  directory = tmp_path / "a" / "b"
  assert report_files.make_dirs(directory) == str(directory)
  (directory / "kept").write_text("x")
  report_files.make_dirs(directory)
  assert (directory / "kept").read_text() == "x"
