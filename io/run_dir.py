"""Run-directory records: flags, metrics, arrays, and flat tree paths.

A run directory holds `flags.txt`, `metrics.jsonl`, `figures/` and `.npz`
files. Whole files are written by `atomic_write` (temporary file in the same
directory, fsync, `os.replace`), so a crash leaves the old file or the new
one, never half of one (the temporary a killed writer leaves,
`remove_stale_temporaries` removes later). Metrics are appended one JSON line
at a time instead, and readers skip a line torn by a crash. While a run
lives, its writer holds the lock of `.lock` (`lock_run_dir`), so a second
trainer cannot write there; `lock_dir` locks any other directory so.

Replacing a run (`overwrite`) removes only what a run wrote: the entries of
`RUN_ENTRIES` of a directory whose `flags.txt` a run wrote, and of those the
browsable `figures/` and `report/` only when each file in them is listed in
their `.run_files`, the record `write_run_file` keeps of what it wrote.
Anything else there makes the replacement a one-line refusal.

Array files map slash-joined tree paths (`components/mlp_up/v`) to arrays,
so files stay readable when record classes are renamed.
"""

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import shutil
import socket
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 & co. as numpy dtypes)
import numpy as np
from jaxtyping import PyTree

Path = str | os.PathLike

FLAGS_FILE = "flags.txt"
METRICS_FILE = "metrics.jsonl"
# A `--restarts` run's candidate runs and its record of the one it kept.
CANDIDATES_DIR = "candidates"
CHOICE_FILE = "restarts.json"
# Entries a run writes; overwriting a run removes these and nothing else,
# so a mistyped run directory never loses files the run did not create.
# The identity of the files a run reads (`owned_dir.check_inputs`).
INPUTS_FILE = "inputs.json"
RUN_ENTRIES = (FLAGS_FILE, METRICS_FILE, "figures", "decomposition.npz",
               "target.npz", "checkpoints", "run_info.json", "profile",
               "NO_CHECKPOINTS", "report", CANDIDATES_DIR, CHOICE_FILE,
               "wandb.json", INPUTS_FILE)
# The entries of RUN_ENTRIES a run keeps as directories; the rest are files.
RUN_DIRS = ("figures", "checkpoints", "profile", "report", CANDIDATES_DIR)
# Directories people browse, and may add files to: each keeps a record of
# the files the run wrote there (`write_run_file`), and an overwrite
# removes them only when they hold nothing else.
RECORDED_DIRS = ("figures", "report")
RECORD_FILE = ".run_files"
# Held by the live run's writer; never in RUN_ENTRIES, so an overwrite
# keeps it and cannot take a live run's directory.
LOCK_FILE = ".lock"
# flock errors of file systems that do not lock (Lustre mounted noflock).
_NO_LOCKING = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)
_METADATA_KEY = "__metadata__"
# Dtype names per array: numpy stores ml_dtypes (bfloat16) as raw void bytes.
_DTYPES_KEY = "__dtypes__"


def _temporary_pattern(path: str) -> re.Pattern:
  # What `atomic_write`'s mkstemp names: `.NAME.` + 8 of [a-z0-9_] + `.tmp`.
  return re.compile(rf"\.{re.escape(os.path.basename(path))}\.[a-z0-9_]{{8}}"
                    r"\.tmp")


def _try_lock(fd: int) -> bool:
  """Take `fd`'s exclusive flock without waiting; False when another
  process holds it or the file system cannot lock."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    return False
  return True


def atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> str:
  """Return `path` after `write(file)` has atomically replaced its content.

  The parent directory must exist. If `write` raises, the destination is
  untouched and the temporary file is removed. The temporary is locked
  (flock) until it is renamed into place, which tells a live writer's from
  one a killed writer left (`remove_stale_temporaries`).
  """
  path = os.fspath(path)
  parent = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(
    dir=parent, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      _try_lock(fd)
      os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide results from others
      write(f)
      f.flush()
      os.fsync(f.fileno())
      # Renamed while still locked: the lock never lapses on a temporary.
      os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise
  fsync_dir(parent)
  return path


def _recorded(directory: str) -> set[str]:
  """Return the names `write_run_file` listed in `directory`."""
  try:
    with open(os.path.join(directory, RECORD_FILE), encoding="utf-8",
              errors="replace") as f:
      return {line.strip() for line in f if line.strip()}
  except FileNotFoundError:
    return set()


def write_run_file(path: Path, write: Callable[[BinaryIO], Any]) -> str:
  """Return `path` after `atomic_write(path, write)`, its name first listed
  in its directory's `.run_files` (so that a run replaced by `overwrite`
  takes it along, and nothing else there)."""
  path = os.fspath(path)
  directory, name = os.path.split(os.path.abspath(path))
  if name not in _recorded(directory):
    # Listed before it exists: a crash between the two leaves a name
    # without a file, never a file of the run's that looks like a user's.
    with open(os.path.join(directory, RECORD_FILE), "a",
              encoding="utf-8") as f:
      f.write(name + "\n")
  return atomic_write(path, write)


def _remove_if_unlocked(path: str) -> bool:
  """Remove `path` unless a live process holds its lock; return whether it
  was removed."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
  except OSError:  # gone already (renamed into place), or a link
    return False
  try:
    # A free lock means its writer died (where the file system cannot lock,
    # the file stays). Is it still the file under that name?
    if not _try_lock(fd) or os.fstat(fd).st_ino != os.lstat(path).st_ino:
      return False
    os.remove(path)
    return True
  except FileNotFoundError:
    return False
  finally:
    os.close(fd)


def remove_stale_temporaries(path: Path) -> list[str]:
  """Remove the temporaries of `path` that killed `atomic_write`s left
  beside it; return their names.

  Only names `atomic_write` gives a temporary of `path` qualify
  (`.NAME.xxxxxxxx.tmp`), and only those no live writer holds locked.
  """
  path = os.path.abspath(os.fspath(path))
  parent = os.path.dirname(path)
  pattern = _temporary_pattern(path)
  try:
    names = sorted(os.listdir(parent))
  except OSError:
    return []
  return [name for name in names if pattern.fullmatch(name)
          and _remove_if_unlocked(os.path.join(parent, name))]


@contextlib.contextmanager
def staged_directory(destination: Path, prefix: str) -> Iterator[str]:
  """Yield a new directory beside `destination` to fill; when the block ends
  it replaces `destination`, so readers find the whole old copy or the
  whole new one. A block that raises leaves `destination` as it was and
  the staging directory removed."""
  parent = os.path.dirname(os.path.abspath(destination))
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=prefix, dir=parent)
  try:
    os.chmod(staging, 0o755)  # mkdtemp's 0o700 would hide it from others
    yield staging
    if os.path.isdir(destination):
      shutil.rmtree(destination)
    os.replace(staging, destination)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  fsync_dir(parent)


def fsync_dir(path: str) -> None:
  """Make a rename inside `path` durable (where directories can be opened)."""
  # Not every platform can open a directory.
  with contextlib.suppress(OSError):
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def _flag_values(text: str) -> dict[str, str]:
  """Return the `--name=value` lines of a flags text as {name: value}."""
  values = {}
  for line in text.splitlines():
    name, sep, value = line.removeprefix("--").partition("=")
    if line.startswith("--") and sep:
      values[name] = value
  return values


def _shown(value: str | None) -> str:
  if value is None:
    return "not recorded"
  return value or "unset"


def _differing(old: dict[str, str], new: dict[str, str],
               defaults: Mapping[str, str] | None) -> list[str]:
  # With the program's flag defaults, runs of an older version still
  # match: a flag it did not have counts at its default (the default keeps
  # the old behaviour), and a flag since removed no longer counts.
  names = []
  for name in sorted(old.keys() | new.keys()):
    if old.get(name) == new.get(name):
      continue
    if defaults is not None:
      if name not in new and name not in defaults:
        continue
      if name not in old and new[name] == defaults.get(name):
        continue
    names.append(name)
  return names


def _listed(old: dict[str, str], new: dict[str, str], names: list[str],
            shown: int = 4) -> str:
  changes = [f"--{n} was {_shown(old.get(n))}, now {_shown(new.get(n))}"
             for n in names[:shown]]
  if len(names) > shown:
    changes.append(f"and {len(names) - shown} more")
  return "; ".join(changes)


def flag_changes(old_text: str, new_text: str, shown: int = 4,
                 defaults: Mapping[str, str] | None = None) -> str:
  """Return the flags that differ, `--lr was 0.001, now 0.002; ...`."""
  old, new = _flag_values(old_text), _flag_values(new_text)
  names = _differing(old, new, defaults)
  if not names:
    return f"its {FLAGS_FILE} lists the same values in another form"
  return _listed(old, new, names, shown)


class RunConflict(ValueError):
  """A directory holds another run (or unknown run files), which an
  overwrite would replace; the message is one line."""


def _conflict(path: str, flags_text: str,
              defaults: Mapping[str, str] | None = None,
              ignored: tuple[str, ...] = ()) -> str | None:
  """Return why the run directory `path` cannot host a run with
  `flags_text` and the fix, or None."""
  flags_path = os.path.join(path, FLAGS_FILE)
  with open(flags_path, encoding="utf-8", errors="replace") as f:
    old = _flag_values(f.read())
  new = _flag_values(flags_text)
  names = [n for n in _differing(old, new, defaults) if n not in ignored]
  if not names:
    return None
  return (f"holds a run with other flags ({_listed(old, new, names)}); "
          "resume it with the same flags, replace it, or choose another "
          "directory")


def _present(path: str) -> list[str]:
  return [e for e in RUN_ENTRIES if os.path.lexists(os.path.join(path, e))]


def _misplaced(path: str) -> str | None:
  """Return why an entry of `path` named as a run's is not of the kind the
  run writes (a file where it keeps a directory, or the reverse), and the
  fix, or None: the run could neither write there nor replace it."""
  for entry in _present(path):
    full = os.path.join(path, entry)
    if entry in RUN_DIRS and not os.path.isdir(full):
      kind = "a directory"
    elif entry not in RUN_DIRS and not os.path.isfile(full):
      kind = "a regular file"
    else:
      continue
    return (f"holds {entry}, which is not {kind} as a run's {entry} is, so "
            "no run wrote it; move it away or choose another directory")
  return None


def _unrecorded(path: str) -> list[str]:
  """Return the files in the recorded directories of run `path` (and of its
  `--restarts` candidates) that their `.run_files` does not list (atomic
  leftovers of listed files count as listed)."""
  found = []
  candidates = os.path.join(path, CANDIDATES_DIR)
  if os.path.isdir(candidates) and not os.path.islink(candidates):
    for entry in sorted(os.listdir(candidates)):
      found.extend(f"{CANDIDATES_DIR}/{entry}/{name}" for name in
                   _unrecorded(os.path.join(candidates, entry)))
  for name in RECORDED_DIRS:
    directory = os.path.join(path, name)
    if os.path.islink(directory) or not os.path.isdir(directory):
      continue  # a link is removed, never followed
    recorded = _recorded(directory)
    for entry in sorted(os.listdir(directory)):
      leftover = entry.endswith(".tmp") and any(
        entry.startswith(f".{r}.") for r in recorded)
      if entry not in recorded | {RECORD_FILE} and not leftover:
        found.append(f"{name}/{entry}")
  return found


def _foreign(path: str) -> str | None:
  """Return why replacing the run at `path` would remove files that no run
  wrote, and the fix, or None."""
  if not os.path.isfile(os.path.join(path, FLAGS_FILE)):
    return (f"holds {', '.join(_present(path))} but no {FLAGS_FILE}, so no "
            "run wrote them and they are not a run's to replace; move them "
            "away or choose another directory")
  unrecorded = _unrecorded(path)
  if unrecorded:
    shown = ", ".join(unrecorded[:3]) + (
      f" and {len(unrecorded) - 3} more" if len(unrecorded) > 3 else "")
    return (f"holds {shown}, which the run did not write (not in its "
            f"{RECORD_FILE}), so replacing the run would delete it; move it "
            "away or choose another directory")
  return None


def remove_path(path: Path) -> bool:
  """Remove the file or directory tree at `path` (a link itself, never
  what it points to), if any; return whether there was one."""
  path = os.fspath(path)
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
    return True
  try:
    os.remove(path)
  except FileNotFoundError:
    return False
  return True


def _remove_run_entries(path: str) -> None:
  for entry in RUN_ENTRIES:
    full = os.path.join(path, entry)
    if os.path.isdir(full) and not os.path.islink(full):
      shutil.rmtree(full)
    elif os.path.lexists(full):
      os.remove(full)


def write_refusal(path: str, error: OSError) -> str:
  """Return, on one line, why `path` could not be written and the fix."""
  reason = error.strerror or str(error)
  if error.errno in (errno.ENOSPC, errno.EDQUOT):
    fix = "free space there and rerun, or choose another directory"
  elif error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
    fix = "choose a writable directory"
  else:
    fix = "choose another directory"
  return f"cannot write to {path}: {reason}; {fix}"


def _check_writable(directory: str, size: int) -> None:
  """Raise ValueError unless `size` bytes can be written in `directory`."""
  # Asking os.access is not enough: root passes it on a read-only mount and
  # it knows nothing of free space. A probe of the flags file's size fails
  # the way the first real write would, before anything is written.
  try:
    fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-probe.")
  except OSError as e:
    raise ValueError(write_refusal(directory, e)) from None
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(b"\0" * size)
      f.flush()
      os.fsync(f.fileno())
  except OSError as e:
    raise ValueError(write_refusal(directory, e)) from None
  finally:
    with contextlib.suppress(OSError):
      os.remove(probe)


def _not_a_directory(path: str) -> str:
  if os.path.isfile(path):
    return "is a file, not a directory"
  return "is not a directory"


def _check_parent(path: str) -> None:
  """Raise ValueError unless the parent of `path` is a directory."""
  parent = os.path.dirname(path)
  if os.path.isdir(parent):
    return
  ancestor = parent
  while not os.path.lexists(ancestor):
    ancestor = os.path.dirname(ancestor)
  if os.path.isdir(ancestor):
    raise ValueError(
      f"output parent {parent} does not exist; create it or choose another"
      " directory")
  raise ValueError(
    f"{ancestor} {_not_a_directory(ancestor)}; choose another directory")


def _check_existing(path: str, flags_text: str, overwrite: bool,
                    defaults: Mapping[str, str] | None,
                    ignored: tuple[str, ...]) -> None:
  """Raise ValueError unless the existing directory `path` can host this
  run (see `check_run_dir`)."""
  present = _present(path)
  if not present:
    return  # nothing of a run's: a new run beside what is there
  reason = _misplaced(path)
  if reason is None and (overwrite or not os.path.isfile(
      os.path.join(path, FLAGS_FILE))):
    reason = _foreign(path)
  if reason is not None:
    raise ValueError(f"output dir {path} {reason}")
  reason = _conflict(path, flags_text, defaults, ignored)
  if reason is not None and not overwrite:
    raise RunConflict(f"output dir {path} {reason}")


def check_run_dir(path: Path, flags_text: str, overwrite: bool,
                  defaults: Mapping[str, str] | None = None,
                  ignored: tuple[str, ...] = ()) -> None:
  """Raise ValueError, leaving nothing behind, unless `path` can host this run.

  The parent must be a directory. An existing directory holding run
  entries must hold a run (its `flags.txt`), each entry of the kind the
  run writes, and the same flags (a resume; with `defaults`, the
  program's `{flag: default}`, a flag added or removed since the run was
  made does not count; flags in `ignored` never count) unless `overwrite`
  (else RunConflict). With `overwrite`, every file it would remove must be
  one a run wrote (`_foreign`). The directory that will receive the run's
  first file must take one of `flags_text`'s size, and the run's existing
  subdirectories a byte (probe files, removed again).
  """
  path = os.path.abspath(os.fspath(path))
  _check_parent(path)
  if os.path.lexists(path) and not os.path.isdir(path):
    raise ValueError(f"output dir {path} {_not_a_directory(path)}; choose "
                     "another directory")
  if os.path.isdir(path):
    _check_existing(path, flags_text, overwrite, defaults, ignored)
  _check_writable(path if os.path.isdir(path) else os.path.dirname(path),
                  len(flags_text.encode("utf-8")))
  # The directories the run writes into next (checkpoints first) take a
  # file too, or the launch would fail after it had begun writing.
  for entry in RUN_DIRS:
    full = os.path.join(path, entry)
    if entry != CANDIDATES_DIR and os.path.isdir(full):
      _check_writable(full, 1)


def prepare_run_dir(path: Path, flags_text: str, overwrite: bool,
                    defaults: Mapping[str, str] | None = None,
                    ignored: tuple[str, ...] = ()) -> None:
  """Create or reuse the run directory `path` and write its `flags.txt`.

  A directory whose `flags.txt` matches `flags_text` is reused (resume; see
  `check_run_dir` for `defaults` and `ignored`), its `flags.txt` rewritten
  as this version records it (with this launch's values of `ignored`).
  With `overwrite`, the entries in `RUN_ENTRIES` are removed first; other
  files are kept. Raises ValueError, having created or removed nothing,
  when `check_run_dir` does.
  """
  check_run_dir(path, flags_text, overwrite, defaults, ignored)
  path = os.path.abspath(os.fspath(path))
  if overwrite and os.path.isdir(path):
    _remove_run_entries(path)
  os.makedirs(path, exist_ok=True)
  atomic_write(os.path.join(path, FLAGS_FILE),
               lambda f: f.write(flags_text.encode("utf-8")))


def _holder(fd: int) -> str:
  """Return the holder recorded in the lock file `fd`, on one line."""
  text = os.pread(fd, 256, 0).decode("utf-8", "replace")
  return " ".join(text.split()) or "another process"


def _lock_refusal(what: str, path: str, error: OSError) -> ValueError:
  return ValueError(f"cannot lock {what} {path}: {error.strerror}; "
                    "choose another directory")


def _open_lock(what: str, path: str, lock_path: str | None = None) -> int:
  try:
    if lock_path is None:
      with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    return os.open(lock_path or os.path.join(path, LOCK_FILE),
                   os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise _lock_refusal(what, path, e) from e


def _pid_alive(pid: int) -> bool:
  # Read off /proc (a library signals no process); where there is no
  # /proc, every holder may live.
  return not os.path.isdir("/proc/self") or os.path.exists(f"/proc/{pid}")


def holder_alive(text: str) -> bool:
  """Return whether the holder a lock file records (`pid N on HOST`) may
  still live: one of another host, or of an unreadable record, may; one
  of this host lives when its pid does."""
  words = text.split()
  if len(words) != 4 or words[0] != "pid" or words[2] != "on":
    return bool(words)
  if words[3] != socket.gethostname() or not words[1].isdigit():
    return True
  return int(words[1]) != os.getpid() and _pid_alive(int(words[1]))


def _check_recorded_holder(fd: int, what: str, path: str, wait: str) -> None:
  """Where the file system cannot lock, refuse while the holder recorded
  in the lock file `fd` lives; a dead one's record is taken over."""
  holder = _holder(fd)
  if holder != "another process" and holder_alive(holder):
    os.close(fd)
    raise ValueError(f"{what} {path} is in use by {holder}; {wait}")


def lock_run_dir(path: Path) -> int:
  """Return an open descriptor holding the exclusive lock of run `path`
  (`lock_dir`: a second trainer is refused)."""
  return lock_dir(path, "output dir",
                  "wait for that run to end or choose another directory")


def lock_dir(path: Path, what: str, wait: str) -> int:
  """Return an open descriptor holding the exclusive lock of directory
  `path`, which holds `what` (named in errors).

  Creates `path` (its parent must exist) and `path/.lock`, into which the
  holder writes `pid <pid> on <host>`. The lock lives as long as the
  descriptor, so it lasts for the process's life unless closed, and the
  kernel drops it when the process dies: the file a dead process left
  never blocks. Raises a one-line ValueError naming the holder, and `wait`
  as the fix, when another process holds the lock. Where the file system
  cannot lock, the recorded holder decides (`holder_alive`): a live one is
  refused, a dead one on this host is taken over, with a warning.
  """
  path = os.path.abspath(os.fspath(path))
  return _take_lock(_open_lock(what, path), what, path, wait)


@contextlib.contextmanager
def locked_file(path: Path, what: str, wait: str) -> Iterator[None]:
  """Hold the exclusive lock of the file `path` (which need not exist yet)
  for the block, as `lock_dir` does for a directory; its lock file,
  `.NAME.lock` beside it, is removed when the block ends (left only by a
  killed holder, and then taken over)."""
  path = os.path.abspath(os.fspath(path))
  lock_path = os.path.join(os.path.dirname(path),
                           f".{os.path.basename(path)}.lock")
  while True:
    fd = _take_lock(_open_lock(what, path, lock_path), what, path, wait)
    # A holder that ended removed the file it locked: lock the one there.
    try:
      if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
        break
    except FileNotFoundError:
      pass
    os.close(fd)
  try:
    yield
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.remove(lock_path)
    os.close(fd)


def _take_lock(fd: int, what: str, path: str, wait: str) -> int:
  """Return `fd` holding its file's lock, the holder recorded in it."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = _holder(fd)
    os.close(fd)
    raise ValueError(
      f"{what} {path} is in use by {holder}; {wait}") from None
  except OSError as e:
    if e.errno not in _NO_LOCKING:
      os.close(fd)
      raise _lock_refusal(what, path, e) from e
    _check_recorded_holder(fd, what, path, wait)
    warnings.warn(f"{path} cannot be locked ({e.strerror}); only a live "
                  "writer on this host is refused")
  me = f"pid {os.getpid()} on {socket.gethostname()}\n".encode("utf-8")
  os.ftruncate(fd, 0)
  os.pwrite(fd, me, 0)
  return fd


def _json_default(value: Any) -> Any:
  # numpy and jax scalars (including 0-d and 1-element arrays) become Python
  # numbers; anything else is a bug in the caller's record.
  if isinstance(value, (np.generic, np.ndarray, jax.Array)) and (
      np.size(value) == 1):
    return np.asarray(value).item()
  raise TypeError(f"cannot store {type(value).__name__} in a JSON record")


def append_metrics(path: Path, record: Mapping[str, Any]) -> None:
  """Append `record` to the JSON-lines file `path` as one line.

  Scalars (Python, numpy, jax) are stored as Python numbers; NaN and infinity
  are kept (Python's json reads them back). There is no fsync, so a crash can
  lose recent lines or tear the last one; `read_metrics` skips torn lines. A
  torn tail is closed with a newline first, so the new record stays whole.
  """
  line = json.dumps(dict(record), default=_json_default) + "\n"
  with open(path, "a+b") as f:
    size = f.seek(0, os.SEEK_END)
    if size:
      f.seek(size - 1)
      if f.read(1) != b"\n":
        line = "\n" + line
    f.write(line.encode("utf-8"))


def _parse_record(line: str) -> dict | None:
  try:
    record = json.loads(line)
  except json.JSONDecodeError:
    record = None
  return record if isinstance(record, dict) else None


def truncate_metrics(path: Path, last_step: int) -> int:
  """Drop the records of `path` past `last_step`; return how many were kept.

  A resumed run calls this with its restored step, so records that a killed
  attempt logged after its last save are rewritten, not duplicated. Torn
  lines go too; the file is replaced atomically.
  """
  if not os.path.exists(path):
    return 0
  kept = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
  text = "".join(json.dumps(r, default=_json_default) + "\n" for r in kept)
  atomic_write(path, lambda f: f.write(text.encode("utf-8")))
  return len(kept)


def scalar_values(record: Mapping[str, Any]) -> dict[str, float]:
  """Return a metrics record's finite numeric values but its step (what a
  scalar logger can plot; strings, flags and non-finite values left out)."""
  return {k: float(v) for k, v in record.items()
          if k != "step" and isinstance(v, (int, float))
          and not isinstance(v, bool) and math.isfinite(v)}


def read_metrics(path: Path) -> list[dict]:
  """Return the records of `path` in order; [] when it does not exist.

  Lines that do not decode to a JSON object (torn by a crash) are skipped.
  """
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8", errors="replace") as f:
    records = [_parse_record(line) for line in f if line.strip()]
  return [r for r in records if r is not None]


def candidate_dir(path: Path, index: int) -> str:
  """Return the directory of candidate `index` of the `--restarts` run at
  `path`."""
  return os.path.join(os.fspath(path), CANDIDATES_DIR, f"r{index}")


def read_choice(path: Path) -> dict | None:
  """Return the choice record of the `--restarts` run at `path`, None
  before it has chosen (or for any other run)."""
  choice = os.path.join(os.fspath(path), CHOICE_FILE)
  if not os.path.isfile(choice):
    return None
  fix = "delete it to choose again from the candidates' records"
  try:
    with open(choice, encoding="utf-8") as f:
      record = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{choice} is not JSON ({e}); {fix}") from None
  if not (isinstance(record, dict) and isinstance(record.get("chosen"), int)
          and not isinstance(record["chosen"], bool)):
    raise ValueError(f"{choice} names no chosen candidate (an integer "
                     f"'chosen'); {fix}")
  return record


def chosen_run(path: Path) -> str:
  """Return the run a directory stands for: itself, or for a `--restarts`
  run that has chosen, the chosen candidate's directory."""
  choice = read_choice(path)
  if choice is None:
    return os.fspath(path)
  return candidate_dir(path, choice["chosen"])


def metric_at(directory: Path, step: int, key: str) -> float | None:
  """Return the run's metric `key` logged at `step`, None where it has none
  (not there yet)."""
  for record in read_metrics(os.path.join(directory, METRICS_FILE)):
    if record.get("step") == step and key in record:
      return float(record[key])
  return None


def _write_npy(zf: zipfile.ZipFile, key: str, array: np.ndarray) -> None:
  with zf.open(f"{key}.npy", "w", force_zip64=True) as member:
    np.lib.format.write_array(member, array, allow_pickle=False)


def save_arrays(
  path: Path, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any]
) -> str:
  """Return `path` after atomically writing `arrays` and `metadata` as .npz.

  `metadata` must be JSON-serialisable; it is stored as the entry
  `__metadata__`, dtype names as `__dtypes__`. Arrays are not compressed.
  """
  arrays = {k: np.asarray(a) for k, a in arrays.items()}
  reserved = {_METADATA_KEY, _DTYPES_KEY} & set(arrays)
  if reserved:
    raise ValueError(f"array keys {sorted(reserved)} are reserved")
  meta = json.dumps(dict(metadata), default=_json_default)
  dtypes = json.dumps({k: a.dtype.name for k, a in arrays.items()})

  def write(f: BinaryIO) -> None:
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as zf:
      for key, array in arrays.items():
        _write_npy(zf, key, array)
      _write_npy(zf, _METADATA_KEY, np.array(meta))
      _write_npy(zf, _DTYPES_KEY, np.array(dtypes))

  return atomic_write(path, write)


def _restore_dtype(array: np.ndarray, name: str) -> np.ndarray:
  if array.dtype.name == name:
    return array
  dtype = np.dtype(name)
  if array.dtype.kind != "V" or array.dtype.itemsize != dtype.itemsize:
    raise ValueError(f"stored as {array.dtype}, expected {name}")
  return array.view(dtype)


def _read_npz(path: str) -> tuple[dict[str, np.ndarray], dict]:
  with np.load(path, allow_pickle=False) as npz:
    raw = {k: npz[k] for k in npz.files}
  if not {_METADATA_KEY, _DTYPES_KEY} <= raw.keys():
    raise ValueError("not written by save_arrays (no metadata entry)")
  metadata = json.loads(raw.pop(_METADATA_KEY).item())
  dtypes = json.loads(raw.pop(_DTYPES_KEY).item())
  arrays = {k: _restore_dtype(a, dtypes.get(k, a.dtype.name))
            for k, a in raw.items()}
  return arrays, metadata


def load_arrays(path: Path) -> tuple[dict[str, np.ndarray], dict]:
  """Return the arrays and metadata written by `save_arrays`.

  Raises a one-line ValueError naming `path` when it is missing or corrupt.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ValueError(f"cannot read {path}: no such file")
  try:
    return _read_npz(path)
  except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as e:
    reason = " ".join(str(e).split()) or type(e).__name__
    raise ValueError(
      f"cannot read {path}: {reason}; delete it to retrain") from e


def _path_key(path: tuple) -> str:
  key = jax.tree_util.keystr(path, simple=True, separator="/")
  # An empty name or one holding "/" would make the flat key ambiguous.
  parts = key.split("/")
  if len(parts) != len(path) or not all(parts):
    raise ValueError(f"pytree path {path} cannot be written as a slash path")
  return key


def leaf_keys(tree: PyTree) -> tuple[list[str], list[Any]]:
  """Return the slash path and the leaf of every leaf, in flatten order."""
  with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
  keys = [_path_key(p) for p, _ in with_path]
  if len(set(keys)) != len(keys):
    raise ValueError(f"pytree paths collide: {keys}")
  return keys, [leaf for _, leaf in with_path]


def flatten_tree(tree: PyTree) -> dict[str, np.ndarray]:
  """Return the leaves of `tree` as host arrays keyed by slash-joined path.

  NamedTuple fields (GetAttrKey) contribute their names, dict entries
  (DictKey) their keys, and tuple or list entries (SequenceKey) their
  indices: `components/linear1/v`.
  """
  keys, leaves = leaf_keys(tree)
  return {k: np.asarray(leaf) for k, leaf in zip(keys, leaves)}


def _shape_dtype(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
  # Templates may hold arrays or jax.ShapeDtypeStruct from jax.eval_shape.
  dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
  return tuple(np.shape(leaf)), np.dtype(dtype)


def unflatten_into(
  template_tree: PyTree, flat: Mapping[str, np.ndarray]
) -> PyTree:
  """Return a tree shaped like `template_tree` with leaves taken from `flat`.

  Leaves are the host arrays of `flat` (place them with `jax.device_put`).
  Raises ValueError naming the first key that is missing, unexpected, or
  differs from the template in shape or dtype.
  """
  keys, leaves = leaf_keys(template_tree)
  for key, leaf in zip(keys, leaves):
    if key not in flat:
      raise ValueError(f"{key}: missing from the stored arrays")
    want, got = _shape_dtype(leaf), _shape_dtype(flat[key])
    if got != want:
      raise ValueError(
        f"{key}: stored shape/dtype {got[0]} {got[1]}, expected"
        f" {want[0]} {want[1]}")
  extra = sorted(set(flat) - set(keys))
  if extra:
    raise ValueError(f"{extra[0]}: not in the template ({len(extra)} extra)")
  treedef = jax.tree_util.tree_structure(template_tree)
  return jax.tree_util.tree_unflatten(
    treedef, [np.asarray(flat[k]) for k in keys])
