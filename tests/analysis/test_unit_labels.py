"""Unit labels from a tagged harvest's counts: each unit's class, tag,
purity and lift against the base rates, and a dead unit labelled None
(`docs/tag_profiles.md`). A harvest of a real run: tests/analysis/
test_unit_contexts.py."""

import numpy as np
import pytest

from decompax.analysis import harvesting, unit_labels

TAGS = {"tags": ["NN", "NNS", "VB"], "classes": ["noun", "verb"]}
# Two units in one group: unit 0 fires on nouns 3 times and on a verb once;
# unit 1 never fires.
FIELDS = {
  "tag_fine": np.array([[2.0, 1.0, 1.0], [0.0, 0.0, 0.0]]),
  "tag_coarse": np.array([[[3.0, 1.0], [0.0, 0.0]]]),
  "tag_bigram": np.zeros((2, 2, 2)),
  "tag_base_fine": np.array([5, 5, 10]),
  "tag_base_coarse": np.array([[10, 10]]),
}
HARVEST = harvesting.Harvest({"tags": TAGS}, {"s": FIELDS},
                             {"layers.0.mlp.neurons": FIELDS})


def test_a_live_unit_is_labelled_by_its_heaviest_class_and_tag():
  live, dead = unit_labels.labels(HARVEST, "s")
  assert (live["class"], live["tag"]) == ("noun", "NN")
  assert live["purity"] == pytest.approx(0.75)
  assert live["lift"] == pytest.approx(0.75 / 0.5)
  assert live["activity"] == pytest.approx(1.0)
  assert live["top_tags"][0] == ["NN", pytest.approx(0.5)]
  assert live["implied_purity"] is None  # no context statistics
  assert dead["class"] is None and dead["tag"] is None
  assert dead["purity"] is None and dead["activity"] == 0.0


def test_unit_sets_are_the_sites_then_the_baselines():
  assert unit_labels.tagged(HARVEST)
  assert not unit_labels.tagged(harvesting.Harvest({}, {}, {}))
  assert list(unit_labels.unit_sets(HARVEST)) == ["s", "layers.0.mlp.neurons"]
  assert unit_labels.baseline_kind("layers.0.mlp.neurons") == "neurons"
  with pytest.raises(KeyError):
    unit_labels.labels(HARVEST, "nowhere")
