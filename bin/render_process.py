"""A niced child process that renders eval figures off the training loop.

Matplotlib holds the GIL for most of a render; in a thread of the training
process it slows the loop's dispatch, and at normal priority it competes
for the same cores as the step. The child runs at the lowest priority
(`NICENESS`), so it mostly takes the cycles the step leaves idle; where the
step keeps every core busy, `bin/figure_worker.start_figure_worker` also caps
the renders' share of a core. Jobs are pickled
callables sent over the child's stdin, one at a time; the child answers one
status byte per job and prints a failed job's traceback to the shared
stderr, never ending the run.

The child dies with the training process, whatever ends it: on Linux through
a parent-death signal, elsewhere within `_POLL_S` of noticing it was
orphaned. An audit hook also checks for the parent before every file the
child creates, renames or removes, so a killed run's directory is never
written, or recreated, after the kill. Ctrl-C and SIGTERM are left to the
parent: both reach a whole process group (a terminal's Ctrl-C, `timeout`, a
scheduler's requeue), and the parent answers them by finishing its step,
saving and drawing its last figures, which need the child alive.

`python -m decompax.bin.render_process <parent pid>` is the child's entry
point.
"""

import contextlib
import ctypes
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

NICENESS = 19
_OK, _FAILED = b"0", b"1"
_LENGTH_BYTES = 8
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_S = 0.2
# Audit events of calls that change the file system; `open` counts when its
# flags can write.
_CHANGES = frozenset({"os.rename", "os.mkdir", "os.remove", "os.rmdir",
                      "os.truncate", "os.link", "os.symlink",
                      "shutil.rmtree"})
_WRITE_FLAGS = (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND
                | os.O_TRUNC)


class RenderProcess(NamedTuple):
  """`run(job)` renders `job` in the child and waits; `close()` ends it."""

  run: Callable[[Callable[[], Any]], None]
  close: Callable[[], None]


def start() -> RenderProcess:
  """Start the child; its stderr is this process's.

  On Linux the child also dies with the thread that calls this (the
  parent-death signal follows the creating thread), so start it from the
  thread that runs its jobs.
  """
  child = subprocess.Popen(
    [sys.executable, "-P", "-m", "decompax.bin.render_process",
     str(os.getpid())],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE)

  def run(job):
    payload = pickle.dumps(job)
    try:
      child.stdin.write(len(payload).to_bytes(_LENGTH_BYTES, "little"))
      child.stdin.write(payload)
      child.stdin.flush()
    except BrokenPipeError:
      status = b""
    else:
      status = child.stdout.read(1)
    # A failed job's traceback is already on stderr; the next job may work.
    if status not in (_OK, _FAILED):
      raise RuntimeError(f"the render process exited (status "
                         f"{child.poll()}); later figures are not drawn")

  def close():
    if child.stdin and not child.stdin.closed:
      try:
        child.stdin.close()
      except BrokenPipeError:
        pass
    child.wait()

  return RenderProcess(run, close)


def _read_job(stream: io.BufferedIOBase) -> Callable[[], Any] | None:
  header = stream.read(_LENGTH_BYTES)
  if len(header) < _LENGTH_BYTES:
    return None  # the parent closed the pipe: no more jobs
  length = int.from_bytes(header, "little")
  payload = stream.read(length)
  if len(payload) < length:
    return None  # the parent exited mid-job (a requeue): nothing to draw
  return pickle.loads(payload)


def serve(jobs: io.BufferedIOBase, answers: io.BufferedIOBase) -> None:
  """Run every job read from `jobs`, answering a status byte for each."""
  while (job := _read_job(jobs)) is not None:
    try:
      job()
      status = _OK
    except Exception:  # a failed figure must not end the run
      print("[eval] figure rendering failed:\n" + traceback.format_exc(),
            file=sys.stderr, flush=True)
      status = _FAILED
    try:
      answers.write(status)
      answers.flush()
    except BrokenPipeError:
      return  # the parent has exited; its run ends without these figures


def _orphaned(parent: int) -> bool:
  # An orphan is adopted by init or a subreaper: its parent id changes.
  return os.getppid() != parent


def _set_parent_death_signal() -> None:
  if sys.platform.startswith("linux"):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _watch_parent(parent: int) -> None:
  """Exit the process once `parent` is gone; polls, for any platform."""
  while not _orphaned(parent):
    time.sleep(_POLL_S)
  os._exit(0)


def _write_guard(parent: int) -> Callable[[str, tuple], None]:
  """Return an audit hook that exits the process, before the call, when a
  file system change is attempted after `parent` is gone."""

  def hook(event: str, args: tuple) -> None:
    writes = event in _CHANGES or (
      event == "open" and isinstance(args[2], int)
      and args[2] & _WRITE_FLAGS)
    if writes and _orphaned(parent):
      os._exit(0)

  return hook


def main(parent: int) -> None:
  """Serve jobs from stdin for as long as `parent` lives, then exit."""
  _set_parent_death_signal()
  # Also catches a parent that died before the signal was armed.
  threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
  # Jobs are arbitrary callables: a hook is the one place that sees every
  # write they make.
  sys.addaudithook(_write_guard(parent))
  for stop in (signal.SIGINT, signal.SIGTERM):
    signal.signal(stop, signal.SIG_IGN)
  os.nice(NICENESS)
  with contextlib.suppress(BrokenPipeError):  # stderr gone with the parent
    serve(sys.stdin.buffer, sys.stdout.buffer)
  # Skips the exit-time flush of an answer pipe the parent may have closed.
  os._exit(0)


if __name__ == "__main__":
  main(int(sys.argv[1]))
