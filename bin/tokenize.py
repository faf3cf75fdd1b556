"""Tokenize text into a token file: `bin/tokenize --tokenizer=DIR
--input=a.jsonl --input=b.txt --output=data/train.bin`.

A `.jsonl` input holds one document per line, the string under
`--text_field`; any other input file is one document. Documents are
tokenized without special tokens by the Hugging Face tokenizer in the local
directory `--tokenizer` and written in order, each followed by the EOS id,
as `NAME.bin` plus its header `NAME.json` (format: `decompax.io.tokens`).
Both files appear atomically once everything is tokenized.
"""

import json
import os
import time
from collections.abc import Iterator

from absl import flags, logging

from decompax.bin import cli
from decompax.io import hf_checkpoint
from decompax.io import tokens as tokens_lib

_TOKENIZER = flags.DEFINE_string(
  "tokenizer", None, "Local Hugging Face tokenizer directory (for example a"
  " model checkpoint directory).", required=True)
_INPUT = flags.DEFINE_multi_string(
  "input", None, "Text or JSONL file to tokenize; repeat for more files,"
  " which are concatenated in the order given.", required=True)
_OUTPUT = flags.DEFINE_string(
  "output", None, "Token file to write, NAME.bin; its header goes to"
  " NAME.json.", required=True)
_TEXT_FIELD = flags.DEFINE_string(
  "text_field", "text", "JSONL key holding each document's text.")
_EOS_ID = flags.DEFINE_integer(
  "eos_id", None, "Id appended after every document; default: the"
  " tokenizer's EOS token.")
_BATCH_DOCS = flags.DEFINE_integer(
  "batch_docs", 256, "Documents tokenized per tokenizer call.")
_PROGRESS_SECONDS = cli.define_float(
  "progress_seconds", 10.0, "Seconds between progress lines.", __name__)
_OVERWRITE = flags.DEFINE_bool(
  "overwrite", False, "Replace an existing --output.")


def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  cli.fail("tokenize", message)


def load_tokenizer(path: str):
  """Return the tokenizer saved in directory `path` (local files only).

  Raises:
    ValueError: no directory, no loadable tokenizer in it, or one of fewer
      than two entries.
  """
  if not os.path.isdir(path):
    raise ValueError(f"--tokenizer {path} is not a directory; give a local"
                     " Hugging Face tokenizer or model directory")
  return hf_checkpoint.read_tokenizer(path)


def check_paths(inputs: list[str], output: str, overwrite: bool) -> None:
  """Raise ValueError for missing inputs or an output that must not be
  written."""
  for path in inputs:
    if not os.path.isfile(path):
      raise ValueError(f"--input {path} not found")
    if not os.path.getsize(path):
      raise ValueError(f"--input {path} is empty; give a file holding text")
  if not output.endswith(".bin"):
    raise ValueError(f"--output {output} must end in .bin")
  parent = os.path.dirname(os.path.abspath(output))
  if not os.path.isdir(parent):
    raise ValueError(f"--output directory {parent} does not exist")
  existing = [p for p in (output, tokens_lib.header_path(output))
              if os.path.exists(p)]
  if existing and not overwrite:
    raise ValueError(f"{existing[0]} exists; pass --overwrite to replace it")


def read_documents(path: str, text_field: str) -> Iterator[str]:
  """Yield the documents of one input file (JSONL: one per line)."""
  try:
    yield from _read_documents(path, text_field)
  except UnicodeDecodeError as e:
    raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte"
                     f" {e.start})") from None


def _read_documents(path: str, text_field: str) -> Iterator[str]:
  if not path.endswith(".jsonl"):
    with open(path, encoding="utf-8") as f:
      yield f.read()
    return
  with open(path, encoding="utf-8") as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{line_no}: not JSON ({e.msg})") from None
      text = record.get(text_field) if isinstance(record, dict) else None
      if not isinstance(text, str):
        raise ValueError(f"{path}:{line_no}: no string field"
                         f" {text_field!r}; set --text_field")
      yield text


def batched(docs: Iterator[str], size: int) -> Iterator[list[str]]:
  """Yield consecutive lists of up to `size` documents."""
  batch = []
  for doc in docs:
    batch.append(doc)
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch


def tokenized(tokenizer, inputs, text_field, batch_docs, progress_seconds):
  """Yield each document's ids, printing progress as it goes.

  Raises:
    ValueError: an input whose documents give no ids at all, which would
      add nothing but EOS ids to the file.
  """
  start = last = time.time()
  n_docs = n_tokens = 0
  for path in inputs:
    n_text = 0
    for batch in batched(read_documents(path, text_field), batch_docs):
      ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
      for doc in ids:
        n_docs += 1
        n_tokens += len(doc) + 1
        n_text += len(doc)
        yield doc
      now = time.time()
      if now - last >= progress_seconds:
        last = now
        rate = n_tokens / max(now - start, 1e-9)
        print(f"[tokenize] {path}: {n_docs} documents, {n_tokens} tokens,"
              f" {rate:,.0f} tokens/s", flush=True)
    if not n_text:
      raise ValueError(f"--input {path} tokenizes to nothing but EOS; check"
                       " that it holds text and that --tokenizer is the"
                       " model's tokenizer")


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; flags take the form --name=value")
  try:
    if _BATCH_DOCS.value <= 0:
      raise ValueError(
        f"--batch_docs must be positive, got {_BATCH_DOCS.value}")
    check_paths(_INPUT.value, _OUTPUT.value, _OVERWRITE.value)
    tokenizer = load_tokenizer(_TOKENIZER.value)
    eos_id = tokenizer.eos_token_id if _EOS_ID.value is None else _EOS_ID.value
    if eos_id is None:
      raise ValueError(f"tokenizer {_TOKENIZER.value} has no EOS token;"
                       " pass --eos_id")
    start = time.time()
    header = tokens_lib.write_tokens(
      _OUTPUT.value,
      tokenized(tokenizer, _INPUT.value, _TEXT_FIELD.value, _BATCH_DOCS.value,
                _PROGRESS_SECONDS.value),
      vocab_size=len(tokenizer), eos_id=eos_id,
      tokenizer=os.path.abspath(_TOKENIZER.value))
  except ValueError as e:
    fail(str(e))
  print(f"[tokenize] wrote {_OUTPUT.value}: {header.num_documents} documents,"
        f" {header.num_tokens} {header.dtype} tokens (vocab"
        f" {header.vocab_size}, EOS {header.eos_id}) in"
        f" {time.time() - start:.1f}s")


def entry() -> None:
  """Launch the absl app (used by the `bin/tokenize` launcher)."""
  cli.launch("tokenize", main)


if __name__ == "__main__":
  entry()
