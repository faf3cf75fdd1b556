"""Tests for decompax.io.run_dir."""

import errno
import fcntl
import json
import os
import pathlib
import socket
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.io import run_dir


class Factors(NamedTuple):
  v: jax.Array
  u: jax.Array


class State(NamedTuple):
  components: dict
  ci_params: dict
  step: tuple


def _tree():
  return State(
    components={"linear1": Factors(jnp.ones((3, 2)), jnp.zeros((2, 4)))},
    ci_params={"linear1": {"w_in": jnp.arange(6.0).reshape(2, 3)}},
    step=(jnp.array(7, jnp.int32), jnp.ones((2,), jnp.bfloat16)),
  )


def _temp_files(directory):
  return [n for n in os.listdir(directory) if n.endswith(".tmp")]


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
  target = tmp_path / "a.txt"
  run_dir.atomic_write(target, lambda f: f.write(b"one"))
  run_dir.atomic_write(target, lambda f: f.write(b"two"))
  assert target.read_bytes() == b"two"
  assert _temp_files(tmp_path) == []


def test_atomic_write_failure_keeps_old_content(tmp_path):
  target = tmp_path / "a.txt"
  target.write_bytes(b"old")

  def fail(f):
    f.write(b"half")
    raise RuntimeError("boom")

  with pytest.raises(RuntimeError):
    run_dir.atomic_write(target, fail)
  assert target.read_bytes() == b"old"
  assert _temp_files(tmp_path) == []


def test_stale_temporaries_of_killed_writes_are_removed(tmp_path):
  """A killed write's temporary of the file goes; a live writer's (locked),
  another file's and other names stay."""
  target = tmp_path / "a.bin"
  stale = [".a.bin.k3x_9q0z.tmp", ".a.bin.zzzzzzzz.tmp"]
  kept = [".a.bin.short.tmp", ".b.bin.k3x_9q0z.tmp", "a.bin.k3x_9q0z.tmp",
          ".a.bin.k3x_9q0z.tmp.x", ".a.bin.live0000.tmp"]
  for name in stale + kept:
    (tmp_path / name).write_bytes(b"x")
  live = os.open(tmp_path / ".a.bin.live0000.tmp", os.O_RDONLY)
  fcntl.flock(live, fcntl.LOCK_EX)
  try:
    assert run_dir.remove_stale_temporaries(target) == stale
  finally:
    os.close(live)
  assert sorted(os.listdir(tmp_path)) == sorted(kept)


def test_a_live_writes_temporary_is_kept(tmp_path):
  target = tmp_path / "a.bin"
  seen = []

  def write(f):
    f.write(b"data")
    seen.append(run_dir.remove_stale_temporaries(target))

  run_dir.atomic_write(target, write)
  assert seen == [[]] and target.read_bytes() == b"data"
  assert _temp_files(tmp_path) == []


def test_a_directory_lock_names_what_it_holds(tmp_path):
  fd = run_dir.lock_dir(tmp_path / "h", "harvest", "wait for it to end")
  try:
    with pytest.raises(ValueError, match=r"^harvest .*/h is in use by pid "
                       r"\d+ on .*; wait for it to end$"):
      run_dir.lock_dir(tmp_path / "h", "harvest", "wait for it to end")
  finally:
    os.close(fd)


def test_prepare_writes_flags(tmp_path):
  out = tmp_path / "run"
  run_dir.prepare_run_dir(out, "--c=5\n", overwrite=False)
  assert (out / "flags.txt").read_text() == "--c=5\n"
  assert sorted(os.listdir(out)) == ["flags.txt"]


def test_prepare_missing_parent_raises_and_creates_nothing(tmp_path):
  out = tmp_path / "missing" / "run"
  with pytest.raises(ValueError, match="does not exist; create it or choose"):
    run_dir.prepare_run_dir(out, "--c=5\n", overwrite=False)
  assert os.listdir(tmp_path) == []


def test_prepare_different_flags_raises_and_touches_nothing(tmp_path):
  out = tmp_path / "run"
  run_dir.prepare_run_dir(out, "--c=5\n", overwrite=False)
  (out / "metrics.jsonl").write_text('{"step": 0}\n')
  before = {n: (out / n).read_bytes() for n in os.listdir(out)}
  with pytest.raises(run_dir.RunConflict) as info:
    run_dir.prepare_run_dir(out, "--c=6\n", overwrite=False)
  message = str(info.value)
  assert "\n" not in message
  assert str(out) in message and "replace it" in message
  assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before


def test_prepare_same_flags_keeps_run_files(tmp_path):
  out = tmp_path / "run"
  run_dir.prepare_run_dir(out, "--c=5\n", overwrite=False)
  run_dir.append_metrics(out / "metrics.jsonl", {"step": 0})
  run_dir.prepare_run_dir(out, "--c=5\n", overwrite=False)
  assert run_dir.read_metrics(out / "metrics.jsonl") == [{"step": 0}]


def _listing(directory):
  return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None
          for p in sorted(directory.rglob("*"))}


@pytest.mark.parametrize("overwrite", [False, True])
def test_run_files_without_flags_are_no_run_to_replace(tmp_path, overwrite):
  # A user's directory (a project root, the working directory) holding
  # figures/ and metrics.jsonl of its own: --overwrite must not take them.
  out = tmp_path / "mine"
  (out / "figures").mkdir(parents=True)
  (out / "figures" / "plot.png").write_bytes(b"png")
  (out / "metrics.jsonl").write_text('{"step": 1}\n')
  (out / "notes.txt").write_text("mine")
  before = _listing(out)
  with pytest.raises(ValueError) as info:
    run_dir.prepare_run_dir(out, "--c=5\n", overwrite=overwrite)
  assert not isinstance(info.value, run_dir.RunConflict)  # no "replace it"
  message = str(info.value)
  assert "holds metrics.jsonl, figures but no flags.txt, so no run wrote " in (
    message) and "\n" not in message
  assert _listing(out) == before


def test_overwrite_refuses_a_file_the_run_did_not_write(tmp_path):
  out = tmp_path / "run"
  run_dir.prepare_run_dir(out, "--c=5\n", overwrite=False)
  (out / "figures").mkdir()
  run_dir.write_run_file(out / "figures" / "ci.png", lambda f: f.write(b"1"))
  (out / "figures" / "mine.png").write_bytes(b"mine")
  before = _listing(out)
  with pytest.raises(ValueError) as info:
    run_dir.prepare_run_dir(out, "--c=6\n", overwrite=True)
  message = str(info.value)
  assert ("holds figures/mine.png, which the run did not write (not in its "
          ".run_files), so replacing the run would delete it; move it away "
          "or choose another directory") in message
  assert _listing(out) == before
  # Moved away, the run is replaced; the files it wrote go with it.
  (out / "figures" / "mine.png").rename(tmp_path / "mine.png")
  run_dir.prepare_run_dir(out, "--c=6\n", overwrite=True)
  assert sorted(os.listdir(out)) == ["flags.txt"]


def test_a_candidate_file_the_run_did_not_write_is_found(tmp_path):
  out = tmp_path / "run"
  run_dir.prepare_run_dir(out, "--c=5\n", overwrite=False)
  report = pathlib.Path(run_dir.candidate_dir(out, 1)) / "report"
  report.mkdir(parents=True)
  (report / "index.html").write_text("mine")
  with pytest.raises(ValueError, match="holds candidates/r1/report/index.html"):
    run_dir.check_run_dir(out, "--c=6\n", overwrite=True)


def test_write_run_file_lists_each_name_once(tmp_path):
  for content in (b"1", b"2"):
    run_dir.write_run_file(tmp_path / "a.png", lambda f: f.write(content))
  run_dir.write_run_file(tmp_path / "b.png", lambda f: f.write(b"3"))
  assert (tmp_path / run_dir.RECORD_FILE).read_text() == "a.png\nb.png\n"
  assert (tmp_path / "a.png").read_bytes() == b"2"


def test_a_leftover_of_a_listed_file_is_the_runs(tmp_path):
  out = tmp_path / "run"
  run_dir.prepare_run_dir(out, "--c=5\n", overwrite=False)
  (out / "report").mkdir()
  run_dir.write_run_file(out / "report" / "index.html", lambda f: f.write(b""))
  (out / "report" / ".index.html.x1y2.tmp").write_bytes(b"half")
  run_dir.prepare_run_dir(out, "--c=6\n", overwrite=True)
  assert sorted(os.listdir(out)) == ["flags.txt"]


@pytest.mark.parametrize("entry,kind", [
  ("checkpoints", "a directory"), ("metrics.jsonl", "a regular file")])
@pytest.mark.parametrize("overwrite", [False, True])
def test_an_entry_of_another_kind_is_refused_before_anything_changes(
    tmp_path, entry, kind, overwrite):
  out = tmp_path / "run"
  run_dir.prepare_run_dir(out, "--c=5\n", overwrite=False)
  if kind == "a directory":
    (out / entry).write_text("not the run's")
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 5}\n')
  else:
    (out / entry).mkdir()
  before = _listing(out)
  with pytest.raises(ValueError) as info:
    run_dir.prepare_run_dir(out, "--c=5\n", overwrite=overwrite)
  assert (f"holds {entry}, which is not {kind} as a run's {entry} is, so no "
          "run wrote it; move it away or choose another directory") in str(
            info.value)
  assert _listing(out) == before


def test_a_moved_run_resumes_with_its_location_flag_ignored(tmp_path):
  old = tmp_path / "old"
  run_dir.prepare_run_dir(old, f"--c=5\n--output_dir={old}\n", False)
  run_dir.append_metrics(old / "metrics.jsonl", {"step": 0})
  new = tmp_path / "new"
  old.rename(new)
  now = f"--c=5\n--output_dir={new}\n"
  with pytest.raises(run_dir.RunConflict, match="--output_dir was "):
    run_dir.check_run_dir(new, now, overwrite=False)
  run_dir.prepare_run_dir(new, now, False, ignored=("output_dir",))
  assert (new / "flags.txt").read_text() == now
  assert run_dir.read_metrics(new / "metrics.jsonl") == [{"step": 0}]
  with pytest.raises(run_dir.RunConflict, match="--c was 5, now 6"):
    run_dir.check_run_dir(new, f"--c=6\n--output_dir={old}\n", False,
                          ignored=("output_dir",))


def test_prepare_not_a_directory_raises(tmp_path):
  out = tmp_path / "run"
  out.write_text("file")
  with pytest.raises(ValueError, match="not a directory"):
    run_dir.prepare_run_dir(out, "--c=5\n", overwrite=True)
  assert out.read_text() == "file"


def test_prepare_overwrite_removes_only_run_entries(tmp_path):
  out = tmp_path / "run"
  run_dir.prepare_run_dir(out, "--c=5\n", overwrite=False)
  (out / "figures").mkdir()
  run_dir.write_run_file(out / "figures" / "ci.png", lambda f: f.write(b"p"))
  (out / "metrics.jsonl").write_text('{"step": 0}\n')
  (out / "target.npz").write_bytes(b"npz")
  (out / "notes.md").write_text("mine")
  run_dir.prepare_run_dir(out, "--c=6\n", overwrite=True)
  assert sorted(os.listdir(out)) == ["flags.txt", "notes.md"]
  assert (out / "flags.txt").read_text() == "--c=6\n"


def _me(pid=None):
  return f"pid {pid or os.getpid()} on {socket.gethostname()}"


def test_lock_creates_the_dir_and_names_its_holder(tmp_path):
  out = tmp_path / "run"
  fd = run_dir.lock_run_dir(out)
  try:
    assert (out / run_dir.LOCK_FILE).read_text() == _me() + "\n"
    # A second descriptor is a second holder, even in this process.
    with pytest.raises(ValueError) as info:
      run_dir.lock_run_dir(out)
    assert str(info.value) == (
      f"output dir {out} is in use by {_me()}; wait for that run to end or"
      " choose another directory")
  finally:
    os.close(fd)
  os.close(run_dir.lock_run_dir(out))  # closing released it


def test_lock_of_a_dead_process_does_not_block(tmp_path):
  out = tmp_path / "run"
  holder = subprocess.Popen(
    [sys.executable, "-P", "-c",
     "import sys, time; from decompax.io import run_dir; "
     "run_dir.lock_run_dir(sys.argv[1]); print('locked', flush=True); "
     "time.sleep(60)", str(out)],
    stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "locked\n"
    with pytest.raises(ValueError, match=f"in use by {_me(holder.pid)};"):
      run_dir.lock_run_dir(out)
  finally:
    holder.kill()
    holder.wait()
  fd = run_dir.lock_run_dir(out)
  assert (out / run_dir.LOCK_FILE).read_text() == _me() + "\n"
  os.close(fd)


def test_overwrite_keeps_the_lock(tmp_path):
  out = tmp_path / "run"
  fd = run_dir.lock_run_dir(out)
  try:
    run_dir.prepare_run_dir(out, "--c=5\n", overwrite=False)
    run_dir.prepare_run_dir(out, "--c=6\n", overwrite=True)
    assert sorted(os.listdir(out)) == [run_dir.LOCK_FILE, "flags.txt"]
    with pytest.raises(ValueError, match="in use by"):
      run_dir.lock_run_dir(out)
  finally:
    os.close(fd)


def test_a_lock_file_alone_is_no_run(tmp_path):
  out = tmp_path / "run"
  os.close(run_dir.lock_run_dir(out))
  run_dir.check_run_dir(out, "--c=5\n", overwrite=False)


def test_lock_in_a_missing_parent_is_refused(tmp_path):
  with pytest.raises(ValueError, match="cannot lock output dir .*: No such"):
    run_dir.lock_run_dir(tmp_path / "absent" / "run")


def test_a_lock_file_that_cannot_be_opened_is_refused(tmp_path):
  (tmp_path / run_dir.LOCK_FILE).mkdir()
  with pytest.raises(ValueError, match="cannot lock output dir .*: Is a dir"):
    run_dir.lock_run_dir(tmp_path)


def test_lock_warns_where_the_file_system_cannot_lock(tmp_path, monkeypatch):
  def no_flock(fd, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

  monkeypatch.setattr(fcntl, "flock", no_flock)
  with pytest.warns(UserWarning, match="cannot be locked"):
    os.close(run_dir.lock_run_dir(tmp_path))


def test_metrics_round_trip_with_numpy_and_jax_scalars(tmp_path):
  path = tmp_path / "metrics.jsonl"
  run_dir.append_metrics(path, {"step": 0, "loss/a": np.float32(0.5)})
  run_dir.append_metrics(path, {"step": np.int64(1), "loss/a": jnp.array(0.25)})
  records = run_dir.read_metrics(path)
  assert records == [{"step": 0, "loss/a": 0.5}, {"step": 1, "loss/a": 0.25}]
  assert all(type(r["loss/a"]) is float for r in records)


def test_metrics_torn_last_line_skipped_and_later_appends_kept(tmp_path):
  path = tmp_path / "metrics.jsonl"
  run_dir.append_metrics(path, {"step": 0})
  with open(path, "a") as f:
    f.write('{"step": 1, "lo')
  assert run_dir.read_metrics(path) == [{"step": 0}]
  run_dir.append_metrics(path, {"step": 2})
  assert run_dir.read_metrics(path) == [{"step": 0}, {"step": 2}]


def test_metrics_missing_file_reads_empty(tmp_path):
  assert run_dir.read_metrics(tmp_path / "none.jsonl") == []


def test_a_metric_is_read_at_its_step_or_not_at_all(tmp_path):
  path = tmp_path / run_dir.METRICS_FILE
  run_dir.append_metrics(path, {"step": 2, "loss/a": 0.5})
  run_dir.append_metrics(path, {"step": 2, "eval/b": 0.25})
  run_dir.append_metrics(path, {"step": 4, "loss/a": 0.125})
  assert run_dir.metric_at(tmp_path, 2, "eval/b") == 0.25
  assert run_dir.metric_at(tmp_path, 4, "loss/a") == 0.125
  assert run_dir.metric_at(tmp_path, 4, "eval/b") is None
  assert run_dir.metric_at(tmp_path / "absent", 2, "loss/a") is None


def test_metrics_rejects_non_scalar(tmp_path):
  with pytest.raises(TypeError):
    run_dir.append_metrics(tmp_path / "m.jsonl", {"x": np.ones(3)})


def test_arrays_round_trip_with_metadata(tmp_path):
  path = tmp_path / "decomposition.npz"
  arrays = {
    "components/linear1/v": np.arange(6, dtype=np.float32).reshape(2, 3),
    "step": np.array(3, np.int32),
    "half": np.ones((2,), jnp.bfloat16),
  }
  metadata = {"step": 3, "sites": ["linear1"], "lr": np.float32(0.5)}
  run_dir.save_arrays(path, arrays, metadata)
  assert _temp_files(tmp_path) == []
  loaded, meta = run_dir.load_arrays(path)
  assert meta == {"step": 3, "sites": ["linear1"], "lr": 0.5}
  assert loaded.keys() == arrays.keys()
  for key, array in arrays.items():
    assert loaded[key].dtype == array.dtype
    np.testing.assert_array_equal(loaded[key], array)


def test_save_rejects_reserved_key(tmp_path):
  with pytest.raises(ValueError, match="reserved"):
    run_dir.save_arrays(tmp_path / "a.npz", {"__metadata__": np.ones(1)}, {})


@pytest.mark.parametrize("content", [None, b"", b"not a zip", b"PK\x03\x04xx"])
def test_load_missing_or_corrupt_raises_one_line(tmp_path, content):
  path = tmp_path / "decomposition.npz"
  if content is not None:
    path.write_bytes(content)
  with pytest.raises(ValueError) as info:
    run_dir.load_arrays(path)
  message = str(info.value)
  assert message.startswith(f"cannot read {path}: ")
  assert "\n" not in message


def test_load_truncated_file_raises(tmp_path):
  path = tmp_path / "decomposition.npz"
  run_dir.save_arrays(path, {"a": np.ones((4, 4))}, {"k": 1})
  path.write_bytes(path.read_bytes()[:100])
  with pytest.raises(ValueError, match="delete it to retrain"):
    run_dir.load_arrays(path)


def test_flatten_tree_keys():
  flat = run_dir.flatten_tree(_tree())
  assert sorted(flat) == [
    "ci_params/linear1/w_in",
    "components/linear1/u",
    "components/linear1/v",
    "step/0",
    "step/1",
  ]
  assert all(isinstance(a, np.ndarray) for a in flat.values())


def test_flatten_unflatten_round_trip_through_npz(tmp_path):
  tree = _tree()
  path = tmp_path / "state.npz"
  run_dir.save_arrays(path, run_dir.flatten_tree(tree), {})
  flat, _ = run_dir.load_arrays(path)
  restored = run_dir.unflatten_into(jax.eval_shape(lambda: tree), flat)
  assert jax.tree.structure(restored) == jax.tree.structure(tree)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(tree)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, np.asarray(b))


def test_unflatten_shape_mismatch_names_key():
  tree = _tree()
  flat = run_dir.flatten_tree(tree)
  flat["components/linear1/u"] = np.zeros((2, 5), np.float32)
  with pytest.raises(ValueError, match="^components/linear1/u: .*shape"):
    run_dir.unflatten_into(tree, flat)


def test_unflatten_dtype_mismatch_names_key():
  tree = _tree()
  flat = run_dir.flatten_tree(tree)
  flat["step/0"] = flat["step/0"].astype(np.int64)
  with pytest.raises(ValueError, match="^step/0: "):
    run_dir.unflatten_into(tree, flat)


def test_unflatten_missing_and_extra_keys_named():
  tree = _tree()
  flat = run_dir.flatten_tree(tree)
  with pytest.raises(ValueError, match="^ci_params/linear1/w_in: missing"):
    run_dir.unflatten_into(
      tree, {k: v for k, v in flat.items() if "w_in" not in k})
  with pytest.raises(ValueError, match="^zzz: not in the template"):
    run_dir.unflatten_into(tree, {**flat, "zzz": np.ones(1)})


def test_flatten_rejects_slash_in_key():
  with pytest.raises(ValueError, match="slash path"):
    run_dir.flatten_tree({"a/b": jnp.ones(1)})


def test_flags_file_is_plain_text(tmp_path):
  out = tmp_path / "run"
  run_dir.prepare_run_dir(out, json.dumps({"a": 1}), overwrite=False)
  assert json.loads((out / "flags.txt").read_text()) == {"a": 1}


def test_flatten_rejects_bare_leaf_and_empty_name():
  with pytest.raises(ValueError, match="slash path"):
    run_dir.flatten_tree(jnp.ones(1))
  with pytest.raises(ValueError, match="slash path"):
    run_dir.flatten_tree({"": jnp.ones(1)})


def test_metrics_append_after_one_byte_torn_file(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("{")
  run_dir.append_metrics(path, {"step": 0})
  assert run_dir.read_metrics(path) == [{"step": 0}]


def test_truncate_metrics_drops_records_past_a_step_and_torn_lines(tmp_path):
  path = tmp_path / "metrics.jsonl"
  assert run_dir.truncate_metrics(path, 5) == 0 and not path.exists()
  for step in (0, 5, 10):
    run_dir.append_metrics(path, {"step": step, "loss": float(step)})
  with open(path, "a") as f:
    f.write('{"step": 15, "lo')  # torn by a kill
  assert run_dir.truncate_metrics(path, 5) == 2
  assert [r["step"] for r in run_dir.read_metrics(path)] == [0, 5]
  run_dir.append_metrics(path, {"step": 10})
  assert [r["step"] for r in run_dir.read_metrics(path)] == [0, 5, 10]


# Refusals of check_run_dir: one line naming the path and the fix, and
# nothing left behind.


def test_check_refuses_a_file_among_the_ancestors(tmp_path):
  afile = tmp_path / "afile"
  afile.write_text("x")
  for out in (afile / "run", afile / "sub" / "run"):
    with pytest.raises(ValueError) as info:
      run_dir.check_run_dir(out, "--c=5\n", overwrite=False)
    assert str(info.value) == (
      f"{afile} is a file, not a directory; choose another directory")
  with pytest.raises(ValueError, match=f"output dir {afile} is a file, not"):
    run_dir.check_run_dir(afile, "--c=5\n", overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ["afile"]


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="no /sys")
def test_check_refuses_a_read_only_parent_even_for_root():
  # sysfs takes no new files, whoever asks; os.access would say yes to root.
  with pytest.raises(ValueError) as info:
    run_dir.check_run_dir("/sys/decompax_run", "--c=5\n", overwrite=False)
  message = str(info.value)
  assert message.startswith("cannot write to /sys: ")
  assert message.endswith("; choose a writable directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through 0o555")
def test_check_refuses_a_directory_without_write_permission(tmp_path):
  parent = tmp_path / "locked"
  parent.mkdir(mode=0o555)
  with pytest.raises(ValueError, match=f"cannot write to {parent}: "
                     "Permission denied; choose a writable directory"):
    run_dir.check_run_dir(parent / "run", "--c=5\n", overwrite=False)


def _disk_full(monkeypatch):
  def fsync(fd):
    del fd
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(run_dir.os, "fsync", fsync)


@pytest.mark.parametrize("existing", [False, True])
def test_check_refuses_a_full_disk_and_leaves_no_probe(tmp_path, monkeypatch,
                                                       existing):
  out = tmp_path / "run"
  if existing:  # a rerun of the same command, to resume
    run_dir.prepare_run_dir(out, "--c=5\n", overwrite=False)
  where = out if existing else tmp_path
  before = sorted(os.listdir(where))
  _disk_full(monkeypatch)
  with pytest.raises(ValueError) as info:
    run_dir.check_run_dir(out, "--c=5\n", overwrite=False)
  assert str(info.value) == (
    f"cannot write to {where}: No space left on device; free space there "
    "and rerun, or choose another directory")
  assert sorted(os.listdir(where)) == before


def test_check_refuses_a_checkpoint_directory_that_takes_no_file(
    tmp_path, monkeypatch):
  # checkpoints/ on a mount gone read-only: refused before the launch
  # writes anything, not at its first save.
  out = tmp_path / "run"
  run_dir.prepare_run_dir(out, "--c=5\n", overwrite=False)
  (out / "checkpoints").mkdir()
  mkstemp = run_dir.tempfile.mkstemp

  def read_only(dir, **kwargs):
    if os.path.basename(dir) == "checkpoints":
      raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    return mkstemp(dir=dir, **kwargs)

  monkeypatch.setattr(run_dir.tempfile, "mkstemp", read_only)
  with pytest.raises(ValueError) as info:
    run_dir.check_run_dir(out, "--c=5\n", overwrite=False)
  assert str(info.value) == (
    f"cannot write to {out / 'checkpoints'}: Read-only file system; choose "
    "a writable directory")


def test_check_names_the_flags_that_differ(tmp_path):
  out = tmp_path / "run"
  run_dir.prepare_run_dir(
    out, "--c=5\n--ci_lr=\n--lr=0.001\n--seed=1\n", overwrite=False)
  with pytest.raises(run_dir.RunConflict) as info:
    run_dir.check_run_dir(
      out, "--c=5\n--ci_lr=0.01\n--lr=0.002\n--new=1\n--seed=1\n", False)
  assert str(info.value) == (
    f"output dir {out} holds a run with other flags (--ci_lr was unset, now "
    "0.01; --lr was 0.001, now 0.002; --new was not recorded, now 1); "
    "resume it with the same flags, replace it, or choose another "
    "directory")
  run_dir.check_run_dir(out, "--c=6\n", overwrite=True)


def test_flag_changes_are_capped():
  old = "".join(f"--f{i}=0\n" for i in range(6))
  new = "".join(f"--f{i}=1\n" for i in range(6))
  assert run_dir.flag_changes(old, new) == (
    "--f0 was 0, now 1; --f1 was 0, now 1; --f2 was 0, now 1; --f3 was 0, "
    "now 1; and 2 more")


@pytest.mark.parametrize("code,fix", [
  (errno.ENOSPC, "free space there and rerun, or choose another directory"),
  (errno.EROFS, "choose a writable directory"),
  (errno.EIO, "choose another directory"),
])
def test_write_refusal_names_the_path_and_the_fix(code, fix):
  error = OSError(code, os.strerror(code))
  assert run_dir.write_refusal("/r/flags.txt", error) == (
    f"cannot write to /r/flags.txt: {os.strerror(code)}; {fix}")


def test_a_run_of_an_older_version_resumes_across_added_and_removed_flags(
    tmp_path):
  out = tmp_path / "run"
  out.mkdir()
  # Made by a version that had --old_flag and not yet --new_flag.
  (out / "flags.txt").write_text("--lr=0.001\n--old_flag=x\n")
  now = "--lr=0.001\n--new_flag=3\n"
  defaults = {"lr": "0.001", "new_flag": "3"}
  run_dir.prepare_run_dir(out, now, overwrite=False, defaults=defaults)
  assert (out / "flags.txt").read_text() == now
  # A flag added since, but set off its default, is a real change; so is
  # any difference without the program's defaults to judge by.
  (out / "flags.txt").write_text("--lr=0.001\n")
  with pytest.raises(ValueError, match="--new_flag was not recorded, now 4"):
    run_dir.check_run_dir(out, "--lr=0.001\n--new_flag=4\n", False, defaults)
  with pytest.raises(ValueError, match="--new_flag was not recorded, now 3"):
    run_dir.check_run_dir(out, now, False)
