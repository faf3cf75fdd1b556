"""The contract of a directory a binary writes: named, locked, recorded,
compared, replaced only where it wrote."""

import json
import os
import socket

import numpy as np
import pytest

from decompax.io import owned_dir, run_dir


@pytest.mark.parametrize("value", ["", " ", "\t", None])
def test_an_empty_or_blank_path_is_refused(value):
  with pytest.raises(ValueError, match="--out=.* names no path"):
    owned_dir.named(value, "out")


def test_a_claim_writes_the_manifest_and_resumes_on_the_same_settings(
    tmp_path):
  out = tmp_path / "o"
  first = owned_dir.claim(out, "prog", {"a": 1}, overwrite=False)
  assert not first.resumed
  owned_dir.record(out, "x.bin")
  (out / "x.bin").write_text("x")
  os.close(first.lock)
  manifest = owned_dir.read_manifest(out)
  assert manifest["program"] == "prog" and manifest["entries"] == ["x.bin"]
  again = owned_dir.claim(out, "prog", {"a": 1}, overwrite=False)
  assert again.resumed and (out / "x.bin").exists()
  os.close(again.lock)


def test_other_settings_are_refused_naming_the_change_and_the_fix(tmp_path):
  out = tmp_path / "o"
  os.close(owned_dir.claim(out, "prog", {"data": {"sha256": "a" * 64,
                                                  "size": 3}}, False).lock)
  with pytest.raises(owned_dir.OwnedConflict) as info:
    owned_dir.check(out, "prog", {"data": {"sha256": "b" * 64, "size": 3}},
                    overwrite=False)
  message = str(info.value)
  assert "\n" not in message
  assert "data.sha256 was aaaaaaaaaaaa…, now bbbbbbbbbbbb…" in message
  assert "--overwrite" in message and "another directory" in message


def test_a_moved_input_is_the_same_input(tmp_path):
  out = tmp_path / "o"
  os.close(owned_dir.claim(out, "prog", {"d": {"location": "/a", "size": 1}},
                           False).lock)
  assert owned_dir.check(out, "prog", {"d": {"location": "/b", "size": 1}},
                         overwrite=False)


def test_overwrite_removes_only_the_listed_entries(tmp_path):
  out = tmp_path / "o"
  claim = owned_dir.claim(out, "prog", {"a": 1}, False)
  owned_dir.record(out, "mine", "gone")
  (out / "mine").mkdir()
  (out / "mine" / "f").write_text("x")
  (out / "notes.txt").write_text("the user's")
  os.close(claim.lock)
  again = owned_dir.claim(out, "prog", {"a": 2}, overwrite=True)
  os.close(again.lock)
  assert sorted(os.listdir(out)) == [".lock", owned_dir.MANIFEST_FILE,
                                     "notes.txt"]
  assert owned_dir.read_manifest(out)["settings"] == {"a": 2}


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_the_binary_did_not_write_is_refused(tmp_path, overwrite):
  out = tmp_path / "model"
  out.mkdir()
  (out / "model.safetensors").write_text("a user's model")
  with pytest.raises(ValueError, match="holds model.safetensors, which no "
                     "prog run wrote"):
    owned_dir.claim(out, "prog", {}, overwrite)
  assert os.listdir(out) == ["model.safetensors"]


def test_another_programs_directory_is_refused(tmp_path):
  out = tmp_path / "o"
  os.close(owned_dir.claim(out, "other", {}, False).lock)
  with pytest.raises(ValueError, match="holds the output of 'other'"):
    owned_dir.claim(out, "prog", {}, overwrite=True)


def test_a_live_writer_is_refused_naming_it(tmp_path):
  out = tmp_path / "o"
  held = owned_dir.claim(out, "prog", {}, False)
  with pytest.raises(ValueError, match=f"is in use by pid {os.getpid()} on "
                     f"{socket.gethostname()}"):
    owned_dir.claim(out, "prog", {}, False)
  os.close(held.lock)


def test_a_dead_holders_lock_is_taken_over(tmp_path):
  out = tmp_path / "o"
  os.close(owned_dir.claim(out, "prog", {}, False).lock)
  (out / run_dir.LOCK_FILE).write_text(
    f"pid 999999999 on {socket.gethostname()}\n")
  claim = owned_dir.claim(out, "prog", {}, False)
  assert (out / run_dir.LOCK_FILE).read_text() == (
    f"pid {os.getpid()} on {socket.gethostname()}\n")
  os.close(claim.lock)


def test_where_nothing_locks_the_recorded_holder_decides(tmp_path):
  host = socket.gethostname()
  assert not run_dir.holder_alive(f"pid 999999999 on {host}")
  assert run_dir.holder_alive(f"pid {os.getppid()} on {host}")
  assert run_dir.holder_alive("pid 1 on some-other-host")


def test_a_path_under_a_file_is_refused_naming_it(tmp_path):
  (tmp_path / "f").write_text("x")
  with pytest.raises(ValueError, match=f"{tmp_path / 'f'} is a file, not a "
                     "directory"):
    owned_dir.claim(tmp_path / "f" / "o", "prog", {}, False)


def test_a_failed_first_write_leaves_no_directory(tmp_path, monkeypatch):
  def full(*args):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(os, "fsync", full)
  with pytest.raises(ValueError, match="cannot write to .*No space left"):
    with owned_dir.one_line(tmp_path / "o"):
      owned_dir.claim(tmp_path / "o", "prog", {}, False)
  assert not (tmp_path / "o").exists()


def test_file_identity_is_size_and_hash(tmp_path):
  (tmp_path / "a").write_bytes(b"abc")
  identity = owned_dir.file_identity(tmp_path / "a")
  assert identity["size"] == 3 and identity["sha256"].startswith("ba7816bf")
  assert json.loads(json.dumps(identity)) == identity


def test_an_older_versions_output_is_adopted_its_settings_unknown(tmp_path):
  out = tmp_path / "o"
  (out / "corpus").mkdir(parents=True)
  (out / "notes.txt").write_text("the user's")
  ours = lambda path, entries: [e for e in entries  # noqa: E731
                                if e == "corpus"]
  with pytest.raises(owned_dir.OwnedConflict, match="corpus.sha256 was not "
                     "recorded, now"):
    owned_dir.check(out, "prog", {"corpus": {"sha256": "a" * 64}}, False,
                    ours)
  # Settings it cannot have recorded (None) match.
  assert owned_dir.check(out, "prog", {"data": None}, False, ours)
  claim = owned_dir.claim(out, "prog", {"corpus": {"sha256": "a" * 64}},
                          True, legacy=ours)
  os.close(claim.lock)
  assert not (out / "corpus").exists()
  assert (out / "notes.txt").exists()


def _write(path, text):
  run_dir.atomic_write(path, lambda f: f.write(text.encode()))


def test_a_file_output_records_its_settings_and_is_replaced_only_by_them(
    tmp_path):
  out = tmp_path / "g.png"
  with owned_dir.claimed_output(out, "output", "prog", {"a": 1}, False,
                                "figure") as path:
    assert path == str(out)
    assert (tmp_path / ".g.png.lock").exists()
    _write(out, "first")
  manifest = json.loads((tmp_path / ".g.png.written.json").read_text())
  assert manifest["program"] == "prog" and manifest["entries"] == ["g.png"]
  assert manifest["settings"] == {"a": 1}
  assert sorted(os.listdir(tmp_path)) == [".g.png.written.json", "g.png"]
  with owned_dir.claimed_output(out, "output", "prog", {"a": 1}, False,
                                "figure"):
    _write(out, "again")  # the same settings: written again
  with pytest.raises(owned_dir.OwnedConflict) as info:
    owned_dir.check_output(out, "output", "prog", {"a": 2}, False)
  assert str(info.value) == (
    f"--output: {out} holds prog output made with other settings (a was 1, "
    "now 2); pass --overwrite to replace it, or name another file")
  with owned_dir.claimed_output(out, "output", "prog", {"a": 2}, True,
                                "figure"):
    _write(out, "replaced")
  assert out.read_text() == "replaced"
  assert json.loads((tmp_path / ".g.png.written.json").read_text())[
    "settings"] == {"a": 2}


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_file_no_run_of_the_program_wrote_is_never_replaced(
    tmp_path, overwrite):
  out = tmp_path / "g.png"
  out.write_text("a user's")
  (tmp_path / ".g.png.written.json").write_text(json.dumps({
    "format": owned_dir.MANIFEST_FORMAT, "program": "other", "settings": {},
    "entries": ["g.png"]}))
  with pytest.raises(ValueError, match=f"--output: {out} exists and no prog "
                     "run wrote it .it has no .g.png.written.json.; move it "
                     "away"):
    owned_dir.check_output(out, "output", "prog", {}, overwrite)
  assert out.read_text() == "a user's"


def test_a_file_claim_that_fails_before_the_file_leaves_nothing(tmp_path):
  with pytest.raises(RuntimeError):
    with owned_dir.claimed_output(tmp_path / "g.png", "output", "prog", {},
                                  False, "figure"):
      raise RuntimeError("the graph could not be drawn")
  assert os.listdir(tmp_path) == []


def test_arrays_identity_tells_bytes_shapes_and_keys_apart():
  base = {"a": np.arange(4, dtype=np.float32), "b": np.ones(2, np.int32)}
  same = {"b": np.ones(2, np.int32), "a": np.arange(4, dtype=np.float32)}
  assert owned_dir.arrays_identity(base) == owned_dir.arrays_identity(same)
  for other in ({**base, "a": base["a"] + 1},
                {**base, "a": base["a"].reshape(2, 2)},
                {"c": base["a"], "b": base["b"]}):
    assert owned_dir.arrays_identity(other) != owned_dir.arrays_identity(base)


def test_a_runs_inputs_are_compared_but_not_where_they_lie(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  # No record (no run yet, or an older version's): nothing to compare.
  owned_dir.check_inputs(run, {"data_path": {"sha256": "a" * 64}}, False)
  owned_dir.write_inputs(run, {"data_path": {"location": "/x", "size": 3,
                                             "sha256": "a" * 64}})
  owned_dir.check_inputs(run, {"data_path": {"location": "/y", "size": 3,
                                             "sha256": "a" * 64}}, False)
  changed = {"data_path": {"location": "/x", "size": 4, "sha256": "b" * 64}}
  with pytest.raises(ValueError) as info:
    owned_dir.check_inputs(run, changed, False)
  assert str(info.value) == (
    f"{run} holds a run of other input data (data_path.sha256 was "
    "aaaaaaaaaaaa…, now bbbbbbbbbbbb…; data_path.size was 3, now 4); resume "
    "it on the original data, choose a new --output_dir, or pass "
    "--overwrite to train it again")
  owned_dir.check_inputs(run, changed, True)
  (run / run_dir.INPUTS_FILE).write_text("{not json")
  with pytest.raises(ValueError, match="inputs.json cannot be read"):
    owned_dir.check_inputs(run, changed, False)
