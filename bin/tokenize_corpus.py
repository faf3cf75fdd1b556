"""Tokenize text into a token file: `bin/tokenize --tokenizer=DIR
--input=a.jsonl --input=b.txt --output=data/train.bin`.

A `.jsonl` input holds one document per line, the string under
`--text_field`; any other input file is one document. Documents are
tokenized without special tokens by the Hugging Face tokenizer in the local
directory `--tokenizer` and written in order, each followed by the EOS id,
as `NAME.bin` plus its header `NAME.json` (format: `decompax.io.tokens`).
Both files appear atomically once everything is tokenized.

An input that is the output or its header (under any name: links are
followed), binary input (NUL bytes) and an output that is not a file are
refused before anything is written. SIGTERM or SIGINT stops it at once,
tokenizer load or call or not (both run off the main thread, which the
signal reaches), leaving nothing behind, and exits with
`cli.REQUEUE_EXIT_CODE`. A signal whose stop was swallowed where Python
drops exceptions (a garbage-collector callback, a `__del__`) is still
recorded, and taken at the next batch or before the output is committed;
one that comes while the finished output is committed (renamed into
place with its header) lets the commit end: the output is whole. Temporaries a killed run left beside the output
are removed by the next. The output is claimed as `io/owned_dir.py` says
for a file: its path named, one writer at a time (the lock of
`.NAME.bin.lock` beside it), and `--overwrite` replaces only a token file
(its header names the format), never a file of another kind.
"""

import json
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, NoReturn

from absl import flags, logging

from decompax.bin import cli
from decompax.io import hf_checkpoint, owned_dir
from decompax.io import run_dir
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


def _check_not_output(path: str, output: str) -> None:
  """Raise ValueError when input `path` is the file `output` or its header
  would replace."""
  header = tokens_lib.header_path(output)
  for target, what in ((output, f"the --output {output}"),
                       (header, f"the header of --output {output}")):
    if os.path.exists(target) and os.path.samefile(path, target):
      raise ValueError(f"--input {path} is {what}; writing it would replace"
                       " the input: choose another --output")


def input_problem(path: str) -> str | None:
  """Return why `--input path` is no text file to read, naming what it is
  (a FIFO or a device never ends, or blocks), or None for a regular file."""
  try:
    mode = os.stat(path).st_mode
  except FileNotFoundError:
    if os.path.islink(path):
      return (f"--input {path} is a symbolic link to "
              f"{os.readlink(path)}, which does not exist")
    return f"--input {path} not found"
  except OSError as e:
    return f"--input {path} cannot be read: {e.strerror}"
  kinds = ((stat.S_ISDIR, "a directory"),
           (stat.S_ISFIFO, "a FIFO (named pipe)"),
           (stat.S_ISCHR, "a character device"),
           (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
  for test, kind in kinds:
    if test(mode):
      return (f"--input {path} is {kind}, not a regular file; give a file "
              "holding text")
  return None


def check_paths(inputs: list[str], output: str, overwrite: bool) -> None:
  """Raise ValueError for missing inputs or an output that must not be
  written."""
  for path in inputs:
    problem = input_problem(path)
    if problem:
      raise ValueError(problem)
    if not os.path.getsize(path):
      raise ValueError(f"--input {path} is empty; give a file holding text")
  if not output.endswith(".bin"):
    raise ValueError(f"--output {output} must end in .bin")
  parent = os.path.dirname(os.path.abspath(output))
  if not os.path.isdir(parent):
    raise ValueError(f"--output directory {parent} does not exist")
  for path in inputs:
    _check_not_output(path, output)
  targets = (output, tokens_lib.header_path(output))
  for path in targets:
    if os.path.isdir(path):
      raise ValueError(f"--output: {path} is a directory; name a file"
                       " NAME.bin whose NAME.bin and NAME.json are free")
    if os.path.exists(path) and not os.path.isfile(path):
      raise ValueError(f"--output: {path} is not a regular file; name"
                       " another")
  existing = [p for p in targets if os.path.exists(p)]
  if existing and not overwrite:
    raise ValueError(f"{existing[0]} exists; pass --overwrite to replace it")


def check_ours(output: str) -> None:
  """Refuse to replace a NAME.bin this binary did not write (whose
  NAME.json is no token header)."""
  if not os.path.exists(output):
    return
  try:
    tokens_lib.open_tokens(output)
  except ValueError:
    raise ValueError(f"--output {output} exists and is no token file of "
                     "bin/tokenize (its header is missing or not one); "
                     "move it away or name another --output") from None


def read_documents(path: str, text_field: str) -> Iterator[str]:
  """Yield the documents of one input file (JSONL: one per line)."""
  try:
    yield from _read_documents(path, text_field)
  except UnicodeDecodeError as e:
    raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte"
                     f" {e.start})") from None


def _binary(where: str) -> ValueError:
  return ValueError(f"{where} holds a NUL byte: it is binary, not text (a"
                    " token file?); give text or JSONL files")


def _read_documents(path: str, text_field: str) -> Iterator[str]:
  # NUL decodes as UTF-8 but never occurs in text: it marks a binary file
  # (a token file read back as text tokenizes to unknown tokens).
  if not path.endswith(".jsonl"):
    with open(path, encoding="utf-8") as f:
      text = f.read()
    if "\0" in text:
      raise _binary(f"--input {path}")
    yield text
    return
  with open(path, encoding="utf-8") as f:
    for line_no, line in enumerate(f, 1):
      if "\0" in line:
        raise _binary(f"--input {path}:{line_no}")
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


class Stopped(BaseException):
  """A stop signal arrived (a BaseException: no `except ValueError` or
  `except Exception` on the way up may swallow it)."""


class Stop(NamedTuple):
  """The stop signals this process received (their names, in order), and
  whether the output is being committed, when a signal only is recorded."""

  seen: list[str]
  committing: threading.Event

  def check(self) -> None:
    """Raise Stopped for a signal whose stop was swallowed on its way up
    (raised inside a garbage-collector callback or a `__del__`, where
    Python prints an exception and drops it)."""
    if self.seen:
      raise Stopped(self.seen[0])

  def commit(self) -> None:
    """Take any stop received so far; from now on signals only are
    recorded, so the output is renamed into place whole with its header."""
    self.check()
    self.committing.set()


def install_stop() -> Stop:
  """Return the record of stop signals, handlers installed that record
  each and, before the commit, raise Stopped at once."""
  stop = Stop([], threading.Event())

  def handle(signum: int, frame: Any) -> None:
    del frame
    stop.seen.append(signal.Signals(signum).name)
    if not stop.committing.is_set():
      raise Stopped(stop.seen[-1])

  for signum in cli.STOP_SIGNALS:
    signal.signal(signum, handle)
  return stop


def off_main_thread(call: Callable[[], Any]) -> Any:
  """Return `call()`, run on a daemon thread while this one waits.

  A signal's Python handler runs on the main thread, between bytecodes: in
  a long native call (the tokenizer's, which releases the GIL) it would wait
  for the call to end. Waiting on an event instead, the main thread takes
  the signal at once; the abandoned call dies with the process.
  """
  result, done = {}, threading.Event()

  def run():
    try:
      result["value"] = call()
    except BaseException as e:  # noqa: BLE001 (re-raised below)
      result["error"] = e
    finally:
      done.set()

  threading.Thread(target=run, daemon=True).start()
  done.wait()
  if "error" in result:
    raise result["error"]
  return result["value"]


def tokenized(tokenizer, inputs, text_field, batch_docs, progress_seconds,
              stop: Stop):
  """Yield each document's ids, printing progress as it goes; once the
  last is yielded, the output is committed (`Stop.commit`).

  Raises:
    ValueError: an input whose documents give no ids at all, which would
      add nothing but EOS ids to the file.
  """
  start = last = time.time()
  n_docs = n_tokens = 0
  for path in inputs:
    n_text = 0
    for batch in batched(read_documents(path, text_field), batch_docs):
      ids = off_main_thread(
        lambda b=batch: tokenizer(b, add_special_tokens=False)["input_ids"])
      stop.check()
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
  stop.commit()


def remove_stale(output: str) -> None:
  """Remove the temporaries that killed runs left beside `output` and its
  header, saying so."""
  for path in (output, tokens_lib.header_path(output)):
    for name in run_dir.remove_stale_temporaries(path):
      print(f"[tokenize] removed {name}, left by a killed run", flush=True)


def _exit_stopped(signal_name: str, output: str) -> NoReturn:
  # Raised through `write_tokens`, the signal removed its temporary file.
  # The process ends here, without the interpreter's shutdown: a tokenizer
  # call may still run on its thread, and nothing is left to tidy.
  print(f"[tokenize] stop signal ({signal_name}): {output} not written;"
        " rerun the same command to tokenize again (exit"
        f" {cli.REQUEUE_EXIT_CODE})", flush=True)
  sys.stderr.flush()
  os._exit(cli.REQUEUE_EXIT_CODE)


def main(argv: list[str]) -> None:
  stop = install_stop()
  try:
    _main(argv, stop)
  except Stopped as e:
    _exit_stopped(str(e), _OUTPUT.value)


def _main(argv: list[str], stop: Stop) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; flags take the form --name=value")
  try:
    if _BATCH_DOCS.value <= 0:
      raise ValueError(
        f"--batch_docs must be positive, got {_BATCH_DOCS.value}")
    owned_dir.named(_OUTPUT.value, "output")
    check_paths(_INPUT.value, _OUTPUT.value, _OVERWRITE.value)
    with owned_dir.claimed_file(_OUTPUT.value, "output", "token file"):
      check_ours(_OUTPUT.value)
      header, start = write(_OUTPUT.value, stop)
  except ValueError as e:
    fail(str(e))
  except OSError as e:
    fail(owned_dir.refusal(e, _OUTPUT.value))
  # Written: a signal now would only misreport it.
  for signum in cli.STOP_SIGNALS:
    signal.signal(signum, signal.SIG_IGN)
  if stop.seen:
    print(f"[tokenize] stop signal ({stop.seen[0]}) came as the output was "
          "committed: it is whole, and nothing is left to rerun", flush=True)
  print(f"[tokenize] wrote {_OUTPUT.value}: {header.num_documents} documents,"
        f" {header.num_tokens} {header.dtype} tokens (vocab"
        f" {header.vocab_size}, EOS {header.eos_id}) in"
        f" {time.time() - start:.1f}s")


def write(output: str, stop: Stop):
  """Write the token file `output` of the inputs; return its header and
  when the tokenizing began."""
  remove_stale(output)
  # Off the main thread as the tokenizer's calls: a large tokenizer.json
  # parses for seconds in native code, and importing transformers runs
  # garbage-collector callbacks, where a stop raised would be dropped.
  tokenizer = off_main_thread(lambda: load_tokenizer(_TOKENIZER.value))
  stop.check()
  eos_id = tokenizer.eos_token_id if _EOS_ID.value is None else _EOS_ID.value
  if eos_id is None:
    raise ValueError(f"tokenizer {_TOKENIZER.value} has no EOS token;"
                     " pass --eos_id")
  if not 0 <= eos_id < len(tokenizer):
    raise ValueError(f"--eos_id={eos_id} is outside the tokenizer's"
                     f" vocabulary [0, {len(tokenizer)})")
  start = time.time()
  header = tokens_lib.write_tokens(
    output,
    tokenized(tokenizer, _INPUT.value, _TEXT_FIELD.value, _BATCH_DOCS.value,
              _PROGRESS_SECONDS.value, stop),
    vocab_size=len(tokenizer), eos_id=eos_id,
    tokenizer=os.path.abspath(_TOKENIZER.value))
  return header, start


def entry() -> None:
  """Launch the absl app (used by the `bin/tokenize` launcher)."""
  cli.launch("tokenize", main)


if __name__ == "__main__":
  entry()
