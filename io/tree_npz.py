"""A pytree's leaves in one `.npz` file, for small training states.

The file holds leaf `i` (in `jax.tree.leaves` order) under `leaf_{i}` and a
JSON string of metadata under `meta`; the tree's structure is the
caller's, given again as a template on reading. Written atomically: a crash
leaves the previous file.
"""

import json
import os
import zipfile
from typing import Any

import jax
import numpy as np

from decompax.io import run_dir


def save_tree(path: run_dir.Path, tree: Any, meta: dict[str, Any]) -> str:
  """Return `path` after writing `tree`'s leaves and `meta` there."""
  leaves = [np.asarray(a) for a in jax.tree.leaves(jax.device_get(tree))]
  arrays = {f"leaf_{i}": a for i, a in enumerate(leaves)}
  arrays["meta"] = np.asarray(json.dumps(meta))
  return run_dir.atomic_write(path, lambda f: np.savez(f, **arrays))


def load_tree(path: run_dir.Path, template: Any) -> tuple[Any, dict]:
  """Return the tree saved at `path` (the structure of `template`, host
  arrays) and its metadata.

  Raises:
    ValueError: an unreadable file, or leaves that do not match the
      template's count, shapes or dtypes.
  """
  path = os.fspath(path)
  leaves, treedef = jax.tree.flatten(template)
  try:
    with np.load(path) as data:
      meta = json.loads(str(data["meta"]))
      got = [data[f"leaf_{i}"] for i in range(len(leaves))]
      extra = len(data.files) - 1 - len(leaves)
  except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as e:
    raise ValueError(f"cannot read saved state {path} ({e}); delete it to"
                     " start over") from None
  if extra:
    raise ValueError(f"saved state {path} holds {extra} more arrays than"
                     " this model's state; delete it to start over")
  for i, (a, want) in enumerate(zip(got, leaves)):
    shape, dtype = tuple(want.shape), np.dtype(want.dtype)
    if a.shape != shape or a.dtype != dtype:
      raise ValueError(f"saved state {path}: array {i} is {a.dtype}"
                       f"{list(a.shape)}, the model's is {dtype}"
                       f"{list(shape)}; delete it to start over")
  return jax.tree.unflatten(treedef, got), meta
