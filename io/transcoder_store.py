"""The files of `bin/train_transcoder`'s output directory, claimed as
`io/owned_dir.py` says (program `train_transcoder`):

- `transcoders.npz`: every layer's transcoder, arrays keyed
  `layers.<i>.<field>` (`w_enc`, `b_enc`, `w_dec`, `b_dec`) with the
  settings and each layer's `k` as metadata (`run_dir.save_arrays`);
- `results.json`: the evaluation's record;
- `results.md`: the same as a Markdown table.

Each is written atomically. The arrays are plain host arrays here; the
transcoder's record type is `analysis/transcoder.py`'s.
"""

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from decompax.io import run_dir

PROGRAM = "train_transcoder"
TRANSCODERS = "transcoders.npz"
RESULTS = "results.json"
TABLE = "results.md"
ENTRIES = (TRANSCODERS, RESULTS, TABLE)


def layer_arrays(params: Mapping[int, Mapping[str, Any]]
                 ) -> dict[str, np.ndarray]:
  """Return the flat arrays of every layer's fields, `layers.<i>.<f>`."""
  return {f"layers.{i}.{name}": np.asarray(a)
          for i, fields in params.items() for name, a in fields.items()}


def split_layers(arrays: Mapping[str, np.ndarray]
                 ) -> dict[int, dict[str, np.ndarray]]:
  """Return `layer_arrays`' flat arrays grouped back by layer."""
  out: dict[int, dict[str, np.ndarray]] = {}
  for key, a in arrays.items():
    _, layer, name = key.split(".", 2)
    out.setdefault(int(layer), {})[name] = a
  return dict(sorted(out.items()))


def write_transcoders(out: str, params: Mapping[int, Mapping[str, Any]],
                      meta: Mapping[str, Any]) -> str:
  """Return the path of `out/transcoders.npz` after writing it."""
  return run_dir.save_arrays(os.path.join(out, TRANSCODERS),
                             layer_arrays(params), meta)


def read_transcoders(out: str
                     ) -> tuple[dict[int, dict[str, np.ndarray]], dict]:
  """Return every layer's arrays and the metadata of
  `out/transcoders.npz`; ValueError (one line) when missing or damaged."""
  arrays, meta = run_dir.load_arrays(os.path.join(out, TRANSCODERS))
  return split_layers(arrays), meta


def write_results(out: str, record: Mapping[str, Any], table: str
                  ) -> tuple[str, str]:
  """Return the paths of `results.json` and `results.md` after writing
  them."""
  text = json.dumps(record, indent=1, allow_nan=True).encode()
  path = run_dir.atomic_write(os.path.join(out, RESULTS),
                              lambda f: f.write(text))
  return path, run_dir.atomic_write(os.path.join(out, TABLE),
                                    lambda f: f.write(table.encode()))
