"""The Brown pipeline's pure parts: split, text and tags, BPE, baselines."""

import collections

import numpy as np
import pytest

from decompax.targets import brown

NAMES = brown.document_names()
DOC = [[("The", "at"), ("dog's", "nn$"), ("1/2", "cd"), (".", ".")],
       [("It", "pps"), ("ran", "vbd"), ("!", ".")]]


def test_document_names_are_the_500_files():
  assert len(NAMES) == 500 == len(set(NAMES))
  assert NAMES[0] == "ca01" and NAMES[-1] == "cr09"
  assert collections.Counter(brown.genre(n) for n in NAMES) == \
    brown.GENRE_SIZES


def test_split_is_stratified_disjoint_and_about_a_tenth():
  split = brown.split_documents(NAMES)
  assert set(split.train) | set(split.held_out) == set(NAMES)
  assert not set(split.train) & set(split.held_out)
  assert 0.09 <= len(split.held_out) / len(NAMES) <= 0.11
  held = collections.Counter(brown.genre(n) for n in split.held_out)
  for g, n in brown.GENRE_SIZES.items():
    assert held[g] == brown.held_out_count(n) >= 1
    assert abs(held[g] - n / 10) <= 0.5 + (held[g] == 1)


def test_validation_carve_splits_the_training_part_alone_by_genre():
  split = brown.split_documents(NAMES)
  carve = brown.validation_carve(split)
  assert set(carve.train) | set(carve.held_out) == set(split.train)
  assert not set(carve.train) & set(carve.held_out)
  assert not set(carve.held_out) & set(split.held_out)
  assert {brown.genre(n) for n in carve.held_out} == set(brown.GENRE_SIZES)
  assert (len(carve.train), len(carve.held_out)) == (401, 47)


def test_split_depends_on_the_names_alone():
  shuffled = list(NAMES)
  np.random.default_rng(0).shuffle(shuffled)
  assert brown.split_documents(shuffled) == brown.split_documents(NAMES)


def test_split_spreads_a_genre_evenly():
  # Genre a (44 documents) holds out 4, one from each quarter of its run.
  held = [n for n in brown.split_documents(NAMES).held_out if n[1] == "a"]
  assert [int(n[2:]) for n in held] == [6, 17, 28, 39]


def test_split_keeps_a_lone_document_for_training():
  assert brown.split_documents(["ca01", "cb01", "cb02"]) == brown.Split(
    ("ca01", "cb01"), ("cb02",))


def test_bad_document_name_is_refused():
  with pytest.raises(ValueError, match="not a Brown document name"):
    brown.genre("README")


def test_document_text_marks_words_and_sentences():
  doc = brown.document_text(DOC)
  assert doc.text == "The dog's 1/2 .\nIt ran !"
  assert doc.word_tags == ("at", "nn$", "cd", ".", "pps", "vbd", ".")
  assert list(doc.sentence_chars) == [0, 16]
  owner = doc.word_owner
  assert owner[doc.text.index("dog")] == 1
  assert owner[doc.text.index(" dog")] == 1  # the space goes with its word
  assert owner[doc.text.index("\n")] == -1


@pytest.fixture(scope="module")
def bpe():
  texts = [brown.document_text(DOC).text * 3,
           "Zebras graze; café naïve — 42 × 7\n\ttabbed  double  spaces"]
  return brown.train_bpe(texts * 20, 300)


@pytest.mark.parametrize("text", [
  "The dog's 1/2 .\nIt ran !", "Zebras graze; café naïve — 42 × 7",
  "  leading and trailing spaces  ", "\ttabs\tand\n\nnew lines\n",
  "unseen: 日本語 🙂 Ωμέγα", ""])
def test_bpe_round_trips_any_text(bpe, text):
  ids = bpe.encode(text, add_special_tokens=False).ids
  assert bpe.decode(ids, skip_special_tokens=False) == text


def test_bpe_puts_eos_at_zero_and_has_the_size(bpe):
  assert bpe.token_to_id(brown.EOS_TOKEN) == 0
  assert bpe.get_vocab_size() == 300


def test_bpe_refuses_a_vocab_below_the_bytes():
  with pytest.raises(ValueError, match="byte symbols"):
    brown.train_bpe(["a"], 100)


def test_every_token_gets_its_words_tag(bpe):
  doc = brown.document_text(DOC)
  tags = brown.tag_vocabulary([DOC])
  tag_ids = {t: i for i, t in enumerate(tags)}
  enc = bpe.encode(doc.text, add_special_tokens=False)
  starts = np.asarray([s for s, _ in enc.offsets], np.int64)
  got = brown.token_tags(doc, starts, tag_ids)
  # Rebuild each token's word from the text and compare tags.
  words = {}
  at = 0
  for sentence in DOC:
    for word, tag in sentence:
      at = doc.text.index(word, at)
      words[(at, at + len(word))] = tag
      at += len(word)
  for (start, end), tag_id in zip(enc.offsets, got):
    piece = doc.text[start:end]
    if piece.strip() == "":
      assert tags[tag_id] == brown.SEPARATOR
      continue
    first = start + len(piece) - len(piece.lstrip())
    want = [t for (a, b), t in words.items() if a <= first < b]
    assert [tags[tag_id]] == want, piece
  sentences = brown.sentence_tokens(doc, starts)
  assert [bpe.decode([enc.ids[i]]).strip()[:1] for i in sentences] == \
    ["T", "I"]


def test_tag_vocabulary_puts_the_specials_first():
  assert brown.tag_vocabulary([DOC]) == (
    brown.EOS_TAG, brown.SEPARATOR, ".", "at", "cd", "nn$", "pps", "vbd")


def test_unigram_is_add_one_smoothed():
  log_p = brown.unigram_log_probs(np.array([0, 0, 1]), 3)
  np.testing.assert_allclose(np.exp(log_p), [3 / 6, 2 / 6, 1 / 6])


def test_bigram_beats_unigram_on_a_predictable_stream():
  train = np.tile(np.arange(8), 50)
  held = np.tile(np.arange(8), 5)
  base = brown.baselines(train, held[:-1], held[1:], 8)
  assert base.bigram < 0.1 < np.log(8) - 0.01 < base.unigram
  ce = brown.bigram_cross_entropies(train, held[:-1], held[1:], 8,
                                    [base.bigram_alpha, 1e6])
  # A huge α turns the bigram into the unigram.
  assert ce[0] == pytest.approx(base.bigram)
  assert ce[1] == pytest.approx(base.unigram, abs=1e-3)


def test_bigram_gives_unseen_pairs_the_unigram_share():
  train = np.array([0, 1, 0, 1, 2])
  ce = brown.bigram_cross_entropies(train, np.array([2]), np.array([2]), 3,
                                    [1.0])
  p_unigram = 2 / 8  # add-one: (1 + 1) / (5 + 3)
  # Token 2 never precedes anything in training: p = α·p₁ / α.
  assert ce[0] == pytest.approx(-np.log(p_unigram))


def test_bigram_backs_off_to_the_unigram_of_the_predicted_token():
  # Unigram (add-one): p₁ = (3/8, 3/8, 2/8); c(1) = 2 before a last token,
  # c(1, 2) = 1. The previous token (1) and the target (2) differ in p₁, so
  # the back-off must be read at the target: (1 + α·2/8) / (2 + α).
  train = np.array([0, 1, 0, 1, 2])
  ce = brown.bigram_cross_entropies(train, np.array([1]), np.array([2]), 3,
                                    [1.0, 4.0])
  np.testing.assert_allclose(ce, [-np.log(1.25 / 3), -np.log(2 / 6)])


def test_eval_windows_count():
  assert brown.eval_windows(10, 3) == 3
  assert brown.eval_windows(3, 3) == 0
