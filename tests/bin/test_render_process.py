"""The niced child process that renders eval figures."""

import functools
import io
import os
import pickle
import shutil
import subprocess
import sys
import time

import pytest

from decompax.bin import render_process


def _framed(*jobs) -> io.BytesIO:
  stream = io.BytesIO()
  for job in jobs:
    payload = pickle.dumps(job)
    stream.write(len(payload).to_bytes(8, "little") + payload)
  stream.seek(0)
  return stream


def test_serve_answers_each_job_and_survives_a_failure(tmp_path, capsys):
  target = tmp_path / "done.txt"
  answers = io.BytesIO()
  render_process.serve(_framed(
    functools.partial(divmod, 1, 0),
    functools.partial(exec, f"open({str(target)!r}, 'w').write('ok')")),
    answers)
  assert answers.getvalue() == b"10"
  assert target.read_text() == "ok"
  assert "ZeroDivisionError" in capsys.readouterr().err


def test_child_renders_at_lower_priority_and_reports_its_death(tmp_path):
  out = tmp_path / "nice.txt"
  child = render_process.start()
  child.run(functools.partial(
    exec, f"import os; open({str(out)!r}, 'w').write(str(os.nice(0)))"))
  # The kernel caps niceness at 19, the lowest priority.
  assert int(out.read_text()) == min(19, os.nice(0) + render_process.NICENESS)
  with pytest.raises(RuntimeError, match="exited"):
    child.run(functools.partial(os._exit, 3))  # the child dies mid-job
  child.close()


def test_child_outlives_a_stop_signal_sent_to_its_process_group(tmp_path):
  # `timeout`, a scheduler's requeue and Ctrl-C signal the whole group; the
  # parent saves and draws its last figures after one, so the child stays.
  out = tmp_path / "after.txt"
  child = render_process.start()
  for stop in ("SIGTERM", "SIGINT"):
    child.run(functools.partial(
      exec, f"import os, signal; os.kill(os.getpid(), signal.{stop})"))
  child.run(functools.partial(
    exec, f"open({str(out)!r}, 'w').write('drawn')"))
  child.close()
  assert out.read_text() == "drawn"


# Hands the child a job that outlives this parent, then ends as `how` says.
_PARENT = """
import functools, os, sys, threading, time
from decompax.bin import render_process
started, late, how = sys.argv[1:]
job = functools.partial(exec, f"open({started!r}, 'w').close(); "
  f"import os, time; time.sleep(5); os.makedirs(os.path.dirname({late!r}));"
  f" open({late!r}, 'w').close()")
# Started from a thread, as `recipe/evaluation` starts it.
threading.Thread(target=lambda: render_process.start().run(job),
                 daemon=True).start()
while not os.path.exists(started):
  time.sleep(0.01)
if how == "exit":
  sys.exit(1)
time.sleep(60)
"""


def _python(*args, **kwargs):
  return subprocess.Popen([sys.executable, "-P", "-c", *args], **kwargs)


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_child_dies_with_its_parent_and_never_writes_after(tmp_path, how):
  run = tmp_path / "run"
  run.mkdir()
  started, late = tmp_path / "started", run / "figures" / "late.png"
  parent = _python(_PARENT, str(started), str(late), how,
                   stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
      time.sleep(0.01)
    if how == "kill":
      parent.kill()
    shutil.rmtree(run)  # the run is deleted once its trainer is gone
    # The child writes to the parent's stderr: the pipe ends with both.
    _, err = parent.communicate(timeout=1.5)
  finally:
    parent.kill()
  assert started.exists()
  assert not run.exists()
  assert "Traceback" not in err


def test_an_orphaned_child_exits_before_it_writes(tmp_path):
  allowed, refused = tmp_path / "allowed", tmp_path / "refused"
  child = _python(
    "import os, sys; from decompax.bin import render_process as r; "
    "sys.addaudithook(r._write_guard(os.getppid())); "
    "open(sys.argv[1], 'w').close(); "
    "sys.addaudithook(r._write_guard(-1)); open(sys.argv[1]).close(); "
    "print('read', flush=True); open(sys.argv[2], 'w'); print('wrote')",
    str(allowed), str(refused), stdout=subprocess.PIPE, text=True)
  out, _ = child.communicate(timeout=30)
  assert (child.returncode, out) == (0, "read\n")
  assert allowed.exists() and not refused.exists()


def test_the_parent_watch_ends_an_orphan():
  child = _python(
    "from decompax.bin import render_process as r; r._watch_parent(-1); "
    "print('survived')", stdout=subprocess.PIPE, text=True)
  assert child.communicate(timeout=30) == ("", None)
  assert child.returncode == 0
