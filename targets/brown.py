"""Pure parts of the Brown-corpus pipeline: the split, each document's text
and the tag of every token, the n-gram baselines and the BPE tokenizer.

A document is a list of sentences, a sentence a list of `(word, tag)`
pairs as the corpus spells them (`("Atlanta's", "np$")`). Its text joins a
sentence's words with one space and sentences with one newline, so every
word is a character span and every sentence starts after a newline.

The tag of a token is the tag of the word its first character belongs to.
A space belongs to the word after it (byte-level BPE fuses a word's
leading space into the word's first token); a newline belongs to no word
and tags its token `SEPARATOR`. The EOS id after each document is tagged
`EOS_TAG`.

Cross entropies are in nats per predicted token.
"""

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
from jaxtyping import Float, Int

# Documents per genre (the letter after `c` in a file name), as distributed.
GENRE_SIZES = {"a": 44, "b": 27, "c": 17, "d": 17, "e": 36, "f": 48,
               "g": 75, "h": 30, "j": 80, "k": 29, "l": 24, "m": 6,
               "n": 29, "p": 29, "r": 9}
HELD_OUT_FRACTION = 0.1
EOS_TAG = "<eos>"
SEPARATOR = "<sep>"
SPECIAL_TAGS = (EOS_TAG, SEPARATOR)
EOS_TOKEN = "<|endoftext|>"
_NAME = re.compile(r"^c([a-z])(\d\d)$")

Sentence = Sequence[tuple[str, str]]
Document = Sequence[Sentence]


class DocumentText(NamedTuple):
  """A document's text and where its words and sentences lie in it."""

  text: str
  word_owner: Int[np.ndarray, " chars"]  # word index of each char, −1: none
  word_tags: tuple[str, ...]
  sentence_chars: Int[np.ndarray, " sentences"]  # first char of each


class Split(NamedTuple):
  """Document names of the training and held-out parts, in corpus order."""

  train: tuple[str, ...]
  held_out: tuple[str, ...]


def document_names(sizes: Mapping[str, int] = GENRE_SIZES) -> tuple[str, ...]:
  """Return every document's file name (`ca01` …) for genre sizes."""
  return tuple(f"c{g}{i:02d}" for g in sorted(sizes)
               for i in range(1, sizes[g] + 1))


def genre(name: str) -> str:
  """Return the genre letter of a document name (`ca01` -> `a`)."""
  m = _NAME.match(name)
  if m is None:
    raise ValueError(f"{name!r} is not a Brown document name (c<genre><nn>)")
  return m.group(1)


def held_out_count(n: int, fraction: float = HELD_OUT_FRACTION) -> int:
  """Return how many of a genre's `n` documents are held out: the nearest
  count to `fraction·n`, at least one where the genre has two or more."""
  if n < 2:
    return 0
  return min(n - 1, max(1, round(fraction * n)))


def split_documents(
  names: Iterable[str], fraction: float = HELD_OUT_FRACTION
) -> Split:
  """Return the fixed split by document, stratified by genre.

  Within each genre (names sorted), `k = held_out_count(n)` documents
  spread evenly over its run are held out: index `⌊(i + ½)·n/k⌋` for
  `i < k`. Genres are ordered runs of sub-genres, so even spacing samples
  every part of a genre; no randomness, so the split depends on the names
  alone.
  """
  by_genre: dict[str, list[str]] = {}
  for name in sorted(set(names)):
    by_genre.setdefault(genre(name), []).append(name)
  held = set()
  for members in by_genre.values():
    n = len(members)
    k = held_out_count(n, fraction)
    held.update(members[int((i + 0.5) * n / k)] for i in range(k))
  ordered = sorted(set(names))
  return Split(tuple(n for n in ordered if n not in held),
               tuple(n for n in ordered if n in held))


def validation_carve(split: Split) -> Split:
  """Return the training part carved again as the split itself was made:
  `train` is what a recipe trains on, `held_out` the validation documents
  it is chosen on, so that no choice reads the split's own held-out part."""
  return split_documents(split.train)


def document_text(document: Document) -> DocumentText:
  """Return a document's text and its word and sentence spans."""
  pieces, owner, tags, starts = [], [], [], []
  at = 0
  for s, sentence in enumerate(document):
    if s:
      pieces.append("\n")
      owner.append(-1)
      at += 1
    starts.append(at)
    for w, (word, tag) in enumerate(sentence):
      if w:
        pieces.append(" ")
        owner.append(len(tags))  # the space goes with the next word
        at += 1
      pieces.append(word)
      owner.extend([len(tags)] * len(word))
      tags.append(tag)
      at += len(word)
  return DocumentText("".join(pieces), np.asarray(owner, np.int64),
                      tuple(tags), np.asarray(starts, np.int64))


def token_tags(
  doc: DocumentText, token_starts: Int[np.ndarray, " tokens"],
  tag_ids: Mapping[str, int],
) -> Int[np.ndarray, " tokens"]:
  """Return the tag id of each token from its first character's offset."""
  if not len(token_starts):
    return np.zeros(0, np.int64)
  words = doc.word_owner[np.asarray(token_starts, np.int64)]
  per_word = np.asarray([tag_ids[t] for t in doc.word_tags] or [0], np.int64)
  return np.where(words >= 0, per_word[np.maximum(words, 0)],
                  tag_ids[SEPARATOR])


def sentence_tokens(
  doc: DocumentText, token_starts: Int[np.ndarray, " tokens"],
) -> Int[np.ndarray, " sentences"]:
  """Return the index of each sentence's first token in the document."""
  return np.searchsorted(np.asarray(token_starts, np.int64),
                         doc.sentence_chars, side="left").astype(np.int64)


def tag_vocabulary(documents: Iterable[Document]) -> tuple[str, ...]:
  """Return the special tags, then every tag of `documents` sorted."""
  seen = {tag for doc in documents for sentence in doc
          for _, tag in sentence}
  return SPECIAL_TAGS + tuple(sorted(seen - set(SPECIAL_TAGS)))


def train_bpe(texts: Iterable[str], vocab_size: int):
  """Return a byte-level BPE `tokenizers.Tokenizer` trained on `texts`.

  Id 0 is `EOS_TOKEN`; the 256 byte symbols are always in the vocabulary,
  so any text encodes and decodes back to itself. Words do not get a
  prefix space: decoding gives back exactly the text encoded.
  """
  import tokenizers  # noqa: PLC0415 (heavy; only tokenizer training uses it)

  alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + 1:
    raise ValueError(f"BPE vocab size {vocab_size} must exceed the"
                     f" {len(alphabet)} byte symbols plus EOS")
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
    add_prefix_space=False, use_regex=True)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
    initial_alphabet=alphabet, show_progress=False, min_frequency=2)
  tokenizer.train_from_iterator(texts, trainer=trainer)
  return tokenizer


class Baselines(NamedTuple):
  """Held-out cross entropies of the n-gram baselines."""

  unigram: float
  bigram: float
  bigram_alpha: float  # the bigram's smoothing, chosen on held-out


def unigram_log_probs(
  train: Int[np.ndarray, " n"], vocab_size: int
) -> Float[np.ndarray, " vocab"]:
  """Return add-one smoothed unigram log-probabilities of `train`."""
  counts = np.bincount(np.asarray(train, np.int64), minlength=vocab_size)
  return np.log((counts + 1.0) / (counts.sum() + vocab_size))


def _pair_keys(ids: Int[np.ndarray, " n"], vocab_size: int) -> np.ndarray:
  ids = np.asarray(ids, np.int64)
  return ids[:-1] * vocab_size + ids[1:]


def bigram_cross_entropies(
  train: Int[np.ndarray, " n"], previous: Int[np.ndarray, " m"],
  targets: Int[np.ndarray, " m"], vocab_size: int, alphas: Sequence[float],
) -> Float[np.ndarray, " alphas"]:
  """Return, per smoothing `α`, the mean −log p(target | previous) of the
  bigram `p(b|a) = (c(a,b) + α·p₁(b)) / (c(a) + α)` fitted on `train`
  (`p₁` the add-one unigram).

  Pairs are counted sparsely (a `[vocab, vocab]` table would not fit
  8192²-sized vocabularies in memory comfortably).
  """
  keys, counts = np.unique(_pair_keys(train, vocab_size), return_counts=True)
  query = np.asarray(previous, np.int64) * vocab_size + np.asarray(
    targets, np.int64)
  if not len(keys):
    raise ValueError("the bigram needs a training stream of two tokens or"
                     " more")
  where = np.minimum(np.searchsorted(keys, query), len(keys) - 1)
  pair = np.where(keys[where] == query, counts[where], 0)
  context = np.bincount(np.asarray(train, np.int64)[:-1],
                        minlength=vocab_size)[np.asarray(previous, np.int64)]
  unigram = np.exp(unigram_log_probs(train, vocab_size))[targets]
  return np.asarray([
    -np.mean(np.log((pair + a * unigram) / (context + a))) for a in alphas])


def baselines(
  train: Int[np.ndarray, " n"], previous: Int[np.ndarray, " m"],
  targets: Int[np.ndarray, " m"], vocab_size: int,
) -> Baselines:
  """Return unigram and bigram cross entropies on `targets` (each predicted
  after its `previous` token), both fitted on `train`.

  The bigram's `α` is the best of a grid on these very targets: the
  baseline is as strong as its form allows, so a model that beats it beats
  every bigram of this family.
  """
  unigram = float(-np.mean(unigram_log_probs(train, vocab_size)[targets]))
  alphas = tuple(10.0 ** e for e in np.arange(-1.0, 4.01, 0.5))
  ce = bigram_cross_entropies(train, previous, targets, vocab_size, alphas)
  best = int(np.argmin(ce))
  return Baselines(unigram, float(ce[best]), alphas[best])


def eval_windows(num_tokens: int, seq_len: int) -> int:
  """Return how many disjoint windows of `seq_len + 1` tokens (overlapping
  by one: inputs and their next tokens) a held-out stream holds."""
  return max(0, (num_tokens - 1) // seq_len)


def perplexity(cross_entropy: float) -> float:
  """Return `exp(cross_entropy)`."""
  return math.exp(cross_entropy)
