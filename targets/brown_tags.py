"""Brown's part-of-speech tags folded into twelve coarse classes.

The coarse classes follow the word classes of traditional grammar (close
to the universal part-of-speech set, with particles and interjections
folded into `other`), plus `boundary` for the positions that hold no word
(`targets.brown.SPECIAL_TAGS`: a document's EOS, a sentence's newline).

A Brown tag is read in this order (`base_tag`):
1. lower case (the corpus files write tags in lower case, NLTK upper);
2. a leading `fw-` (foreign word) is dropped: the rest is the tag the word
   would have in English (`fw-in` is a preposition), a bare `fw` is other;
3. a contraction `a+b` keeps its first part (`pps+bez` "he's" is a
   pronoun, `md*+hv` a verb);
4. the affixes `-hl` (headline), `-tl` (title) and `-nc` (cited word) are
   dropped wherever they end the tag, repeatedly (`nn-tl-hl` is `nn`);
5. a trailing `*` (negation fused into the word: `md*` "can't") and a
   trailing `$` or `$$` (possessive: `nn$`, `pp$$`) are dropped, but a bare
   `*` ("not", "n't") stays, an adverb.
The base is then looked up in `BASE_CLASS`; a base not there is
punctuation when it holds no letter or digit, and other otherwise.
"""

from collections.abc import Sequence

import numpy as np
from jaxtyping import Int

from decompax.targets import brown

COARSE = ("noun", "verb", "adjective", "adverb", "pronoun", "determiner",
          "preposition", "conjunction", "number", "punctuation", "other",
          "boundary")
AFFIXES = ("-hl", "-tl", "-nc")
FOREIGN = "fw-"

# Every base tag of the Brown manual, by class. Choices that could go
# either way: `nr` (adverbial noun: "home", "Sunday") and `nrs` are nouns;
# `od` (ordinal: "first") is a number; `ex` (existential "there") is a
# pronoun; `abl` ("quite", "rather"), `ql`, `qlp` (qualifiers), `rn`
# ("here", "then") and the wh-adverbs are adverbs; `ap` ("many", "next"),
# `abn` ("all", "half") and `abx` ("both") are determiners; `rp`
# (particle), `to` (infinitive marker), `uh` (interjection) and `nil` are
# other.
_CLASSES = {
  "noun": ("nn", "nns", "np", "nps", "nr", "nrs"),
  "verb": ("vb", "vbd", "vbg", "vbn", "vbz", "be", "bed", "bedz", "beg",
           "bem", "ben", "ber", "bez", "do", "dod", "doz", "hv", "hvd",
           "hvg", "hvn", "hvz", "md"),
  "adjective": ("jj", "jjr", "jjs", "jjt"),
  "adverb": ("rb", "rbr", "rbt", "rn", "ql", "qlp", "wql", "wrb", "abl",
             "*"),
  "pronoun": ("pn", "pp", "ppl", "ppls", "ppo", "pps", "ppss", "wp", "wpo",
              "wps", "ex"),
  "determiner": ("at", "ap", "abn", "abx", "dt", "dti", "dts", "dtx",
                 "wdt"),
  "preposition": ("in",),
  "conjunction": ("cc", "cs"),
  "number": ("cd", "od"),
  "punctuation": (".", ",", ":", "(", ")", "--", "'", "''", "`", "``"),
  "other": ("rp", "to", "uh", "fw", "nil"),
  "boundary": brown.SPECIAL_TAGS,
}
BASE_CLASS = {tag: name for name, tags in _CLASSES.items() for tag in tags}


def base_tag(tag: str) -> str:
  """Return the base of a Brown tag by the module's rule (`nn$-tl` ->
  `nn`, `fw-in+at` -> `in`, `md*` -> `md`, `*` -> `*`)."""
  if tag in brown.SPECIAL_TAGS:
    return tag
  tag = tag.lower()
  if tag.startswith(FOREIGN):
    tag = tag[len(FOREIGN):]
  tag = tag.split("+", 1)[0] or tag
  stripped = True
  while stripped:
    stripped = False
    for affix in AFFIXES:
      if tag.endswith(affix) and len(tag) > len(affix):
        tag, stripped = tag[:-len(affix)], True
  if len(tag) > 1:
    tag = tag.rstrip("$")
  if len(tag) > 1 and tag.endswith("*"):
    tag = tag[:-1]
  return tag


def coarse_class(tag: str) -> str:
  """Return the coarse class (one of `COARSE`) of a Brown tag."""
  base = base_tag(tag)
  if base in BASE_CLASS:
    return BASE_CLASS[base]
  if not any(ch.isalnum() for ch in base):
    return "punctuation"
  return "other"


def coarse_ids(tags: Sequence[str]) -> Int[np.ndarray, " tags"]:
  """Return the index into `COARSE` of each tag of a tag vocabulary (a tag
  stream's `tags`), so that `coarse_ids(tags)[tag_id]` classes a token."""
  return np.asarray([COARSE.index(coarse_class(t)) for t in tags], np.int32)
