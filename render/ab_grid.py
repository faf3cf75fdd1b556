"""The A/B grid page of a targeted run's report (SPEC §6.6 evals).

For a two-operand task every component alive on the target stream gets its
CI at the answer position over the full grid of operand values `(a, b)`,
one `[n_a, n_b]` grid per operator and CI role; the page draws a
dual-role CI's two grids side by side, each labelled by its role. The
snapshot is `report/ab_grid_data.js`, a script assigning one JSON object,
so the page `report/ab_grid.html` reads it from `file://` with no server
(browsers refuse `fetch` of local files, not `<script src>`). Both are
written atomically; each slow eval replaces the snapshot.
"""

import json
import os
import stat
from importlib import resources
from typing import Any

import numpy as np

from decompax.io import report_files

PAGE = "ab_grid.html"
DATA = "ab_grid_data.js"
# The role whose CI ranks the components: the one that decides which are
# target-alive (`evals.task_eval`).
RANKING_ROLE = "output"


def snapshot(
  step: int, operators: tuple[str, ...], grid_shape: tuple[int, int, int],
  answer_ci: dict[str, dict[str, np.ndarray]],
  alive: dict[str, np.ndarray], other_density: dict[str, np.ndarray],
) -> dict[str, Any]:
  """Return the page's data: per site the target-alive components, each
  with its mean target CI (the output role's, and per role), its
  non-target firing density and per role its CI grid `[n_ops][n_a][n_b]`
  (rounded to 1e-4), sorted by mean CI.

  `answer_ci[role][site]` is `[n_prompts, c]` in the grid's order
  (operator-major, then `a`, then `b`). The roles come output first,
  whatever order the dict holds (a jitted result's keys are sorted).
  """
  roles = sorted(answer_ci, key=lambda role: role != RANKING_ROLE)
  components = []
  for site, mask in alive.items():
    for c in np.flatnonzero(mask):
      grids = {role: np.round(answer_ci[role][site][:, c].reshape(
        grid_shape), 4) for role in roles}
      first = grids[roles[0]]
      components.append({
        "site": site, "component": int(c),
        "mean_ci": float(first.mean()),
        "role_mean_ci": {role: float(g.mean()) for role, g in grids.items()},
        "nontarget_density": float(other_density[site][c]),
        "grids": {role: g.tolist() for role, g in grids.items()}})
  components.sort(key=lambda item: -item["mean_ci"])
  return {"step": step, "operators": list(operators),
          "shape": list(grid_shape), "roles": roles,
          "sites": list(alive), "components": components}


def write(report_dir: str, data: dict[str, Any]) -> str:
  """Write the page and its data into `report_dir`; return the page."""
  text = "window.AB_GRID = " + json.dumps(data, separators=(",", ":")) + ";\n"
  report_files.save_text(os.path.join(report_dir, DATA), text)
  page = resources.files("decompax.render").joinpath(PAGE).read_text()
  return report_files.save_text(os.path.join(report_dir, PAGE), page)


class TooLarge(ValueError):
  """The snapshot is larger than a reader is willing to parse."""


def read(report_dir: str, max_bytes: int) -> dict[str, Any] | None:
  """Return the snapshot `write` left in `report_dir`, or None where there
  is none; ValueError where the file is not one, TooLarge where it holds
  more than `max_bytes`.

  Only a regular file is read: a FIFO or a device in its place (a link to
  /dev/zero) is refused, never waited on nor read without end.
  """
  path = os.path.join(report_dir, DATA)
  try:
    # Non-blocking, so that opening a FIFO does not wait for a writer.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
  except FileNotFoundError:
    return None
  with os.fdopen(fd, "rb") as f:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      raise ValueError(f"{DATA} is not a regular file")
    # Read at most one byte past the limit: the file may grow meanwhile.
    raw = f.read(max_bytes + 1)
  if len(raw) > max_bytes:
    raise TooLarge(f"{DATA} is over {max_bytes} bytes")
  text = raw.decode("utf-8").strip()
  prefix = "window.AB_GRID = "
  if not text.startswith(prefix) or not text.endswith(";"):
    raise ValueError(f"{DATA} is not a `{prefix}{{…}};` script")
  return json.loads(text[len(prefix):-1])
