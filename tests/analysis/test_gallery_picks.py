"""The gallery (docs/brown.md shows two): its rule on a harvest of known labels, its markdown,
and `bin/gallery` on a tagged text run."""

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from decompax.analysis import gallery_picks as gallery
from decompax.analysis import harvesting as harvest_lib
from decompax.analysis import harvest_settings
from decompax.targets import brown_tags

ROOT = pathlib.Path(__file__).resolve().parents[2]
TAGS = ["<eos>", "<sep>", "nn", "vb", "jj"]
K = len(brown_tags.COARSE)
NOUN, VERB, ADJ = (brown_tags.COARSE.index(c)
                   for c in ("noun", "verb", "adjective"))


def _site(classes: list[dict[int, float]], fired: list[int]) -> dict:
  """A site whose component `c` has activity `classes[c]` per class, one
  document group; fine tags follow the class (nn, vb, jj)."""
  c = len(classes)
  coarse = np.zeros((1, c, K))
  fine = np.zeros((c, len(TAGS)))
  tag_of = {NOUN: 2, VERB: 3, ADJ: 4}
  for u, mass in enumerate(classes):
    for k, x in mass.items():
      coarse[0, u, k] = x
      fine[u, tag_of[k]] = x
  window = np.zeros((c, 2, 5), np.int64) + np.arange(5)
  return {"fired": np.asarray(fired), "tag_coarse": coarse, "tag_fine": fine,
          "tag_bigram": np.zeros((c, K, K)),
          "tag_base_fine": np.asarray([1, 1, 4, 3, 2]),
          "tag_base_coarse": np.full((1, K), 1),
          "top_context": window, "top_ci": np.ones((c, 2)),
          "top_context_ci": np.ones((c, 2, 5))}


@pytest.fixture(scope="module")
def harvest():
  """Site a: three nouns of purity 1, 0.9, 0.8, a verb of 0.95, one that
  never fired (purity 1) and one too quiet (purity 1, activity 0.1); site
  b: two adjectives of 0.7 and 0.6."""
  a = _site([{NOUN: 10}, {NOUN: 9, VERB: 1}, {NOUN: 8, VERB: 2},
             {VERB: 9.5, NOUN: 0.5}, {NOUN: 10}, {NOUN: 0.1}],
            [1, 1, 1, 1, 0, 1])
  b = _site([{ADJ: 7, NOUN: 3}, {ADJ: 6, VERB: 4}], [1, 1])
  coarse_of = brown_tags.coarse_ids(TAGS).tolist()
  manifest = {"tags": {"tags": TAGS, "classes": list(brown_tags.COARSE),
                       "coarse_of": coarse_of, "baselines": []},
              "positions": 100, "settings": {"before": 2}}
  return harvest_lib.Harvest(manifest, {"a": a, "b": b}, {})


def test_the_purest_active_components_at_most_two_per_class(harvest):
  picks = gallery.pick(harvest, count=5, per_class=2, active=0.5)
  assert [(p.site, p.component) for p in picks] == [
    ("a", 0), ("a", 3), ("a", 1), ("b", 0), ("b", 1)]
  assert [p.label["class"] for p in picks] == [
    "noun", "verb", "noun", "adjective", "adjective"]
  assert picks[2].label["purity"] == pytest.approx(0.9)
  # One per class: the third noun never enters, the count is not reached.
  assert [(p.site, p.component) for p in gallery.pick(
    harvest, count=6, per_class=1, active=0.5)] == [
    ("a", 0), ("a", 3), ("b", 0)]


def test_an_entry_is_its_label_and_contexts_in_markdown(harvest):
  words = {0: "a*", 1: " big", 2: " dog", 3: "\n", 4: " runs"}
  picks = gallery.pick(harvest, count=1)
  text = gallery.entry_markdown(harvest, picks[0], words.get, contexts=1)
  assert text.splitlines() == [
    # Every class holds 1/12 of the positions; site a's CI sums to 50.1.
    "**a c0** — noun · `nn`: purity 1.00, lift 12.00 (top tag 1.00, share "
    "of the site's CI 0.200)", "",
    r"- …a\* big **dog**⏎ runs…"]


def test_a_harvest_without_tags_has_no_gallery(harvest):
  untagged = harvest._replace(manifest={"positions": 1})
  with pytest.raises(ValueError, match="no tag statistics"):
    gallery.pick(untagged)


def test_bin_gallery_writes_entries_of_a_text_run(harvested, tmp_path):
  path = harvested("text_llama", positions=2 * 8 * 16, batch_size=8,
                   top_k=4, ablation_batches=1)
  out = tmp_path / "gallery.md"
  done = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "gallery"), f"--run_dir={path}",
     "--count=4", f"--output={out}"], capture_output=True, text=True,
    cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
  assert done.returncode == 0, done.stderr
  text = out.read_text()
  assert text.startswith("Gallery of `text_llama`")
  entries = [line for line in text.splitlines() if line.startswith("**")]
  assert len(entries) == 4 and all("purity" in e for e in entries)
  contexts = [line for line in text.splitlines() if line.startswith("- …")]
  assert len(contexts) == 4 * 3
  # Text from the run's BPE tokenizer, not token ids.
  assert any(w in text for w in ("dog", "cat", "house", "the"))
  # Its manifest beside it (`io/owned_dir.claimed_output`), its lock gone.
  manifest = json.loads((tmp_path / ".gallery.md.written.json").read_text())
  assert manifest["program"] == "gallery"
  assert manifest["entries"] == ["gallery.md"]
  assert manifest["settings"]["count"] == 4
  assert manifest["settings"]["harvest"]["sha256"] == hashlib.sha256(
    (pathlib.Path(path) / "harvest" / "manifest.json").read_bytes()
  ).hexdigest()
  assert sorted(os.listdir(tmp_path)) == [".gallery.md.written.json",
                                          "gallery.md"]


def test_context_selective_components_come_first(harvest):
  """With context statistics, a component whose tokens alone would make it
  far less pure ranks before purer ones its tokens explain."""
  sites = {}
  for name, fields in harvest.sites.items():
    counts = fields["tag_coarse"].sum(axis=0)
    sites[name] = {**fields, "tag_on": np.ones(len(counts), np.int64),
                   "tag_implied": counts.copy()}
  # a1 (noun 0.9) would be 0.5 pure from its tokens: excess 0.4.
  sites["a"]["tag_implied"][1, [NOUN, VERB]] = 5
  manifest = {**harvest.manifest, "settings": {
    **harvest.manifest["settings"],
    "tag_revision": harvest_settings.TAG_REVISION}}
  tagged = harvest._replace(manifest=manifest, sites=sites)
  picks = gallery.pick(tagged, count=3, per_class=2, active=0.5)
  assert [(p.site, p.component) for p in picks] == [
    ("a", 1), ("a", 0), ("a", 3)]
  assert picks[0].label["implied_purity"] == pytest.approx(0.5)
  assert picks[0].label["excess"] == pytest.approx(0.4)
  assert picks[1].label["excess"] == pytest.approx(0.0)
  text = gallery.gallery_markdown(tagged, "run", str, count=1)
  assert "highest excess of purity" in text
  assert "token-implied 0.50" in text
  assert "highest excess" not in gallery.gallery_markdown(
    harvest, "run", str, count=1)
