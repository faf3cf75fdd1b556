"""The figures of a run's slow evals, drawn off the training loop.

One background thread of the writing process takes the evaluator's renders
(`recipe.evaluation.Renderer`) and hands each to a niced child process
(`render_process`), so that the loop never waits for matplotlib. At most
one render runs and one waits, a newer one replacing the waiting one, and
rendering is held to `--figure_cpu_share` of one core
(`start_figure_worker`).
"""

import functools
import math
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

from decompax.bin import render_process
from decompax.recipe import evaluation


class FigureWorker(NamedTuple):
  """`submit(job)` hands a render over without waiting; `close()` draws the
  waiting job and stops; `drain()` draws it and keeps the worker."""

  submit: Callable[[Callable[[], Any]], None]
  close: Callable[[], None]
  drain: Callable[[], None] = lambda: None


def start_figure_worker(enabled: bool, cpu_share: float = 1.0,
                        clock: Callable[[], float] = time.monotonic
                        ) -> FigureWorker:
  """Return a one-thread render queue (a no-op one when not `enabled`).

  At most one render runs and one waits; a newer job replaces the waiting
  one. After a render of `t` seconds the worker rests until `t / cpu_share`
  have passed since it began, so over a run rendering takes at most
  `cpu_share` of one core: where the step keeps every core busy (training
  on CPU) slow evals at a short cadence would otherwise take that time from
  the step. `drain()` and `close()` skip the rest, so the newest figures are
  always drawn.
  """
  if not enabled:
    return FigureWorker(lambda job: None, lambda: None)
  if not 0.0 < cpu_share <= 1.0:
    raise ValueError(f"the figures' CPU share must lie in (0, 1], got "
                     f"{cpu_share}")
  # Shared by the thread and its callers, guarded by `changed`: the job
  # waiting (at most one), whether one is being drawn, how many callers
  # are draining, and whether the worker is closing.
  queue = types.SimpleNamespace(changed=threading.Condition(), waiting=None,
                                busy=False, flushing=0, closing=False)
  thread = threading.Thread(target=_work, args=(queue, cpu_share, clock),
                            name="decompax-figures", daemon=True)
  thread.start()
  return FigureWorker(functools.partial(_submit, queue),
                      functools.partial(_close, queue, thread),
                      functools.partial(_drain, queue))


def _next_job(queue: types.SimpleNamespace, rest_until: float,
              clock: Callable[[], float]) -> Optional[Callable[[], Any]]:
  """Wait for a job and the end of the rest (skipped when draining or
  closing); return it, marked busy, or None once closed with none left."""
  with queue.changed:
    while queue.waiting is None or not (queue.flushing or queue.closing
                                        or clock() >= rest_until):
      if queue.waiting is None and queue.closing:
        return None
      queue.changed.wait(
        None if queue.waiting is None else rest_until - clock())
    job, queue.waiting, queue.busy = queue.waiting, None, True
    return job


def _work(queue: types.SimpleNamespace, cpu_share: float,
          clock: Callable[[], float]) -> None:
  rest_until = -math.inf
  while (job := _next_job(queue, rest_until, clock)) is not None:
    began = clock()
    try:
      job()
    except Exception:  # a failed figure must not end the run
      print("[eval] figure rendering failed:\n" + traceback.format_exc(),
            file=sys.stderr, flush=True)
    rest_until = began + (clock() - began) / cpu_share
    with queue.changed:
      queue.busy = False
      queue.changed.notify_all()


def _submit(queue: types.SimpleNamespace, job: Callable[[], Any]) -> None:
  with queue.changed:
    queue.waiting = job  # the one it replaces is stale
    queue.changed.notify_all()


def _drain(queue: types.SimpleNamespace) -> None:
  with queue.changed:
    queue.flushing += 1
    queue.changed.notify_all()
    while queue.waiting is not None or queue.busy:
      queue.changed.wait()
    queue.flushing -= 1


def _close(queue: types.SimpleNamespace, thread: threading.Thread) -> None:
  with queue.changed:
    queue.closing = True
    queue.changed.notify_all()
  thread.join()


def lazy_render_process() -> render_process.RenderProcess:
  """Return a render process started at its first job (runs without slow
  evals never start one)."""
  started: list[render_process.RenderProcess] = []

  def run(job):
    if not started:
      started.append(render_process.start())
    started[0].run(job)

  def close():
    if started:
      started[0].close()

  return render_process.RenderProcess(run, close)


def renderer(enabled: bool, cpu_share: float = 1.0) -> evaluation.Renderer:
  """Return the renderer of an evaluator: a figure worker (a no-op one when
  not `enabled`) feeding a render process started at its first job."""
  worker = start_figure_worker(enabled, cpu_share)
  off_loop = lazy_render_process()

  def close():
    worker.close()
    off_loop.close()

  return evaluation.Renderer(
    lambda job: worker.submit(functools.partial(off_loop.run, job)), close,
    worker.drain)
