"""Checkpoints: atomic step directories of named items (SPEC §12).

A checkpoint directory holds one directory per saved step, named by its label
(completed optimizer steps, zero-padded to nine digits):

  000000100/checkpoint.json               format, step, items; written last
  000000100/decomposition/manifest.json   per array: shape, dtype (and
                                          real_shape when padded); metadata
  000000100/decomposition/arrays/components/mlp_in/v/   one zarr v3 array
  000000100/training/...

Array directories are the leaves' slash-joined tree paths. A step
is written under `.tmp-000000100` and renamed when complete, so a directory
with a step name is whole unless the disk damaged it afterwards; checksums
(see `tensor_store`) make such damage an error on read, and
`restore_latest` falls back past it. Typed PRNG keys are stored as their key
data plus the implementation's name.

A training state splits into two items: `decomposition` (components and
CI-function params, with the site specs and CI config that rebuild their
structure) and `training` (every other state field);
`decomposition.load_decomposition` reads the first alone (I37).
"""

import json
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from decompax.core import health
from decompax.io import run_dir, tensor_store
from decompax.io.run_dir import Path

FORMAT = "decompax-checkpoint/1"
INDEX_FILE = "checkpoint.json"
MANIFEST_FILE = "manifest.json"
ARRAYS_DIR = "arrays"
# A run directory keeps its checkpoints here.
CHECKPOINT_DIR = "checkpoints"
DECOMPOSITION = "decomposition"
TRAINING = "training"
DECOMPOSITION_FIELDS = ("components", "ci_params")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
# `real_shape(path, leaf)`: the real shape of a leaf held with pad slots
# (`core.slots.real_shape_of`), else None or the leaf's own shape.
RealShape = Callable[[tuple, Any], Any]


class CheckpointError(ValueError):
  """A checkpoint cannot be used here; the message is one line."""


class DamagedCheckpoint(CheckpointError):
  """A saved step is unreadable (missing or corrupt files)."""


class NonfiniteCheckpoint(DamagedCheckpoint):
  """A saved step reads, but holds a NaN or an infinity."""


def step_name(step: int) -> str:
  """Return the directory name of label `step`."""
  return f"{step:09d}"


def step_path(directory: Path, step: int) -> str:
  """Return the directory of label `step` under `directory`."""
  return os.path.join(os.fspath(directory), step_name(step))


def _sync(name: str) -> None:
  # Every process writes its own shards; the primary creates and commits.
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def _primary() -> bool:
  return jax.process_index() == 0


def _is_key(leaf: Any) -> bool:
  dtype = getattr(leaf, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _as_array(leaf: Any) -> Any:
  return leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)


def _entry(leaf: Any) -> dict:
  """Return the manifest entry of a leaf (array, ShapeDtypeStruct, number)."""
  if _is_key(leaf):
    data = jax.eval_shape(jax.random.key_data, leaf)
    return {"shape": list(data.shape), "dtype": np.dtype(data.dtype).name,
            "key": True}
  dtype = getattr(leaf, "dtype", None)
  if dtype is None:
    dtype = np.asarray(leaf).dtype
  return {"shape": list(np.shape(leaf)), "dtype": np.dtype(dtype).name}


def _write_json(path: Path, value: Any) -> None:
  text = json.dumps(value, indent=1, sort_keys=True)
  run_dir.atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def _real_shapes(tree: PyTree, real_shape: RealShape | None) -> list:
  # Per leaf in flatten order: its real shape (a stack held with pad slots
  # is smaller than its array) or None where it is the array's own.
  found = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    real = None if real_shape is None else real_shape(path, leaf)
    own = list(np.shape(leaf))
    found.append(None if real is None or list(real) == own else list(real))
  return found


def _write_item(root: str, item: str, tree: PyTree, metadata: Mapping,
                real_shape: RealShape | None = None) -> None:
  keys, leaves = run_dir.leaf_keys(tree)
  arrays = [jax.random.key_data(leaf) if _is_key(leaf) else _as_array(leaf)
            for leaf in leaves]
  entries = {k: _entry(leaf) for k, leaf in zip(keys, leaves)}
  for key, real in zip(keys, _real_shapes(tree, real_shape)):
    if real is not None:
      entries[key]["real_shape"] = real
  for key, leaf in zip(keys, leaves):
    if _is_key(leaf):
      entries[key]["key_impl"] = str(jax.random.key_impl(leaf))
  paths = [os.path.join(root, item, ARRAYS_DIR, *k.split("/")) for k in keys]
  ctx = tensor_store.context()
  if _primary():
    pending = [tensor_store.start_create(p, a.shape, a.dtype,
                                         tensor_store.shard_shape_of(a), ctx)
               for p, a in zip(paths, arrays)]
    stores = [tensor_store.created(f, p) for f, p in zip(pending, paths)]
  _sync(f"checkpoint-create-{root}-{item}")
  if not _primary():
    stores = [tensor_store.opened(tensor_store.start_open(p, ctx), p,
                                  complete=False)
              for p in paths]
  futures = []
  for store, array in zip(stores, arrays):
    if isinstance(array, jax.Array) or _primary():
      futures += tensor_store.start_write(store, array)
  tensor_store.wait(futures)
  _sync(f"checkpoint-written-{root}-{item}")
  if _primary():
    _write_json(os.path.join(root, item, MANIFEST_FILE), {
      "format": FORMAT, "item": item, "arrays": entries,
      "metadata": dict(metadata)})


def _remove(path: Path) -> None:
  if os.path.isdir(path):
    shutil.rmtree(path)


def _commit(tmp: str, final: str) -> None:
  """Rename `tmp` to `final`, replacing an older directory of that name."""
  parent, name = os.path.split(final)
  trash = os.path.join(parent, _TRASH_PREFIX + name)
  if os.path.lexists(final):
    _remove(trash)
    os.rename(final, trash)
  os.rename(tmp, final)
  run_dir.fsync_dir(parent)
  _remove(trash)


def _reason(error: Exception) -> str:
  """Return the gist of a failed write, not the store's whole chain."""
  if isinstance(error, OSError) and error.strerror:
    return error.strerror
  text = str(error)
  if "No space left" in text:
    return "No space left on device"
  first = text.splitlines()[0] if text else type(error).__name__
  return first if len(first) <= 160 else first[:157] + "..."


def save(
  directory: Path,
  step: int,
  items: Mapping[str, PyTree],
  metadata: Mapping[str, Mapping] | None = None,
  after_item: Callable[[str], None] | None = None,
  real_shape: RealShape | None = None,
) -> str:
  """Write `items` as label `step` under `directory`; return its path.

  The step directory appears only once every item is written. An existing
  directory of the same label (a damaged one being replaced) is swapped out.
  `after_item(name)` runs after each item is written (fault injection in
  tests). `real_shape(path, leaf)` gives the real shape of a leaf held with
  pad slots (`core.slots`): the array is written whole, pads included, and
  its manifest entry records the real shape. Raises CheckpointError when
  the disk refuses a write.
  """
  directory = os.path.abspath(os.fspath(directory))
  name = step_name(step)
  tmp = os.path.join(directory, _TMP_PREFIX + name)
  final = os.path.join(directory, name)
  metadata = metadata or {}
  try:
    if _primary():
      os.makedirs(directory, exist_ok=True)
      _remove(tmp)
      os.makedirs(tmp)
    _sync(f"checkpoint-begin-{tmp}")
    for item, tree in items.items():
      _write_item(tmp, item, tree, metadata.get(item, {}), real_shape)
      if after_item is not None:
        after_item(item)
    if _primary():
      _write_json(os.path.join(tmp, INDEX_FILE),
                  {"format": FORMAT, "step": step, "items": list(items)})
      _commit(tmp, final)
  except (OSError, tensor_store.StoreError) as e:
    raise CheckpointError(
      f"cannot save checkpoint {final}: {_reason(e)}; the checkpoints "
      "before it are intact: fix that and rerun the same command to "
      "resume") from e
  _sync(f"checkpoint-done-{final}")
  return final


def committed_steps(directory: Path) -> list[int]:
  """Return the labels of committed step directories, oldest first."""
  directory = os.fspath(directory)
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory)
                if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def _read_json(path: Path, what: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except FileNotFoundError:
    raise DamagedCheckpoint(f"{what} is missing") from None
  except (OSError, ValueError) as e:
    raise DamagedCheckpoint(f"{what} is unreadable: {e}") from None
  if not isinstance(value, dict) or value.get("format") != FORMAT:
    raise DamagedCheckpoint(f"{what} is not a {FORMAT} record")
  return value


def read_index(path: Path) -> dict:
  """Return the index of the step directory `path`; DamagedCheckpoint if bad."""
  index = _read_json(os.path.join(path, INDEX_FILE),
                     f"{path}: {INDEX_FILE}")
  name = os.path.basename(os.path.normpath(path))
  if name.isdigit() and index.get("step") != int(name):
    raise DamagedCheckpoint(f"{path}: {INDEX_FILE} names step"
                            f" {index.get('step')}")
  return index


def latest_step(directory: Path) -> int | None:
  """Return the newest label whose index reads, or None."""
  for step in reversed(committed_steps(directory)):
    try:
      read_index(step_path(directory, step))
    except DamagedCheckpoint:
      continue
    return step
  return None


def _manifest(path: Path, item: str) -> dict:
  if not os.path.isdir(os.path.join(path, item)):
    raise DamagedCheckpoint(f"{path} has no item {item!r}")
  manifest = _read_json(os.path.join(path, item, MANIFEST_FILE),
                        f"{path}: {item}/{MANIFEST_FILE}")
  if not isinstance(manifest.get("arrays"), dict):
    raise DamagedCheckpoint(f"{path}: {item}/{MANIFEST_FILE} lists no arrays")
  return manifest


def item_metadata(path: Path, item: str) -> dict:
  """Return the metadata saved with `item` of the step directory `path`."""
  return dict(_manifest(path, item).get("metadata", {}))


def item_paths(path: Path, item: str) -> tuple[str, ...]:
  """Return the tree paths of the arrays `item` of `path` stores."""
  return tuple(_manifest(path, item)["arrays"])


def _renamed(stored: dict, renamed: Mapping[str, str]
             ) -> tuple[dict, dict[str, str]]:
  """Return the manifest entries under this run's paths, and each renamed
  path's directory under `arrays/`."""
  entries, on_disk = {}, {}
  for key, entry in stored.items():
    new = key
    for old, prefix in renamed.items():
      if key == old or key.startswith(old + "/"):
        new = prefix + key[len(old):]
        on_disk[new] = key
        break
    entries[new] = entry
  return entries, on_disk


def _describe(entry: dict) -> str:
  return f"{entry.get('dtype')}{_real(entry)}"


def _real(entry: dict) -> list:
  return list(entry.get("real_shape", entry.get("shape", [])))


def _check_structure(where: str, stored: dict, keys: list[str],
                     leaves: list, added: tuple[str, ...] = (),
                     reals: list | None = None) -> None:
  missing = [k for k in keys if k not in stored and not k.startswith(added)]
  if missing:
    raise CheckpointError(
      f"{where}: {missing[0]} is not stored ({len(missing)} missing); it was "
      "written for another structure")
  extra = sorted(set(stored) - set(keys))
  if extra:
    raise CheckpointError(
      f"{where}: stored {extra[0]} is not in this run's state ({len(extra)} "
      "extra); it was written for another structure")
  for key, leaf, real in zip(keys, leaves, reals or [None] * len(keys)):
    if key not in stored:
      continue
    want, got = _entry(leaf), stored[key]
    if real is not None:
      want["real_shape"] = real
    if bool(want.get("key")) != bool(got.get("key")):
      raise CheckpointError(
        f"{where}: {key} is stored as {'a' if got.get('key') else 'no'} PRNG"
        f" key, this run expects {'one' if want.get('key') else 'an array'}")
    # Pad slots may differ (another mesh); the real sizes may not.
    if (_real(want), want["dtype"]) != (_real(got), got.get("dtype")):
      raise CheckpointError(
        f"{where}: {key} is stored as {_describe(got)}, this run expects "
        f"{_describe(want)}")


def _shardings(template: PyTree, shardings: Any, n: int) -> list:
  if shardings is None or isinstance(shardings, jax.sharding.Sharding):
    return [shardings] * n
  return jax.tree_util.tree_structure(template).flatten_up_to(shardings)


def _placement(leaf: Any, given: Any) -> jax.sharding.Sharding:
  if given is not None:
    return given
  sharding = getattr(leaf, "sharding", None)
  if isinstance(sharding, jax.sharding.Sharding):
    return sharding
  return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _open_all(path: Path, item: str, keys: list[str], stored: dict,
              on_disk: Mapping[str, str] | None = None) -> list:
  """Return the opened arrays of `keys` (stored under `on_disk[key]` where
  given), opened concurrently."""
  ctx = tensor_store.context()
  on_disk = on_disk or {}
  paths = [os.path.join(path, item, ARRAYS_DIR,
                        *on_disk.get(k, k).split("/")) for k in keys]
  pending = [tensor_store.start_open(p, ctx, stored[k]["shape"],
                                     stored[k]["dtype"])
             for p, k in zip(paths, keys)]
  stores = []
  for key, array_path, future in zip(keys, paths, pending):
    try:
      stores.append(tensor_store.opened(future, array_path))
    except tensor_store.StoreError as e:
      raise DamagedCheckpoint(
        f"checkpoint {path} item {item}: {key}: {e}") from None
  return stores


def _finish_leaf(pending, entry: dict, leaf: Any):
  array = tensor_store.finish_read(pending)
  if not entry.get("key"):
    return array
  # Key data read with the key's sharding (its trailing axis whole) gives
  # the key that sharding, on every process's own devices.
  key = jax.random.wrap_key_data(array, impl=entry.get("key_impl"))
  if key.dtype != leaf.dtype:
    raise tensor_store.StoreError(
      f"key of type {key.dtype}, this run expects {leaf.dtype}")
  return key


def restore_item(
  path: Path, item: str, template: PyTree, shardings: Any = None,
  added: tuple[str, ...] = (), renamed: Mapping[str, str] | None = None,
  real_shape: RealShape | None = None,
) -> PyTree:
  """Return `item` of the step directory `path`, shaped like `template`.

  `template` holds arrays or `jax.ShapeDtypeStruct`s; every restored leaf is
  placed with `shardings` (one Sharding for all, or a tree matching
  `template`), else with the template leaf's own sharding, else on the
  first device. Only the regions each local device needs are read, all
  arrays at once. Leaves whose tree path starts with one of `added` (state
  fields newer than the checkpoint) keep the template's value when the
  checkpoint lacks them; the template must then hold arrays. `renamed`
  reads an older layout: each stored path that is a key of it, or lies
  under one, is read as the path that key maps to (`{"a/0": "a/x"}` reads
  `a/0/v` as `a/x/v`). `real_shape(path, leaf)` gives the real shape of a
  template leaf held with pad slots (`core.slots`); a stored array whose
  pad slots differ from the template's (another mesh, or none) is read by
  its real block, the template's pads zero. Raises DamagedCheckpoint for
  unreadable files and CheckpointError when the stored structure differs
  from `template`.
  """
  manifest = _manifest(path, item)
  where = f"checkpoint {path} item {item}"
  all_keys, all_leaves = run_dir.leaf_keys(template)
  reals = _real_shapes(template, real_shape)
  stored, on_disk = _renamed(manifest["arrays"], renamed or {})
  _check_structure(where, stored, all_keys, all_leaves, added, reals)
  placements = [_placement(leaf, given) for leaf, given in zip(
    all_leaves, _shardings(template, shardings, len(all_leaves)))]
  present = [i for i, k in enumerate(all_keys) if k in stored]
  keys = [all_keys[i] for i in present]
  stores = _open_all(path, item, keys, stored, on_disk)
  reads = [tensor_store.start_read(
    stores[j], placements[i], tuple(_entry(all_leaves[i])["shape"]),
    tuple(_real(stored[all_keys[i]]))) for j, i in enumerate(present)]
  # Leaves the checkpoint lacks keep the template's value, placed alike.
  restored = [leaf if key in stored else jax.device_put(leaf, sharding)
              for key, leaf, sharding in zip(all_keys, all_leaves,
                                             placements)]
  for i, key, pending in zip(present, keys, reads):
    try:
      restored[i] = _finish_leaf(pending, stored[key], all_leaves[i])
    except tensor_store.StoreError as e:
      raise DamagedCheckpoint(f"{where}: {key}: {e}") from None
  treedef = jax.tree_util.tree_structure(template)
  return jax.tree_util.tree_unflatten(treedef, restored)


@jax.jit
def _finite_leaves(leaves: list) -> list:
  return [health.all_finite(leaf) for leaf in leaves]


def check_finite(path: Path, item: str, tree: PyTree) -> None:
  """Raise NonfiniteCheckpoint naming the first array of `tree` (restored
  from `item` of `path`) that holds a NaN or an infinity."""
  keys, leaves = run_dir.leaf_keys(tree)
  arrays = [leaf for leaf in leaves if not _is_key(leaf)]
  names = [k for k, leaf in zip(keys, leaves) if not _is_key(leaf)]
  flags = jax.device_get(_finite_leaves(arrays))
  for name, finite in zip(names, flags):
    if not finite:
      raise NonfiniteCheckpoint(
        f"checkpoint {path} item {item}: {name} holds NaN or infinity")


def read_item(path: Path, item: str) -> tuple[dict[str, np.ndarray], dict]:
  """Return every array of `item` on the host by tree path, and its metadata.

  Needs no template; PRNG keys come back as their raw key data, and arrays
  written with pad slots at their real shape.
  """
  manifest = _manifest(path, item)
  keys = list(manifest["arrays"])
  stores = _open_all(path, item, keys, manifest["arrays"])
  reads = [store.read() for store in stores]
  arrays = {}
  for key, future in zip(keys, reads):
    try:
      array = np.asarray(tensor_store.wait_value(future))
      real = _real(manifest["arrays"][key])
      if list(array.shape) != real:
        array = array[tuple(slice(0, n) for n in real)]
      arrays[key] = array
    except tensor_store.StoreError as e:
      raise DamagedCheckpoint(f"checkpoint {path} item {item}: {key}: {e}"
                              ) from None
  return arrays, dict(manifest.get("metadata", {}))


def processes_agree(step: int, ok: bool) -> bool:
  """Return whether every process could read `step` (`ok` is this one's
  answer); in a one-process run, `ok`. Raises CheckpointError when the
  processes are looking at different steps."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils
  # A deliberate copy to the host, wherever implicit ones are disallowed.
  with jax.transfer_guard("allow"):
    seen = np.asarray(multihost_utils.process_allgather(
      np.array([step, int(ok)], np.int64)))
  steps = sorted(set(seen[:, 0].tolist()))
  if len(steps) > 1:
    raise CheckpointError(
      f"the processes look at different checkpoints ({steps}); every "
      "process must see the same checkpoint directory")
  return bool(seen[:, 1].all())


def this_process_only(step: int, ok: bool) -> bool:
  """Return `ok`: the agreement of a reader no other process joins."""
  del step
  return ok


def _attempt(directory: Path, step: int, restore: Callable[[str], Any],
             check, agree) -> tuple[Any, DamagedCheckpoint | None]:
  """Return what `restore` read of `step` and why it is unusable (None:
  usable), as every process agrees."""
  path = step_path(directory, step)
  restored, failure = None, None
  try:
    read_index(path)
    restored = restore(path)
  except DamagedCheckpoint as e:
    failure = e
  if not agree(step, failure is None) and failure is None:
    failure = DamagedCheckpoint(
      f"checkpoint {path}: another process found its shards damaged")
  if failure is None and check is not None:
    try:
      check(path, restored)
    except DamagedCheckpoint as e:
      failure = e
  return restored, failure


def restore_latest(
  directory: Path,
  restore: Callable[[str], Any],
  report: Callable[[str], None],
  check: Callable[[str, Any], None] | None = None,
  agree: Callable[[int, bool], bool] = processes_agree,
) -> tuple[int, Any] | None:
  """Return `(label, restore(step_path))` for the newest usable step.

  `restore(path)` reads a step, each process its own shards; `check(path,
  restored)`, if given, then inspects what was read (it may be a
  collective, such as a finiteness check over global arrays). A damaged
  step (DamagedCheckpoint, NonfiniteCheckpoint included, from either) is
  reported through `report` and the previous one tried. One process may
  find damage in shards the others never read: before `check`, the
  processes agree (`agree(step, ok)`, all-or-none) so that all of them
  fall back together rather than restore different steps and hang in the
  next collective. Returns None when there is no committed step; raises
  CheckpointError when every committed step is damaged.
  """
  steps = committed_steps(directory)
  for step in reversed(steps):
    restored, failure = _attempt(directory, step, restore, check, agree)
    if failure is None:
      return step, restored
    what = ("holds non-finite values"
            if isinstance(failure, NonfiniteCheckpoint) else "is damaged")
    report(f"checkpoint {step_name(step)} {what} and is skipped: {failure}")
  if steps:
    raise CheckpointError(
      f"{directory}: all {len(steps)} checkpoints are damaged or hold "
      "non-finite values; delete them to start over")
  return None


def prune(directory: Path, keep_last: int, protect: tuple[int, ...] = (),
          after_hide: Callable[[int], None] | None = None) -> list[int]:
  """Delete all but the newest `keep_last` steps (and `protect`); return them.

  A step is renamed out of sight before it is deleted, so a crash midway
  never leaves a partly deleted step that looks committed.
  `after_hide(step)` runs between the two (fault injection in tests).
  """
  steps = committed_steps(directory)
  doomed = [s for s in steps[:max(len(steps) - keep_last, 0)]
            if s not in protect]
  if _primary():
    for step in doomed:
      trash = os.path.join(directory, _TRASH_PREFIX + step_name(step))
      _remove(trash)
      os.rename(step_path(directory, step), trash)
      if after_hide is not None:
        after_hide(step)
      _remove(trash)
  return doomed


def remove_partial(directory: Path) -> list[str]:
  """Delete what interrupted saves and prunes left; return their names."""
  if not os.path.isdir(directory) or not _primary():
    return []
  names = [n for n in os.listdir(directory)
           if n.startswith((_TMP_PREFIX, _TRASH_PREFIX))]
  for name in names:
    _remove(os.path.join(directory, name))
  return names


def split_state(state: Any) -> dict[str, dict[str, PyTree]]:
  """Return a training state's fields as the two checkpoint items."""
  fields = state._asdict()
  return {
    DECOMPOSITION: {k: fields[k] for k in DECOMPOSITION_FIELDS},
    TRAINING: {k: v for k, v in fields.items()
               if k not in DECOMPOSITION_FIELDS},
  }


def join_state(template: Any, items: Mapping[str, Mapping]) -> Any:
  """Return `template` with the fields of the restored items put back."""
  fields = {}
  for item in items.values():
    fields.update(item)
  return template._replace(**fields)
