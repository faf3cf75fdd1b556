"""bin/tokenize: text and JSONL to a token file, and its one-line errors."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from decompax.io import tokens

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORDS = ["[UNK]", "[EOS]", "the", "cat", "sat", "on", "mat", "a", "dog", "."]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  """A word-level tokenizer saved as a Hugging Face tokenizer directory."""
  import transformers  # noqa: PLC0415 (slow import; only these tests use it)
  from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

  word_level = Tokenizer(models.WordLevel(
    {w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
  word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  path = tmp_path_factory.mktemp("tokenizer")
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=word_level, eos_token="[EOS]", unk_token="[UNK]",
  ).save_pretrained(path)
  return str(path)


def _tokenize(*args):
  return subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "tokenize"), *args],
    cwd=ROOT, capture_output=True, text=True, timeout=300)


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
  result = _tokenize(f"--tokenizer={tokenizer_dir}", f"--input={jsonl}",
                     f"--input={text}", f"--output={out}", "--text_field=body",
                     "--batch_docs=2", "--progress_seconds=0")
  assert result.returncode == 0, result.stderr
  assert "[tokenize] wrote" in result.stdout
  assert "documents," in result.stdout  # a progress line
  opened = tokens.open_tokens(out)
  want = []
  for doc in [*docs, "the dog\nsat on a cat\n"]:
    want += _ids(doc) + [WORDS.index("[EOS]")]
  np.testing.assert_array_equal(opened.ids, want)
  assert opened.header.vocab_size == len(WORDS)
  assert opened.header.num_documents == 4
  assert opened.header.eos_id == 1
  assert opened.header.tokenizer == os.path.abspath(tokenizer_dir)
  assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "story.txt",
                                          "train.bin", "train.json"]


def _assert_fails(result, match):
  assert result.returncode == 2, result.stdout + result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tokenize: error: "), lines
  assert match in lines[0], lines[0]


def test_bad_inputs_are_one_line_errors_that_write_nothing(tmp_path,
                                                           tokenizer_dir):
  jsonl = tmp_path / "docs.jsonl"
  jsonl.write_text('{"text": "the cat"}\n{"body": "a dog"}\n')
  out = tmp_path / "out" / "train.bin"
  out.parent.mkdir()
  base = [f"--tokenizer={tokenizer_dir}", f"--output={out}"]
  _assert_fails(_tokenize(*base, f"--input={jsonl}"),
                "docs.jsonl:2: no string field 'text'")
  _assert_fails(_tokenize(*base, f"--input={tmp_path / 'none.txt'}"),
                "none.txt not found")
  _assert_fails(_tokenize(f"--tokenizer={tmp_path}", f"--output={out}",
                          f"--input={jsonl}"), "cannot load a tokenizer")
  assert os.listdir(out.parent) == []
  out.write_bytes(b"")
  _assert_fails(_tokenize(*base, f"--input={jsonl}"),
                "exists; pass --overwrite")
