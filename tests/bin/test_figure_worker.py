"""bin/figure_worker: slow evals' renders drawn off the loop, the newest
first, within a share of one core."""

import threading
import time

import pytest

from decompax.bin import figure_worker


def test_figure_worker_never_blocks_and_renders_the_newest():
  worker = figure_worker.start_figure_worker(True)
  started, release, ran = threading.Event(), threading.Event(), []

  def slow_job():
    started.set()
    release.wait(5)
    ran.append("slow")

  worker.submit(slow_job)
  started.wait(5)
  begin = time.perf_counter()
  for i in range(5):
    worker.submit(lambda i=i: ran.append(i))
  assert time.perf_counter() - begin < 0.5
  release.set()
  worker.close()
  assert ran == ["slow", 4]  # stale waiting renders were replaced


def test_figure_worker_rests_to_hold_its_cpu_share():
  now = [0.0]
  worker = figure_worker.start_figure_worker(True, cpu_share=0.25,
                                          clock=lambda: now[0])
  drawn, finished = [], threading.Event()

  def render(label):
    now[0] += 1.0  # each render takes one (fake) second
    drawn.append(label)
    finished.set()

  worker.submit(lambda: render("first"))
  assert finished.wait(5)
  finished.clear()
  worker.submit(lambda: render("stale"))
  worker.submit(lambda: render("second"))
  time.sleep(0.2)  # inside the rest: 1 s of work allows 4 s per render
  assert drawn == ["first"]
  now[0] = 3.9
  time.sleep(0.2)
  assert drawn == ["first"]
  now[0] = 4.0
  worker.submit(lambda: render("third"))  # wakes the worker; replaces second
  assert finished.wait(5)
  assert drawn == ["first", "third"]


def test_figure_worker_drains_and_closes_without_resting():
  now = [0.0]
  worker = figure_worker.start_figure_worker(True, cpu_share=0.01,
                                          clock=lambda: now[0])
  drawn = []

  def render(label):
    now[0] += 1.0
    drawn.append(label)

  worker.submit(lambda: render("first"))
  worker.drain()
  worker.submit(lambda: render("drained"))
  worker.drain()  # the rest would last 99 fake seconds
  worker.submit(lambda: render("last"))
  worker.close()
  assert drawn == ["first", "drained", "last"]


def test_figure_worker_rejects_a_share_outside_one_core():
  for share in (0.0, 1.5):
    with pytest.raises(ValueError, match="CPU share"):
      figure_worker.start_figure_worker(True, cpu_share=share)


def test_failed_render_is_reported_and_the_worker_continues(capsys):
  worker = figure_worker.start_figure_worker(True)
  ran = []
  worker.submit(lambda: 1 / 0)
  time.sleep(0.2)
  worker.submit(lambda: ran.append(True))
  worker.close()
  assert ran == [True]
  assert "ZeroDivisionError" in capsys.readouterr().err


def test_disabled_worker_does_nothing():
  worker = figure_worker.start_figure_worker(False)
  ran = []
  worker.submit(lambda: ran.append(True))
  worker.close()
  assert ran == []
