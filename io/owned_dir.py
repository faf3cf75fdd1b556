"""The one contract of a directory a binary writes (`bin/train_lm`'s model,
`bin/prepare_brown`'s data, `bin/harvest`'s store, ...).

- Its path is named: an empty or blank one is refused (`named`).
- One writer at a time: the writer holds the lock of `.lock`, which names
  its pid and host (`run_dir.lock_dir`); a lock a dead holder left is taken
  over.
- `.written.json`, the manifest, names the binary that made the directory,
  the settings that decide what it holds (among them the identity of its
  input data: `file_identity`), and every entry the binary wrote, each
  listed before it is written (`record`).
- A directory holding this binary's output made with other settings is
  refused (`OwnedConflict`, one line naming the first differences and the
  fix) unless `overwrite`, which removes what the manifest lists and
  nothing else. A directory with entries but no manifest of this binary
  is never written into, `overwrite` or not.
- Refusals come before anything is written; an OS error becomes one line
  naming the path (`refusal`), and writes are atomic, so a failed write
  leaves the old file or none (`run_dir.atomic_write`).

A `location` key of a settings dict (where an input lay) is recorded but
never compared: the same bytes moved elsewhere are the same input.

`bin/train`'s run directory keeps its own records (`io/run_dir.py`: its
`flags.txt` for settings, `RUN_ENTRIES` and `.run_files` for entries);
the identity of the files it reads, which `flags.txt` names but does not
pin, is its `inputs.json` (`check_inputs`, `write_inputs`).
"""

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from decompax.io import run_dir

MANIFEST_FILE = ".written.json"
MANIFEST_FORMAT = "decompax.written"
# Never an entry of the manifest: the lock outlives any writer, and the
# manifest is the directory's own record.
_OWN = (run_dir.LOCK_FILE, MANIFEST_FILE)
_HASH_CHUNK = 1 << 22
# Given a directory without a manifest and its entries, the entries an
# older version of the program wrote there (none: not its output).
Legacy = Callable[[str, list[str]], list[str]] | None


class OwnedConflict(ValueError):
  """The directory holds this binary's output made with other settings;
  the message is one line naming the differences and the fix."""


class Claim(NamedTuple):
  """A directory claimed by one binary: its absolute path, the descriptor
  holding its lock (for the process's life), and whether it already held
  this binary's output of the same settings (a resume or a reuse)."""

  path: str
  lock: int
  resumed: bool


def named(value: str | None, flag: str) -> str:
  """Return `value`, a path flag's value; ValueError for an empty or blank
  one (which would mean the working directory)."""
  if value is None or not value.strip():
    raise ValueError(f"--{flag}={value or ''!r} names no path; name the "
                     "directory (or file) to write")
  return value


def file_identity(path: run_dir.Path) -> dict[str, Any]:
  """Return what identifies the file at `path`: its location, size and
  SHA-256 of its bytes."""
  digest = hashlib.sha256()
  size = 0
  with open(path, "rb") as f:
    while chunk := f.read(_HASH_CHUNK):
      digest.update(chunk)
      size += len(chunk)
  return {"location": os.path.abspath(os.fspath(path)), "size": size,
          "sha256": digest.hexdigest()}


def files_identity(directory: run_dir.Path,
                   names: tuple[str, ...]) -> dict[str, Any]:
  """Return `file_identity` of each of `names` in `directory` present there,
  keyed by name."""
  directory = os.fspath(directory)
  return {name: file_identity(os.path.join(directory, name))
          for name in names if os.path.isfile(os.path.join(directory, name))}


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
  """Return the leaves of nested dicts keyed by dotted path, `location`
  keys left out."""
  if not isinstance(value, Mapping):
    return {prefix: value}
  flat = {}
  for key, item in value.items():
    if key != "location":
      flat.update(_flat(item, f"{prefix}.{key}" if prefix else str(key)))
  return flat


_MISSING = object()


def _shown(value: Any) -> str:
  if isinstance(value, str) and len(value) == 64:
    return value[:12] + "…"  # a hash: its head tells two apart
  return "not recorded" if value is _MISSING else json.dumps(value)


def settings_changes(old: Mapping, new: Mapping, shown: int = 3) -> list[str]:
  """Return the settings that differ between `old` and `new`, each as
  `name was X, now Y` (at most `shown`, then `and N more`)."""
  a, b = _flat(old), _flat(new)
  # A setting recorded as None is one not recorded: an older version's
  # output (no settings) of a toy (no data file) is the same output.
  names = sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))
  changes = [f"{n} was {_shown(a.get(n, _MISSING))}, now "
             f"{_shown(b.get(n, _MISSING))}"
             for n in names[:shown]]
  if len(names) > shown:
    changes.append(f"and {len(names) - shown} more")
  return changes


def refusal(error: OSError, path: run_dir.Path) -> str:
  """Return, on one line, why a write failed: the path it names (else
  `path`), the reason and the fix."""
  return run_dir.write_refusal(error.filename or os.fspath(path), error)


def read_manifest(path: run_dir.Path) -> dict | None:
  """Return the manifest of directory `path`, None where it has none or
  one that cannot be read (then nothing there is known to be written by a
  binary)."""
  try:
    with open(os.path.join(path, MANIFEST_FILE), encoding="utf-8") as f:
      manifest = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError):
    return None
  if not (isinstance(manifest, dict)
          and manifest.get("format") == MANIFEST_FORMAT
          and isinstance(manifest.get("entries"), list)):
    return None
  return manifest


def _write_manifest(path: str, manifest: dict) -> None:
  text = json.dumps(manifest, indent=1) + "\n"
  run_dir.atomic_write(os.path.join(path, MANIFEST_FILE),
                       lambda f: f.write(text.encode("utf-8")))


def _listed(names: list[str], shown: int = 3) -> str:
  more = f" and {len(names) - shown} more" if len(names) > shown else ""
  return ", ".join(names[:shown]) + more


def _check_parent(path: str) -> None:
  """Raise ValueError unless the parent of `path` is a directory."""
  ancestor = os.path.dirname(path)
  while not os.path.lexists(ancestor):
    ancestor = os.path.dirname(ancestor)
  if os.path.isdir(ancestor) and ancestor != os.path.dirname(path):
    raise ValueError(f"{path}: its parent {os.path.dirname(path)} does not "
                     "exist; create it or choose another directory")
  if not os.path.isdir(ancestor):
    raise ValueError(f"{path}: {ancestor} is a file, not a directory; "
                     "choose another directory")


def _foreign(path: str, program: str, manifest: dict | None) -> str | None:
  """Return why `program` may not write into the existing directory
  `path`, or None."""
  entries = sorted(set(os.listdir(path)) - set(_OWN))
  if manifest is None:
    if not entries:
      return None
    return (f"holds {_listed(entries)}, which no {program} run wrote (it "
            f"has no {MANIFEST_FILE}); move them away or choose another "
            "directory")
  if manifest.get("program") != program:
    return (f"holds the output of {manifest.get('program')!r}, not of "
            f"{program}; choose another directory")
  return None


def _adopted(path: str, program: str, legacy: Legacy) -> dict | None:
  """Return the manifest of `path`, or for an older version's output that
  `legacy` recognises by its entries, one listing them with no settings."""
  manifest = read_manifest(path)
  entries = sorted(set(os.listdir(path)) - set(_OWN))
  owned = legacy(path, entries) if manifest is None and legacy else []
  if owned:
    return {"format": MANIFEST_FORMAT, "program": program, "settings": {},
            "entries": sorted(owned)}
  return manifest


def check(path: run_dir.Path, program: str, settings: Mapping,
          overwrite: bool, legacy: Legacy = None) -> bool:
  """Return whether `path` holds `program`'s output of `settings` (a
  resume); ValueError (one line, nothing written) unless `program` may
  write there (see the module's docstring), OwnedConflict for its output
  of other settings without `overwrite`. `legacy(path, entries)` names
  the entries of a directory without a manifest that an older version of
  `program` wrote: one holding any is adopted as its output, those listed,
  its settings unknown (so only `overwrite` replaces it)."""
  path = os.path.abspath(os.fspath(path))
  _check_parent(path)
  if os.path.lexists(path) and not os.path.isdir(path):
    raise ValueError(f"{path} is a file, not a directory; choose another "
                     "directory")
  if not os.path.isdir(path):
    return False
  manifest = _adopted(path, program, legacy)
  reason = _foreign(path, program, manifest)
  if reason is not None:
    raise ValueError(f"{path} {reason}")
  if manifest is None:
    return False
  changes = _refuse_other_settings(
    path, program, manifest, settings, overwrite,
    "rerun with those settings to reuse it, pass --overwrite to replace it, "
    "or choose another directory")
  return not changes and not overwrite


def _refuse_other_settings(where: str, program: str, manifest: dict,
                           settings: Mapping, overwrite: bool, fix: str
                           ) -> list[str]:
  """Return how `settings` differ from those `manifest` records; raise
  OwnedConflict (naming `where` and the `fix`) where they differ and
  `overwrite` is off."""
  changes = settings_changes(manifest.get("settings") or {}, settings)
  if changes and not overwrite:
    raise OwnedConflict(
      f"{where} holds {program} output made with other settings "
      f"({'; '.join(changes)}); {fix}")
  return changes


def _remove_listed(path: str, manifest: dict | None) -> None:
  for entry in (manifest or {}).get("entries", []):
    if entry and os.sep not in entry and entry not in _OWN + (".", ".."):
      run_dir.remove_path(os.path.join(path, entry))


def claim(path: run_dir.Path, program: str, settings: Mapping,
          overwrite: bool, what: str = "output dir",
          legacy: Legacy = None) -> Claim:
  """Return `path` claimed for `program`: checked (`check`), locked
  (`what` names it in the lock's refusal), and with its manifest written.

  A resume keeps what is there. Otherwise, with `overwrite`, the entries
  the manifest lists are removed first; the new manifest lists none yet.
  A directory this call made is removed again when its first write fails.
  """
  path = os.path.abspath(os.fspath(path))
  check(path, program, settings, overwrite, legacy)
  made = not os.path.isdir(path)
  lock = run_dir.lock_dir(path, what, "wait for it to end or choose "
                          "another directory")
  try:
    # Checked again under the lock: the first check may have raced a writer.
    resumed = check(path, program, settings, overwrite, legacy)
    manifest = _adopted(path, program, legacy)
    if not resumed:
      _remove_listed(path, manifest)
      manifest = {"format": MANIFEST_FORMAT, "program": program,
                  "settings": dict(settings), "entries": []}
    if not resumed or read_manifest(path) is None:  # or adopted (legacy)
      _write_manifest(path, {**manifest, "settings": dict(settings)})
  except BaseException:
    if made:
      run_dir.remove_path(path)
    os.close(lock)
    raise
  return Claim(path, lock, resumed)


def record(path: run_dir.Path, *names: str) -> None:
  """List `names` (entries of the claimed directory `path`) in its manifest,
  before the binary writes them: a crash between the two leaves a name
  without an entry, never an entry of the binary's that looks like a
  user's."""
  path = os.fspath(path)
  manifest = read_manifest(path)
  if manifest is None:
    raise ValueError(f"{path}/{MANIFEST_FILE} is gone or damaged; "
                     "rerun with --overwrite in a directory of its own")
  missing = [n for n in names if n not in manifest["entries"]]
  if missing:
    manifest["entries"] += missing
    _write_manifest(path, manifest)


def enter(path: run_dir.Path, owner: str, what: str, *names: str) -> int:
  """Return the lock of the directory `path` that `owner` wrote, taken by
  another binary adding `names` to it (as `bin/cluster` adds its clusters
  to a harvest), listed in `owner`'s manifest where it has one (an older
  version's output has none); ValueError where another binary wrote it."""
  path = os.path.abspath(os.fspath(path))
  if not os.path.isdir(path):
    raise ValueError(f"{path} holds no {owner} output; run {owner} first")
  manifest = read_manifest(path)
  if manifest is not None and manifest.get("program") != owner:
    raise ValueError(f"{path} holds the output of "
                     f"{manifest.get('program')!r}, not of {owner}")
  lock = run_dir.lock_dir(path, what, f"wait for that {owner} to end")
  if manifest is not None:
    record(path, *names)
  return lock


def check_file(path: run_dir.Path, flag: str) -> str:
  """Return the absolute path of the file a binary writes whole
  (atomically), after refusing (one line, naming `--flag`) an empty or
  blank path, a parent that is no directory, and a path that is no
  regular file."""
  path = os.path.abspath(named(os.fspath(path), flag))
  try:
    _check_parent(path)
  except ValueError as e:
    raise ValueError(f"--{flag}: {e}") from None
  if os.path.lexists(path) and not os.path.isfile(path):
    raise ValueError(f"--{flag}: {path} is not a regular file (a directory "
                     "or a device?); name a file to write")
  return path


@contextlib.contextmanager
def claimed_file(path: run_dir.Path, flag: str, what: str
                 ) -> Iterator[None]:
  """Hold the file `path` for one writer for the block (`check_file`, then
  `run_dir.locked_file`): for outputs of more than one file, which two
  writers would interleave."""
  path = check_file(path, flag)
  with contextlib.ExitStack() as stack:
    try:
      stack.enter_context(run_dir.locked_file(
        path, what, "wait for it to end or name another file"))
    except ValueError as e:
      raise ValueError(f"--{flag}: {e}") from None
    yield


def arrays_identity(arrays: Mapping[str, Any]) -> dict[str, Any]:
  """Return what identifies a tree of arrays flattened by path (a
  decomposition read from a run): the SHA-256 of every key, dtype, shape
  and byte, in key order."""
  digest = hashlib.sha256()
  for key in sorted(arrays):
    array = np.ascontiguousarray(np.asarray(arrays[key]))
    digest.update(f"{key} {array.dtype.str} {array.shape}\n".encode())
    digest.update(array.tobytes())
  return {"sha256": digest.hexdigest()}


def file_manifest(path: run_dir.Path) -> str:
  """Return the manifest of the single file `path` a binary writes:
  `.NAME.written.json` beside it."""
  directory, name = os.path.split(os.path.abspath(os.fspath(path)))
  return os.path.join(directory, f".{name}{MANIFEST_FILE}")


def _read_json(path: str) -> Any:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError):
    return None


def check_output(path: run_dir.Path, flag: str, program: str,
                 settings: Mapping, overwrite: bool) -> str:
  """Return the absolute path of the file `--flag` names, which `program`
  writes whole: ValueError (one line) as `check_file` says, and for an
  existing file that no `program` run wrote (it has no manifest of
  `program`, `file_manifest`), `overwrite` or not; OwnedConflict for one
  it wrote with other settings, unless `overwrite`."""
  path = check_file(path, flag)
  if not os.path.lexists(path):
    return path
  manifest = _read_json(file_manifest(path))
  name = os.path.basename(file_manifest(path))
  if not (isinstance(manifest, dict) and manifest.get("program") == program
          and manifest.get("format") == MANIFEST_FORMAT):
    raise ValueError(f"--{flag}: {path} exists and no {program} run wrote "
                     f"it (it has no {name}); move it away or name another "
                     "file")
  _refuse_other_settings(f"--{flag}: {path}", program, manifest, settings,
                         overwrite, "pass --overwrite to replace it, or name "
                         "another file")
  return path


@contextlib.contextmanager
def claimed_output(path: run_dir.Path, flag: str, program: str,
                   settings: Mapping, overwrite: bool,
                   what: str) -> Iterator[str]:
  """Hold the file `path` for `program` for the block, which writes it
  whole (`run_dir.atomic_write`): checked (`check_output`), locked
  (`claimed_file`), and its manifest naming `program` and `settings`
  written beside it before the block. A block that raises before the
  file exists takes its manifest away again."""
  path = check_output(path, flag, program, settings, overwrite)
  with claimed_file(path, flag, what):
    # Checked again under the lock: another writer may have come first.
    check_output(path, flag, program, settings, overwrite)
    manifest = {"format": MANIFEST_FORMAT, "program": program,
                "settings": dict(settings),
                "entries": [os.path.basename(path)]}
    text = json.dumps(manifest, indent=1) + "\n"
    with one_line(path):
      run_dir.atomic_write(file_manifest(path),
                           lambda f: f.write(text.encode("utf-8")))
    try:
      yield path
    except BaseException:
      if not os.path.lexists(path):
        run_dir.remove_path(file_manifest(path))
      raise


@contextlib.contextmanager
def one_line(path: run_dir.Path) -> Iterator[None]:
  """Re-raise an OSError of the block as a ValueError of one line naming
  the path (`refusal`)."""
  try:
    yield
  except OSError as e:
    if e.errno is None:
      raise
    raise ValueError(refusal(e, path)) from None



def read_inputs(path: run_dir.Path) -> dict | None:
  """Return the input identities the run at `path` recorded, None where
  it recorded none (no run, or one an older version made)."""
  try:
    with open(os.path.join(path, run_dir.INPUTS_FILE),
              encoding="utf-8") as f:
      recorded = json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{os.path.join(path, run_dir.INPUTS_FILE)} cannot be "
                     f"read ({e}); pass --overwrite to train the run again, "
                     "or choose a new --output_dir") from None
  return recorded if isinstance(recorded, dict) else None


def check_inputs(path: run_dir.Path, inputs: Mapping,
                 overwrite: bool) -> None:
  """Raise ValueError (one line, nothing written) unless the run at `path`
  read the same input files as `inputs` (`{flag: file_identity}`, or for
  a directory `{flag: files_identity}`): a resume against other data
  would continue one run on another's. `overwrite` replaces the run, and
  a run without a record (an older version's) is taken as it is."""
  recorded = None if overwrite else read_inputs(path)
  if recorded is None:
    return
  changes = settings_changes(recorded, inputs)
  if changes:
    raise ValueError(
      f"{os.path.abspath(os.fspath(path))} holds a run of other input data "
      f"({'; '.join(changes)}); resume it on the original data, choose a "
      "new --output_dir, or pass --overwrite to train it again")


def write_inputs(path: run_dir.Path, inputs: Mapping) -> None:
  """Record `inputs` as the identity of the files the run at `path`
  reads (atomically)."""
  text = json.dumps(dict(inputs), indent=1) + "\n"
  run_dir.atomic_write(os.path.join(path, run_dir.INPUTS_FILE),
                       lambda f: f.write(text.encode("utf-8")))
