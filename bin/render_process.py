"""A niced child process that renders eval figures off the training loop.

Matplotlib holds the GIL for most of a render; in a thread of the training
process it slows the loop's dispatch, and at normal priority it competes
for the same cores as the step. The child runs at the lowest priority
(`NICENESS`), so it mostly takes the cycles the step leaves idle; where the
step keeps every core busy, `bin/evaluation.start_figure_worker` also caps
the renders' share of a core. Jobs are pickled
callables sent over the child's stdin, one at a time; the child answers one
status byte per job and prints a failed job's traceback to the shared
stderr, never ending the run.

`python -m decompax.bin.render_process` is the child's entry point.
"""

import io
import os
import pickle
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

NICENESS = 19
_OK, _FAILED = b"0", b"1"
_LENGTH_BYTES = 8


class RenderProcess(NamedTuple):
  """`run(job)` renders `job` in the child and waits; `close()` ends it."""

  run: Callable[[Callable[[], Any]], None]
  close: Callable[[], None]


def start() -> RenderProcess:
  """Start the child; its stderr is this process's."""
  child = subprocess.Popen(
    [sys.executable, "-P", "-m", "decompax.bin.render_process"],
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
      answers.write(_OK)
    except Exception:  # a failed figure must not end the run
      print("[eval] figure rendering failed:\n" + traceback.format_exc(),
            file=sys.stderr, flush=True)
      answers.write(_FAILED)
    try:
      answers.flush()
    except BrokenPipeError:
      return  # the parent has exited; its run ends without these figures


if __name__ == "__main__":
  os.nice(NICENESS)
  serve(sys.stdin.buffer, sys.stdout.buffer)
  # Skips the exit-time flush of an answer pipe the parent may have closed.
  os._exit(0)
