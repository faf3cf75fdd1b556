"""bin/tokenize: text and JSONL to a token file, its one-line errors, and
a stop signal that leaves nothing behind. The binary's refusals of bad
input (each leaving its directory as it was) are rows of
tests/bin/test_bad_inputs.py."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from decompax.io import hf_checkpoint, tokens

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORDS = ["[UNK]", "[EOS]", "the", "cat", "sat", "on", "mat", "a", "dog", "."]


def _save_word_level(path, words, eos, unk):
  """Save a word-level tokenizer of `words` as a Hugging Face directory."""
  import transformers  # noqa: PLC0415 (slow import; only these tests use it)
  from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

  word_level = Tokenizer(models.WordLevel(
    {w: i for i, w in enumerate(words)}, unk_token=unk))
  word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=word_level, eos_token=eos, unk_token=unk,
  ).save_pretrained(path)
  return str(path)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  """A word-level tokenizer saved as a Hugging Face tokenizer directory."""
  return _save_word_level(tmp_path_factory.mktemp("tokenizer"), WORDS,
                          "[EOS]", "[UNK]")


def _config_only(path):
  # What the issue met: a model config and no tokenizer files, which
  # transformers loads as a tokenizer of one entry.
  (path / "config.json").write_text('{"model_type": "gpt2"}')
  return str(path)


def _one_entry(path):
  return _save_word_level(path, ["[EOS]"], "[EOS]", "[EOS]")


def _broken_json(path):
  (path / "tokenizer.json").write_text('{"a": 1}')
  return str(path)


def _command(args):
  return [sys.executable, "-P", str(ROOT / "bin" / "tokenize"), *args]


def _tokenize(*args):
  return subprocess.run(_command(args), cwd=ROOT, capture_output=True,
                        text=True, timeout=300)


def _ids(text):
  return [WORDS.index(w) if w in WORDS else 0 for w in text.split()]


def test_round_trip_text_and_jsonl(tmp_path, tokenizer_dir):
  docs = ["the cat sat", "a dog sat on the mat .", "the zebra"]
  jsonl = tmp_path / "docs.jsonl"
  jsonl.write_text("".join(json.dumps({"body": d, "id": i}) + "\n"
                           for i, d in enumerate(docs)) + "\n")
  text = tmp_path / "story.txt"
  text.write_text("the dog\nsat on a cat\n")
  out = tmp_path / "train.bin"
  # Left by killed runs: the output's and its header's temporaries go,
  # another file's stays.
  for name in (".train.bin.a1b2c3d4.tmp", ".train.json.x_y_z_00.tmp",
               ".other.bin.a1b2c3d4.tmp"):
    (tmp_path / name).write_bytes(b"\0\1")
  result = _tokenize(f"--tokenizer={tokenizer_dir}", f"--input={jsonl}",
                     f"--input={text}", f"--output={out}", "--text_field=body",
                     "--batch_docs=2", "--progress_seconds=0")
  assert result.returncode == 0, result.stderr
  assert "[tokenize] wrote" in result.stdout
  assert "documents," in result.stdout  # a progress line
  assert ("[tokenize] removed .train.bin.a1b2c3d4.tmp, left by a killed run"
          in result.stdout)
  opened = tokens.open_tokens(out)
  want = []
  for doc in [*docs, "the dog\nsat on a cat\n"]:
    want += _ids(doc) + [WORDS.index("[EOS]")]
  np.testing.assert_array_equal(opened.ids, want)
  assert opened.header.vocab_size == len(WORDS)
  assert opened.header.num_documents == 4
  assert opened.header.eos_id == 1
  assert opened.header.tokenizer == os.path.abspath(tokenizer_dir)
  assert sorted(os.listdir(tmp_path)) == [
    ".other.bin.a1b2c3d4.tmp", "docs.jsonl", "story.txt", "train.bin",
    "train.json"]


def _assert_fails(result, match):
  assert result.returncode == 2, result.stdout + result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tokenize: error: "), lines
  assert match in lines[0], lines[0]


@pytest.mark.parametrize("make,match", [
  (lambda path: str(path), "holds no tokenizer.json"),
  (_config_only, "holds no tokenizer.json"),
  (_one_entry, "its vocabulary size is 1"),
  (_broken_json, r"\(KeyError: 'added_tokens'\)"),
])
def test_unusable_tokenizers_are_one_line_errors(tmp_path, make, match):
  path = make(tmp_path)
  with pytest.raises(ValueError, match=match) as error:
    hf_checkpoint.read_tokenizer(path)
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith(f"cannot read a tokenizer from {path}")
  assert message.endswith("tokenizer_config.json and its vocabulary files)")


def test_the_launcher_runs_without_an_isolated_path(tmp_path):
  # `python bin/tokenize` puts bin/ first on sys.path: a module there named
  # `tokenize` would stand in for the standard library's.
  result = subprocess.run(
    [sys.executable, str(ROOT / "bin" / "tokenize"), f"--tokenizer={tmp_path}",
     f"--input={tmp_path / 'none.txt'}", f"--output={tmp_path / 'o.bin'}"],
    cwd=tmp_path, capture_output=True, text=True, timeout=300)
  _assert_fails(result, "none.txt not found")


def _stop_mid_tokenize(tmp_path, tokenizer_dir, words: int, signum: int):
  """Send `signum` while bin/tokenize tokenizes one document of `words`
  words; return the result and the seconds it took to exit."""
  text = tmp_path / "big.txt"
  text.write_text("the cat sat " * (words // 3))
  out = tmp_path / "out"
  out.mkdir()
  process = subprocess.Popen(
    _command([f"--tokenizer={tokenizer_dir}", f"--input={text}",
              f"--output={out / 'big.bin'}"]),
    cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  deadline = time.time() + 240
  # The temporary (not the output's lock, taken first): the write has begun.
  while not [n for n in os.listdir(out) if not n.endswith(".lock")]:
    assert process.poll() is None and time.time() < deadline
    time.sleep(0.02)
  time.sleep(0.2)  # into the tokenizer's call
  process.send_signal(signum)
  signalled = time.time()
  stdout, stderr = process.communicate(timeout=300)
  result = subprocess.CompletedProcess(process.args, process.returncode,
                                       stdout, stderr)
  return result, time.time() - signalled, out


def _assert_stopped(result, out, name):
  assert result.returncode == 75, result.stdout + result.stderr
  assert "Traceback" not in result.stderr, result.stderr
  assert result.stdout.splitlines()[-1].startswith(
    f"[tokenize] stop signal ({name}): {out / 'big.bin'} not written;")
  assert os.listdir(out) == []


def test_a_stop_signal_leaves_nothing_and_exits_for_a_requeue(tmp_path,
                                                             tokenizer_dir):
  # A million words keep even an idle machine's tokenizer busy past the
  # signal (300,000 were done, file written, in 0.5 s).
  result, _, out = _stop_mid_tokenize(tmp_path, tokenizer_dir, 1_000_000,
                                      signal.SIGINT)
  _assert_stopped(result, out, "SIGINT")


@pytest.mark.slow
def test_a_stop_signal_is_taken_during_a_long_tokenizer_call(tmp_path,
                                                            tokenizer_dir):
  """One document of 6M words keeps the tokenizer busy for many seconds,
  in native code: the signal still ends the process at once."""
  result, seconds, out = _stop_mid_tokenize(tmp_path, tokenizer_dir,
                                            6_000_000, signal.SIGTERM)
  _assert_stopped(result, out, "SIGTERM")
  assert seconds < 5


# Stop signals raised where Python drops the exception a handler raises
# (a `__del__`; as a garbage-collector callback of an import would), each
# run before the program: its signal must not be lost.
_DROPPED = (
  "import signal\n"
  "from decompax.bin import tokenize_corpus as program\n"
  "from decompax.io import run_dir\n"
  "class _Signal:\n"
  "  def __del__(self):\n"
  "    signal.raise_signal(signal.SIGTERM)\n")
PRELUDES = {
  # While the tokenizer loads.
  "load": _DROPPED + (
    "load = program.load_tokenizer\n"
    "def loading(path):\n"
    "  _Signal()\n"
    "  return load(path)\n"
    "program.load_tokenizer = loading\n"),
  # While the first input is read, on the main thread.
  "read": _DROPPED + (
    "read = program.read_documents\n"
    "def reading(path, field):\n"
    "  _Signal()\n"
    "  yield from read(path, field)\n"
    "program.read_documents = reading\n"),
  # As the ids, renamed into place, wait for their header.
  "commit": _DROPPED + (
    "sync = run_dir.fsync_dir\n"
    "def syncing(path):\n"
    "  run_dir.fsync_dir = sync\n"
    "  _Signal()\n"
    "  sync(path)\n"
    "run_dir.fsync_dir = syncing\n"),
}


def test_a_stop_signal_dropped_on_its_way_up_still_stops(tmp_path,
                                                        tokenizer_dir):
  """A signal during the load or the reading stops the program, nothing
  written, exit 75; one during the commit lets it end, the output whole."""
  text = tmp_path / "w.txt"
  text.write_text("the cat sat\n")
  runs = {}
  for name, prelude in PRELUDES.items():
    (tmp_path / name).mkdir()
    code = (f"{prelude}import sys\nsys.argv = ['tokenize', "
            f"'--tokenizer={tokenizer_dir}', '--input={text}', "
            f"'--output={tmp_path / name / 'o.bin'}']\nprogram.entry()\n")
    runs[name] = subprocess.Popen(
      [sys.executable, "-P", "-c", code], cwd=ROOT, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  results = {name: (run.wait(timeout=300), *run.communicate())
             for name, run in runs.items()}
  for name in ("load", "read"):
    code, stdout, stderr = results[name]
    assert code == 75, stdout + stderr
    assert stdout.splitlines()[-1].startswith(
      f"[tokenize] stop signal (SIGTERM): {tmp_path / name / 'o.bin'} not "
      "written;"), stdout
    assert os.listdir(tmp_path / name) == []
  code, stdout, stderr = results["commit"]
  assert code == 0, stdout + stderr
  assert "came as the output was committed: it is whole" in stdout
  opened = tokens.open_tokens(tmp_path / "commit" / "o.bin")
  np.testing.assert_array_equal(opened.ids, _ids("the cat sat") + [1])
