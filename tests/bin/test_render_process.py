"""The niced child process that renders eval figures."""

import functools
import io
import os
import pickle

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
