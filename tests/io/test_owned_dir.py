"""The contract of a directory a binary writes: named, locked, recorded,
compared, replaced only where it wrote."""

import json
import os
import socket

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
