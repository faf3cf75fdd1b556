"""Brown's tags fold into the coarse classes by the rule written down."""

import numpy as np
import pytest

from decompax.targets import brown, brown_tags

# Tag spellings as Brown writes them (compounds, affixes, negations,
# contractions, foreign words), with the class each must land in.
REAL_TAGS = {
  "nn": "noun", "nns": "noun", "nn$": "noun", "nns$": "noun",
  "np": "noun", "np$": "noun", "nps": "noun", "np-tl": "noun",
  "nn-tl": "noun", "nn-hl": "noun", "nn-tl-hl": "noun", "np$-tl": "noun",
  "nr": "noun", "nr-tl": "noun", "nn-nc": "noun", "nn+bez": "noun",
  "np+bez": "noun", "nn+hvz": "noun",
  "vb": "verb", "vbd": "verb", "vbg": "verb", "vbn": "verb", "vbz": "verb",
  "vbd-hl": "verb", "vbn-tl": "verb", "be": "verb", "bedz": "verb",
  "bez": "verb", "bez*": "verb", "bed*": "verb", "ber*": "verb",
  "do": "verb", "do*": "verb", "dod*": "verb", "doz*": "verb",
  "hv": "verb", "hvd": "verb", "hvz*": "verb", "md": "verb", "md*": "verb",
  "md+hv": "verb", "vb+ppo": "verb", "vb+rp": "verb", "hvd*": "verb",
  "jj": "adjective", "jjr": "adjective", "jjs": "adjective",
  "jjt": "adjective", "jj-tl": "adjective", "jj$-tl": "adjective",
  "jj-hl": "adjective", "jj-nc": "adjective",
  "rb": "adverb", "rbr": "adverb", "rbt": "adverb", "rn": "adverb",
  "ql": "adverb", "qlp": "adverb", "wrb": "adverb", "wql": "adverb",
  "abl": "adverb", "*": "adverb", "*-hl": "adverb", "rb$": "adverb",
  "wrb+bez": "adverb",
  "pps": "pronoun", "ppss": "pronoun", "ppo": "pronoun", "pp$": "pronoun",
  "pp$$": "pronoun", "ppl": "pronoun", "ppls": "pronoun", "pn": "pronoun",
  "pn$": "pronoun", "wps": "pronoun", "wpo": "pronoun", "wp$": "pronoun",
  "ex": "pronoun", "pps+bez": "pronoun", "ppss+md": "pronoun",
  "ppss+ber": "pronoun", "ex+bez": "pronoun", "pps+md": "pronoun",
  "at": "determiner", "ap": "determiner", "abn": "determiner",
  "abx": "determiner", "dt": "determiner", "dti": "determiner",
  "dts": "determiner", "dtx": "determiner", "wdt": "determiner",
  "at-tl": "determiner", "dt$": "determiner", "ap$": "determiner",
  "wdt+bez": "determiner", "at-hl": "determiner",
  "in": "preposition", "in-tl": "preposition", "in-hl": "preposition",
  "in+in": "preposition", "in+ppo": "preposition",
  "cc": "conjunction", "cs": "conjunction", "cc-tl": "conjunction",
  "cs-hl": "conjunction",
  "cd": "number", "od": "number", "cd$": "number", "cd-tl": "number",
  "od-tl": "number",
  ".": "punctuation", ",": "punctuation", ":": "punctuation",
  "(": "punctuation", ")": "punctuation", "--": "punctuation",
  "'": "punctuation", "''": "punctuation", "``": "punctuation",
  "`": "punctuation", ".-hl": "punctuation", ",-hl": "punctuation",
  "(-hl": "punctuation", ")-hl": "punctuation", "---hl": "punctuation",
  ":-tl": "punctuation",
  "rp": "other", "to": "other", "uh": "other", "nil": "other",
  "to+vb": "other", "uh-tl": "other", "rp-hl": "other",
  "fw-nn": "noun", "fw-nns": "noun", "fw-jj": "adjective",
  "fw-in": "preposition", "fw-at": "determiner", "fw-in+at": "preposition",
  "fw-vb": "verb", "fw-cc": "conjunction", "fw-*": "adverb",
  "fw-nn-tl": "noun", "fw-pps": "pronoun", "fw-cd": "number",
  "fw-rb": "adverb", "fw-in+nn-tl": "preposition", "fw-uh": "other",
  "<eos>": "boundary", "<sep>": "boundary",
}


@pytest.mark.parametrize("tag", sorted(REAL_TAGS))
def test_real_tag_lands_in_its_class(tag):
  assert brown_tags.coarse_class(tag) == REAL_TAGS[tag]


def test_the_classes_are_twelve_and_all_reached():
  assert len(brown_tags.COARSE) == 12 == len(set(brown_tags.COARSE))
  assert set(REAL_TAGS.values()) == set(brown_tags.COARSE)


def test_upper_case_tags_fold_like_lower_case():
  for tag in REAL_TAGS:
    if tag not in brown.SPECIAL_TAGS:
      assert brown_tags.coarse_class(tag.upper()) == REAL_TAGS[tag], tag


@pytest.mark.parametrize("tag, base", [
  ("nn$-tl", "nn"), ("np-tl-hl", "np"), ("fw-in+at", "in"), ("md*", "md"),
  ("*", "*"), ("pp$$", "pp"), ("pps+bez", "pps"), ("nn-nc", "nn"),
  ("---hl", "--"), ("fw-*", "*"), ("<eos>", "<eos>"),
])
def test_base_tag_follows_the_rule(tag, base):
  assert brown_tags.base_tag(tag) == base


def test_unknown_tags_fall_back_on_their_characters():
  assert brown_tags.coarse_class("zz") == "other"
  assert brown_tags.coarse_class("!?") == "punctuation"


def test_every_base_of_the_table_maps_to_a_class_of_its_own_name():
  assert set(brown_tags.BASE_CLASS.values()) == set(brown_tags.COARSE)
  for base, name in brown_tags.BASE_CLASS.items():
    assert brown_tags.coarse_class(base) == name


def test_coarse_ids_index_the_class_names_in_vocabulary_order():
  vocab = brown.SPECIAL_TAGS + ("at", "nn$", "vbd-hl", ".", "fw-in")
  ids = brown_tags.coarse_ids(vocab)
  assert ids.dtype == np.int32 and ids.shape == (len(vocab),)
  assert [brown_tags.COARSE[i] for i in ids] == [
    "boundary", "boundary", "determiner", "noun", "verb", "punctuation",
    "preposition"]
