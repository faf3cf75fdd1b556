"""The files a report is made of: figures' PNGs and pages' text, each
written atomically and recorded as the run's (`run_dir.write_run_file`).

Drawing figures and building pages are `decompax.render`'s, pure up to the
bytes; these functions only put them on disk. A figure is a matplotlib
`Figure`, encoded as PNG straight into the temporary file.
"""

import contextlib
import os

from matplotlib.figure import Figure

from decompax.io import run_dir


def make_dirs(directory: run_dir.Path) -> str:
  """Return `directory` after making it and its missing parents."""
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  return directory


def save_png(fig: Figure, path: run_dir.Path, dpi: int,
              parents: bool = True) -> str:
  """Return `path` after writing `fig` there as a PNG, recorded as the run's.

  `parents=False` makes one directory level at most: a render that outlives
  its run then fails instead of recreating the deleted run directory.
  """
  path = os.fspath(path)
  directory = os.path.dirname(os.path.abspath(path))
  if parents:
    os.makedirs(directory, exist_ok=True)
  else:
    with contextlib.suppress(FileExistsError):
      os.mkdir(directory)
  return run_dir.write_run_file(
    path, lambda f: fig.savefig(f, format="png", dpi=dpi))


def save_loose_png(fig: Figure, path: run_dir.Path, dpi: int) -> str:
  """Return `path` after writing `fig` there as a PNG into an existing
  directory, any, not only a run's: nothing is recorded beside it."""
  return run_dir.atomic_write(
    path, lambda f: fig.savefig(f, format="png", dpi=dpi))


def save_text(path: run_dir.Path, text: str) -> str:
  """Return `path` after writing `text` there (UTF-8), recorded as the
  run's, its directory made where missing."""
  path = os.fspath(path)
  make_dirs(os.path.dirname(os.path.abspath(path)))
  data = text.encode("utf-8")
  return run_dir.write_run_file(path, lambda f: f.write(data))
