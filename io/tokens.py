"""Pre-tokenized token files and the batches drawn from them.

A token file is two files side by side:
- `NAME.bin`: every token id of the corpus, documents concatenated in order
  with the EOS id after each one, as flat little-endian `uint16` (vocab
  ≤ 65536) or `uint32`; no header, so it memory-maps as one array.
- `NAME.json`: the header, `{"format": "decompax.tokens", "version": 1,
  "dtype", "vocab_size", "num_tokens", "num_documents", "eos_id",
  "tokenizer"}`.

`bin/tokenize` writes them. Opening one reads every id once, in chunks of
bounded memory, and refuses ids past the header's vocab: the header cannot
vouch for a `.bin` edited or replaced after it was written (a recorded
maximum would need a checksum, whose check reads every id anyway), and an
id past the model's vocab does not fail in the embedding lookup, it trains
on NaN.

A batch is a pure function of `(seed, step)`: global row `r` is the window
of `seq_len` tokens starting at a counter-based hash of `(seed, step, r)`,
so resuming at any step costs nothing and process `p` of `P` reads only its
own rows `[p·B/P, (p+1)·B/P)`.
"""

import dataclasses
import functools
import json
import os
from collections.abc import Iterable
from typing import Any, BinaryIO

import numpy as np
from jaxtyping import Int, UInt

from decompax.io import run_dir

FORMAT = "decompax.tokens"
VERSION = 1
_HEADER_KEYS = ("dtype", "vocab_size", "num_tokens", "num_documents",
                "eos_id", "tokenizer")
_COUNT_KEYS = ("vocab_size", "num_tokens", "num_documents", "eos_id")
_MASK64 = (1 << 64) - 1
# Ids read per chunk when scanning a file for its largest id.
_SCAN_IDS = 1 << 22


@dataclasses.dataclass(frozen=True)
class TokenHeader:
  """What `NAME.json` records about `NAME.bin`."""

  dtype: str
  vocab_size: int
  num_tokens: int
  num_documents: int
  eos_id: int
  tokenizer: str


@dataclasses.dataclass(frozen=True)
class Tokens:
  """An opened token file: its header and the memory-mapped ids."""

  header: TokenHeader
  ids: np.ndarray  # memory-mapped `[num_tokens]`, the header's dtype
  path: str


def dtype_for_vocab(vocab_size: int) -> str:
  """Return the narrowest unsigned dtype holding ids `0..vocab_size-1`."""
  return "uint16" if vocab_size <= 1 << 16 else "uint32"


def header_path(path: run_dir.Path) -> str:
  """Return the header file of token file `NAME.bin`: `NAME.json`."""
  return os.path.splitext(os.fspath(path))[0] + ".json"


def write_tokens(
  path: run_dir.Path,
  documents: Iterable[np.ndarray],
  vocab_size: int,
  eos_id: int,
  tokenizer: str,
) -> TokenHeader:
  """Write every document followed by `eos_id` to `path` and its header.

  Both files are replaced atomically, the ids first, so a crash leaves no
  header that describes a partial file. Ids outside `[0, vocab_size)` raise
  ValueError and leave the destination untouched.
  """
  path = os.fspath(path)
  if not path.endswith(".bin"):
    raise ValueError(f"token file {path} must end in .bin")
  if not 0 <= eos_id < vocab_size:
    raise ValueError(f"EOS id {eos_id} is outside the vocab [0, {vocab_size})")
  dtype = np.dtype(dtype_for_vocab(vocab_size)).newbyteorder("<")
  eos = np.array([eos_id], dtype)
  counts = {"tokens": 0, "documents": 0}

  def write(f: BinaryIO) -> None:
    for doc in documents:
      doc = np.asarray(doc)
      if doc.size and (doc.min() < 0 or doc.max() >= vocab_size):
        raise ValueError(
          f"document {counts['documents']} holds ids outside the vocab"
          f" [0, {vocab_size})")
      f.write(doc.astype(dtype).tobytes())
      f.write(eos.tobytes())
      counts["tokens"] += doc.size + 1
      counts["documents"] += 1

  run_dir.atomic_write(path, write)
  header = TokenHeader(dtype.name, vocab_size, counts["tokens"],
                       counts["documents"], eos_id, tokenizer)
  record = {"format": FORMAT, "version": VERSION} | dataclasses.asdict(header)
  run_dir.atomic_write(
    header_path(path),
    lambda f: f.write((json.dumps(record, indent=1) + "\n").encode()))
  return header


def _is_count(value: object) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_json(hpath: str, what: str) -> Any:
  """Return the JSON in `hpath`; ValueError naming it as `what` if it
  cannot be read or parsed."""
  try:
    with open(hpath) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{what} {hpath} is not valid JSON ({e})") from None


def _read_header(path: str) -> TokenHeader:
  hpath = header_path(path)
  if not os.path.exists(hpath):
    raise ValueError(f"token header {hpath} not found; write {path} and its"
                     " header with bin/tokenize")
  record = _read_json(hpath, "token header")
  if not isinstance(record, dict) or record.get("format") != FORMAT:
    raise ValueError(f"{hpath} is not a {FORMAT} header")
  if record.get("version") != VERSION:
    raise ValueError(f"token header {hpath} has version"
                     f" {record.get('version')}, this reader needs {VERSION};"
                     " re-run bin/tokenize")
  missing = [k for k in _HEADER_KEYS if k not in record]
  if missing:
    raise ValueError(f"token header {hpath} lacks {missing}")
  bad = [k for k in _COUNT_KEYS if not _is_count(record[k])]
  if bad:
    raise ValueError(f"token header {hpath}: {bad} must be non-negative"
                     " integers; re-run bin/tokenize")
  header = TokenHeader(**{k: record[k] for k in _HEADER_KEYS})
  if not 0 <= header.eos_id < header.vocab_size:
    raise ValueError(f"token header {hpath}: EOS id {header.eos_id} is outside"
                     f" its vocab [0, {header.vocab_size}); re-run"
                     " bin/tokenize")
  if header.dtype != dtype_for_vocab(header.vocab_size):
    raise ValueError(
      f"token header {hpath}: dtype {header.dtype} does not match vocab size"
      f" {header.vocab_size} (expected {dtype_for_vocab(header.vocab_size)})")
  return header


def open_tokens(path: run_dir.Path, vocab_size: int | None = None) -> Tokens:
  """Return the memory-mapped token file `path` (`NAME.bin`) and its header.

  With `vocab_size` (the model's), refuse a file tokenized for a larger vocab.
  Every id is read once to check it against the header's vocab.

  Raises:
    ValueError: a missing file or header, a header that does not describe
      the file (its size or its largest id), or a vocab larger than the
      model's.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ValueError(f"token file {path} not found; create it with"
                     " bin/tokenize")
  header = _read_header(path)
  itemsize = np.dtype(header.dtype).itemsize
  size = os.path.getsize(path)
  if size != header.num_tokens * itemsize:
    raise ValueError(
      f"token file {path} has {size} bytes but its header promises"
      f" {header.num_tokens} {header.dtype} tokens"
      f" ({header.num_tokens * itemsize} bytes); re-run bin/tokenize")
  if vocab_size is not None and header.vocab_size > vocab_size:
    raise ValueError(
      f"token file {path} was tokenized for vocab {header.vocab_size}, larger"
      f" than the model's {vocab_size}; tokenize with the model's tokenizer")
  if header.num_tokens == 0:
    raise ValueError(f"token file {path} holds no tokens")
  dtype = np.dtype(header.dtype).newbyteorder("<")
  top = max_id(path, dtype)
  # The header's vocab is at most the model's (checked above), so ids inside
  # it are inside the model's too.
  if top >= header.vocab_size:
    model = "" if vocab_size is None else f" (the model's is {vocab_size})"
    raise ValueError(
      f"token file {path} holds id {top}, outside the vocab"
      f" [0, {header.vocab_size}) of its header {header_path(path)}{model};"
      " re-run bin/tokenize with the model's tokenizer")
  ids = np.memmap(path, dtype=dtype, mode="r", shape=(header.num_tokens,))
  return Tokens(header, ids, path)


def max_id(path: run_dir.Path, dtype: np.dtype) -> int:
  """Return the largest id in the flat `dtype` file `path` (0 when empty).

  Reads into one reused buffer rather than through a memory map, so memory
  stays at one chunk however large the file. A file opened again unchanged
  (same inode, size and modification time) is not read again: a launch
  opens its token files more than once.
  """
  stat = os.stat(path)
  return _scanned_max_id(os.path.realpath(path), np.dtype(dtype).str,
                         stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _scanned_max_id(path: str, dtype: str, inode: int, size: int,
                    mtime_ns: int) -> int:
  del inode, size, mtime_ns  # the cache key: the file as it is now
  buffer = np.empty(_SCAN_IDS, np.dtype(dtype))
  top = 0
  with open(path, "rb") as f:
    while n_bytes := f.readinto(buffer):
      top = max(top, int(buffer[:n_bytes // buffer.itemsize].max()))
  return top


def _mix64(x: UInt[np.ndarray, "*s"]) -> UInt[np.ndarray, "*s"]:
  # splitmix64's finaliser: a bijection of uint64 whose outputs look
  # independent for consecutive inputs. numpy uint64 arrays wrap silently.
  x = x + np.uint64(0x9E3779B97F4A7C15)
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def window_starts(
  seed: int, step: int, rows: range, num_tokens: int, seq_len: int
) -> Int[np.ndarray, " rows"]:
  """Return the start of each global row's window at `(seed, step)`.

  A pure function of its arguments: row `r`'s start depends on nothing but
  `(seed, step, r)` and the stream and window lengths.
  """
  if not 0 < seq_len <= num_tokens:
    raise ValueError(f"sequence length {seq_len} must be in [1, {num_tokens}],"
                     " the token file's length")
  seed_hash = _mix64(np.array([int(seed) & _MASK64], np.uint64))
  step_hash = _mix64(seed_hash ^ np.uint64(int(step) & _MASK64))
  row_ids = np.arange(rows.start, rows.stop, dtype=np.uint64)
  h = _mix64(step_hash ^ _mix64(row_ids))
  return (h % np.uint64(num_tokens - seq_len + 1)).astype(np.int64)


def spread_window_starts(
  windows: range, n_windows: int, num_tokens: int, seq_len: int
) -> Int[np.ndarray, " windows"]:
  """Return the starts of windows `windows` of `n_windows` that tile the
  stream without overlap, spread evenly over it: window `j` starts at
  whole window `⌊j · W / n_windows⌋` of the stream's `W = num_tokens //
  seq_len`. A pass over a held-out split reads each position at most
  once, from every part of the file; ValueError when the stream holds
  fewer than `n_windows` whole windows."""
  if not 0 < seq_len <= num_tokens:
    raise ValueError(f"sequence length {seq_len} must be in [1, {num_tokens}],"
                     " the token file's length")
  whole = num_tokens // seq_len
  if not 0 < n_windows <= whole:
    raise ValueError(f"{n_windows} windows of {seq_len} tokens do not fit "
                     f"the token file's {whole} whole windows without "
                     "overlap")
  j = np.arange(windows.start, windows.stop, dtype=np.int64)
  if j.size and not 0 <= j.min() <= j.max() < n_windows:
    raise ValueError(f"windows {windows} lie outside [0, {n_windows})")
  return j * whole // n_windows * seq_len


def process_rows(batch_size: int, process_index: int,
                 process_count: int) -> range:
  """Return the global rows `[p·B/P, (p+1)·B/P)` that process `p` reads."""
  if process_count <= 0 or not 0 <= process_index < process_count:
    raise ValueError(f"process index {process_index} must be in"
                     f" [0, {process_count})")
  if batch_size <= 0 or batch_size % process_count:
    raise ValueError(f"batch size {batch_size} must be a positive multiple of"
                     f" the process count {process_count}")
  per = batch_size // process_count
  return range(process_index * per, (process_index + 1) * per)


def read_batch(
  tokens: Tokens,
  seed: int,
  step: int,
  batch_size: int,
  seq_len: int,
  process_index: int = 0,
  process_count: int = 1,
) -> Int[np.ndarray, "rows seq"]:
  """Return this process's rows of the global batch at `(seed, step)`.

  `batch_size` is the global batch; the result has `batch_size /
  process_count` rows of `seq_len` int32 ids. Concatenating every process's
  rows in process order gives the single-process batch.
  """
  rows = process_rows(batch_size, process_index, process_count)
  starts = window_starts(seed, step, rows, tokens.header.num_tokens, seq_len)
  index = starts[:, None] + np.arange(seq_len)
  return np.asarray(tokens.ids[index], np.int32)


# A tag stream beside a token file (`NAME.bin`): for every token, an id
# into a tag vocabulary, plus the token offsets of every sentence start.
# - `NAME.tags.bin`: one little-endian `uint16` tag id per token, the same
#   length as `NAME.bin`.
# - `NAME.sentences.bin`: little-endian `int64` offsets (into `NAME.bin`) of
#   each sentence's first token, ascending.
# - `NAME.tags.json`: `{"format": "decompax.tags", "version": 1, "tags",
#   "num_tokens", "num_sentences", "documents"}`, `documents` a list of
#   `{"name", "start", "num_tokens"}` (start: offset of the document's first
#   token; its tokens include the EOS after it).
# Written before the token file's own header, read only beside it: a token
# file without a tag stream reads exactly as before.

TAGS_FORMAT = "decompax.tags"
TAGS_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TaggedDocument:
  """One document's token ids, their tags and where its sentences start."""

  name: str
  ids: np.ndarray  # [n] token ids, no EOS
  tags: np.ndarray  # [n] tag ids
  sentence_starts: np.ndarray  # offsets into `ids`, ascending


@dataclasses.dataclass(frozen=True)
class TagStream:
  """An opened tag stream: memory-mapped tag ids and the boundaries."""

  tags: tuple[str, ...]
  ids: np.ndarray  # memory-mapped `[num_tokens]` uint16
  sentence_starts: np.ndarray  # `[num_sentences]` int64
  documents: tuple[dict, ...]


def tags_path(path: run_dir.Path) -> str:
  """Return the tag-id file of token file `NAME.bin`: `NAME.tags.bin`."""
  return os.path.splitext(os.fspath(path))[0] + ".tags.bin"


def tags_header_path(path: run_dir.Path) -> str:
  """Return the tag header of token file `NAME.bin`: `NAME.tags.json`."""
  return os.path.splitext(os.fspath(path))[0] + ".tags.json"


def sentences_path(path: run_dir.Path) -> str:
  """Return the sentence offsets of `NAME.bin`: `NAME.sentences.bin`."""
  return os.path.splitext(os.fspath(path))[0] + ".sentences.bin"


def has_tags(path: run_dir.Path) -> bool:
  """Return whether token file `path` has a tag stream beside it."""
  return os.path.isfile(tags_header_path(path))


def _tagged_layout(
  documents: list[TaggedDocument], n_tags: int, eos_tag: int
) -> tuple[np.ndarray, np.ndarray, list[dict]]:
  tags, sentences, records = [], [], []
  at = 0
  for doc in documents:
    ids, doc_tags = np.asarray(doc.ids), np.asarray(doc.tags)
    starts = np.asarray(doc.sentence_starts, np.int64)
    if ids.shape != doc_tags.shape or ids.ndim != 1:
      raise ValueError(f"document {doc.name}: {ids.shape} ids but"
                       f" {doc_tags.shape} tags")
    if doc_tags.size and (doc_tags.min() < 0 or doc_tags.max() >= n_tags):
      raise ValueError(f"document {doc.name} holds tag ids outside [0,"
                       f" {n_tags})")
    if starts.size and (np.any(np.diff(starts) < 0) or starts[0] < 0
                        or starts[-1] > ids.size):
      raise ValueError(f"document {doc.name}: sentence starts must ascend"
                       f" within [0, {ids.size}]")
    tags += [doc_tags.astype("<u2"), np.asarray([eos_tag], "<u2")]
    sentences.append(starts + at)
    records.append({"name": doc.name, "start": at,
                    "num_tokens": int(ids.size) + 1})
    at += ids.size + 1
  empty = np.zeros(0, "<u2")
  return (np.concatenate(tags or [empty]),
          np.concatenate(sentences or [np.zeros(0, np.int64)]).astype("<i8"),
          records)


def write_tagged_tokens(
  path: run_dir.Path,
  documents: list[TaggedDocument],
  tags: tuple[str, ...],
  eos_tag: str,
  vocab_size: int,
  eos_id: int,
  tokenizer: str,
) -> TokenHeader:
  """Write a token file (`write_tokens`) and its tag stream beside it.

  The tag files come first and the token header last, each atomically, so
  a crash never leaves a token header without its complete tag stream.
  Raises ValueError, writing nothing, for tags past `tags` or a document
  whose ids and tags differ in length.
  """
  if not os.fspath(path).endswith(".bin"):
    raise ValueError(f"token file {os.fspath(path)} must end in .bin")
  if not 0 < len(tags) <= 1 << 16 or eos_tag not in tags:
    raise ValueError(f"tag vocabulary of {len(tags)} tags must hold 1 to"
                     f" 65536 tags including {eos_tag!r}")
  tag_ids, sentences, records = _tagged_layout(
    documents, len(tags), tags.index(eos_tag))
  record = {"format": TAGS_FORMAT, "version": TAGS_VERSION,
            "tags": list(tags), "num_tokens": int(tag_ids.size),
            "num_sentences": int(sentences.size), "documents": records}
  run_dir.atomic_write(tags_path(path), lambda f: f.write(tag_ids.tobytes()))
  run_dir.atomic_write(sentences_path(path),
                       lambda f: f.write(sentences.tobytes()))
  run_dir.atomic_write(
    tags_header_path(path),
    lambda f: f.write((json.dumps(record) + "\n").encode()))
  return write_tokens(path, (d.ids for d in documents), vocab_size, eos_id,
                      tokenizer)


def open_tags(tokens: Tokens) -> TagStream:
  """Return the tag stream beside an opened token file.

  Raises:
    ValueError: no tag stream, or one that does not describe the token
      file (another length, tag ids past its vocabulary, offsets outside
      the file).
  """
  hpath = tags_header_path(tokens.path)
  if not os.path.isfile(hpath):
    raise ValueError(f"token file {tokens.path} has no tag stream ({hpath});"
                     " write it with bin/prepare_brown")
  record = _read_json(hpath, "tag header")
  if not isinstance(record, dict) or record.get("format") != TAGS_FORMAT \
      or record.get("version") != TAGS_VERSION:
    raise ValueError(f"{hpath} is not a {TAGS_FORMAT} version"
                     f" {TAGS_VERSION} header")
  n = tokens.header.num_tokens
  if record.get("num_tokens") != n:
    raise ValueError(f"tag header {hpath} describes {record.get('num_tokens')}"
                     f" tokens, but {tokens.path} holds {n}; write both again")
  ids_path, sent_path = tags_path(tokens.path), sentences_path(tokens.path)
  for file, size in ((ids_path, 2 * n),
                     (sent_path, 8 * record.get("num_sentences", -1))):
    if not os.path.isfile(file) or os.path.getsize(file) != size:
      raise ValueError(f"{file} is missing or not {size} bytes long; write"
                       " the token file and its tags again")
  ids = np.memmap(ids_path, dtype="<u2", mode="r", shape=(n,))
  if max_id(ids_path, np.dtype("<u2")) >= len(record["tags"]):
    raise ValueError(f"{ids_path} holds tag ids past its"
                     f" {len(record['tags'])} tags")
  sentences = np.fromfile(sent_path, dtype="<i8")
  if sentences.size and (sentences.min() < 0 or sentences.max() > n):
    raise ValueError(f"{sent_path} holds offsets outside [0, {n}]")
  return TagStream(tuple(record["tags"]), ids, sentences,
                   tuple(record["documents"]))
