"""A harvest's files: `<run_dir>/harvest/` (`analysis/harvesting.py`).

One zarr array per site (or baseline key) and statistic, `<key>/<field>`;
`manifest.json`, written last, marks the harvest complete. An unfinished
harvest keeps its running totals and its next batch in `state.npz`, beside
the settings that make two harvests the same harvest (a dict: resuming
compares them). Every file is written atomically, and every removal is one
this module makes: a state a finished harvest no longer needs, a
half-written array of a killed harvest, a harvest replaced on `overwrite`,
a killed writer's temporaries. `clusters.json`, the clusters of a finished
harvest's components, is written beside them, also atomically.
"""

import json
import os
from collections.abc import Callable

import numpy as np

from decompax.io import run_dir, tensor_store

HARVEST_DIR = "harvest"
STATE_FILE = "state.npz"
MANIFEST = "manifest.json"
# Clusters of the harvest's components (`analysis/clustering.py`), beside
# it: a harvest's own files never depend on it.
CLUSTERS = "clusters.json"


class HarvestConflict(ValueError):
  """The output directory holds a harvest made with other settings (or
  one whose record cannot be read)."""


def state_path(out: str) -> str:
  return os.path.join(out, STATE_FILE)


def _flat(totals: dict) -> dict[str, np.ndarray]:
  return {f"{site}/{field}": value for site, fields in totals.items()
          for field, value in fields.items()}


def save_state(out: str, totals: dict, done: int, settings: dict) -> None:
  """Write the running totals and the next batch atomically."""
  meta = {"done": done, "settings": settings}
  run_dir.save_arrays(state_path(out), _flat(totals), meta)


def _unreadable(path: str, why: str) -> HarvestConflict:
  return HarvestConflict(f"{path} {why}; delete {os.path.dirname(path)} or "
                         "overwrite it to harvest again")


def _record(path: str) -> dict:
  """Return what `path` (the manifest or the state) records: a dict holding
  at least its `settings` dict (and the state's `done`); HarvestConflict
  naming the file and the key where it cannot be read."""
  if path.endswith(".json"):
    try:
      with open(path, encoding="utf-8") as f:
        record = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      raise _unreadable(path, f"cannot be read ({e})") from None
    keys = ("settings",)
  else:
    try:
      record = run_dir.load_arrays(path)[1]
    except ValueError as e:
      raise _unreadable(path, f"cannot be read ({e})") from None
    keys = ("settings", "done")
  if not isinstance(record, dict):
    raise _unreadable(path, "holds no JSON object")
  for key in keys:
    if key not in record:
      raise _unreadable(path, f"lacks the key {key!r}")
  if not isinstance(record["settings"], dict):
    raise _unreadable(path, "has 'settings' that is not a JSON object")
  return record


def _check_settings(out: str, record: dict, wanted: dict) -> None:
  """Raise HarvestConflict when `record` was made with other settings."""
  # Harvests from before tag statistics record no `tag_groups`: none;
  # from before spread windows no `windows`: random ones; from before the
  # context statistics and matched baselines no `tag_revision`: none.
  recorded = {"tag_groups": 0, "windows": "", "tag_revision": 0,
              **record["settings"]}
  if recorded != wanted:
    changed = sorted(k for k in recorded.keys() | wanted.keys()
                     if recorded.get(k) != wanted.get(k))
    raise HarvestConflict(
      f"{out} holds a harvest with other settings ({', '.join(changed)}); "
      "rerun with its settings to continue it, or overwrite it")


def resume(out: str, totals: dict, settings: dict, overwrite: bool) -> int:
  """Return the batches already harvested (0 for a fresh harvest), after
  loading their totals; -1 when `out` holds this harvest, complete. Refuse
  (HarvestConflict) a harvest made with other settings, or one whose
  manifest or state cannot be read, unless `overwrite` (then removed)."""
  path = state_path(out)
  manifest = os.path.join(out, MANIFEST)
  existing = [p for p in (path, manifest) if os.path.exists(p)]
  if not existing:
    return 0
  try:
    _check_settings(
      out, _record(manifest if os.path.exists(manifest) else path), settings)
  except HarvestConflict:
    if not overwrite:
      raise
    for p in existing:
      run_dir.remove_path(p)
    return 0
  if os.path.exists(manifest):
    return -1
  arrays, meta = run_dir.load_arrays(path)
  for key, value in arrays.items():
    site, field = key.rsplit("/", 1)
    totals[site][field] = value
  return int(meta["done"])


def write_store(out: str, totals: dict, fields: tuple[str, ...]
                ) -> list[str]:
  """Write every site's statistics named in `fields` as zarr arrays under
  `out`; return their relative paths."""
  ctx = tensor_store.context()
  written, futures = [], []
  for site, site_fields in totals.items():
    for field in [f for f in fields if f in site_fields]:
      value = np.asarray(site_fields[field])
      relative = os.path.join(site, field)
      path = os.path.join(out, relative)
      run_dir.remove_path(path)  # a half-written store of a killed harvest
      store = tensor_store.created(tensor_store.start_create(
        path, value.shape, value.dtype, value.shape, ctx), path)
      futures += tensor_store.start_write(store, value)
      written.append(relative)
  tensor_store.wait(futures)
  return written


def prepare(out: str, say: Callable[[str], None]) -> None:
  """Make `out`, and remove the temporaries killed harvests left there,
  saying so."""
  os.makedirs(out, exist_ok=True)
  for name in (STATE_FILE, MANIFEST):
    for stale in run_dir.remove_stale_temporaries(os.path.join(out, name)):
      say(f"[harvest] removed {stale}, left by a killed harvest")


def write_manifest(out: str, manifest: dict) -> str:
  """Write `manifest.json` (last: its presence marks the harvest done) and
  remove the state it no longer needs; return the manifest's path."""
  path = os.path.join(out, MANIFEST)
  run_dir.atomic_write(path, lambda f: f.write(
    (json.dumps(manifest, indent=1) + "\n").encode()))
  run_dir.remove_path(state_path(out))
  return path


def read_manifest(run_path: str) -> dict:
  """Return the manifest of the harvest of the run at `run_path`;
  ValueError when it has none, or an unfinished one (no manifest yet)."""
  manifest_path = os.path.join(run_path, HARVEST_DIR, MANIFEST)
  if not os.path.isfile(manifest_path):
    raise ValueError(f"{run_path} has no finished harvest; run bin/harvest "
                     f"--run_dir={run_path} first")
  with open(manifest_path) as f:
    return json.load(f)


def read_arrays(run_path: str, key: str, fields: tuple[str, ...]
                ) -> dict[str, np.ndarray]:
  """Return the statistics `fields` of `key` (a site or a baseline key) of
  the harvest of the run at `run_path`, as host arrays."""
  ctx = tensor_store.context()
  arrays = {}
  for field in fields:
    path = os.path.join(run_path, HARVEST_DIR, key, field)
    store = tensor_store.opened(tensor_store.start_open(path, ctx), path)
    arrays[field] = np.asarray(tensor_store.wait_value(store.read()))
  return arrays


def clusters_path(run_path: str) -> str:
  return os.path.join(run_path, HARVEST_DIR, CLUSTERS)


def write_clusters(run_path: str, record: dict) -> str:
  """Write the clusters of the harvest of the run at `run_path` atomically
  (replacing any earlier ones); return the file's path."""
  path = clusters_path(run_path)
  run_dir.atomic_write(path, lambda f: f.write(
    (json.dumps(record, indent=1) + "\n").encode()))
  return path


def read_clusters(run_path: str) -> dict | None:
  """Return the clusters written beside the harvest of the run at
  `run_path`, None when there are none; ValueError for a file that cannot
  be read."""
  path = clusters_path(run_path)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} cannot be read ({e}); rerun bin/cluster "
                     f"--run_dir={run_path}") from None
  if not isinstance(record, dict) or not isinstance(record.get("sites"), dict):
    raise ValueError(f"{path} holds no clusters; rerun bin/cluster "
                     f"--run_dir={run_path}")
  return record
