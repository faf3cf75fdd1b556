"""io/harvest_store: a harvest's record read back, refused when made with
other settings or unreadable (and then replaced only when asked), its
running totals resumed, its manifest written last."""

import json
import os

import numpy as np
import pytest

from decompax.io import harvest_store

SETTINGS = {"n_batches": 4, "top_k": 5, "tag_groups": 0, "windows": "",
            "tag_revision": 0}


def _totals():
  return {"mlp": {"fired": np.arange(3, dtype=np.int32),
                  "ci_sum": np.linspace(0, 1, 3, dtype=np.float32)}}


def test_a_saved_state_resumes_its_totals_and_the_manifest_ends_it(tmp_path):
  out = str(tmp_path / harvest_store.HARVEST_DIR)
  harvest_store.prepare(out, say=print)
  assert harvest_store.resume(out, {}, SETTINGS, overwrite=False) == 0
  harvest_store.save_state(out, _totals(), 2, SETTINGS)
  totals = {"mlp": {}}
  assert harvest_store.resume(out, totals, SETTINGS, overwrite=False) == 2
  np.testing.assert_array_equal(totals["mlp"]["fired"], [0, 1, 2])
  assert harvest_store.write_store(out, totals, ("fired", "other")) == [
    os.path.join("mlp", "fired")]
  with pytest.raises(ValueError, match="no finished harvest"):
    harvest_store.read_manifest(str(tmp_path))
  harvest_store.write_manifest(out, {"settings": SETTINGS, "sites": {}})
  assert not os.path.exists(harvest_store.state_path(out))
  assert harvest_store.resume(out, {}, SETTINGS, overwrite=False) == -1
  assert harvest_store.read_manifest(str(tmp_path))["settings"] == SETTINGS
  read = harvest_store.read_arrays(str(tmp_path), "mlp", ("fired",))
  np.testing.assert_array_equal(read["fired"], [0, 1, 2])


@pytest.mark.parametrize("manifest, why", [
  ("{}", "lacks the key 'settings'"),
  ('{"settings": [1]}', "has 'settings' that is not a JSON object"),
  ("{", "cannot be read (Expecting"),
])
def test_an_unreadable_manifest_is_named_and_overwritten_only_if_asked(
    tmp_path, manifest, why):
  path = tmp_path / harvest_store.MANIFEST
  path.write_text(manifest)
  with pytest.raises(harvest_store.HarvestConflict) as error:
    harvest_store.resume(str(tmp_path), {}, SETTINGS, overwrite=False)
  assert str(error.value).startswith(f"{path} {why}")
  assert path.read_text() == manifest
  assert harvest_store.resume(str(tmp_path), {}, SETTINGS,
                              overwrite=True) == 0
  assert not path.exists()


def test_a_recorded_harvest_lacking_a_setting_names_it(tmp_path):
  recorded = {k: v for k, v in SETTINGS.items() if k != "top_k"}
  (tmp_path / harvest_store.MANIFEST).write_text(
    json.dumps({"settings": recorded}))
  with pytest.raises(harvest_store.HarvestConflict,
                     match=r"settings \(top_k\)"):
    harvest_store.resume(str(tmp_path), {}, SETTINGS, overwrite=False)


def test_a_harvest_from_before_tag_statistics_is_still_this_harvest(
    tmp_path):
  """A record without `tag_groups` had none: complete, not a conflict; a
  tagged harvest of the same settings is another one."""
  recorded = {k: v for k, v in SETTINGS.items() if k != "tag_groups"}
  (tmp_path / harvest_store.MANIFEST).write_text(
    json.dumps({"settings": recorded}))
  assert harvest_store.resume(str(tmp_path), {}, SETTINGS, False) == -1
  tagged = {**SETTINGS, "tag_groups": 3}
  with pytest.raises(harvest_store.HarvestConflict, match="tag_groups"):
    harvest_store.resume(str(tmp_path), {}, tagged, overwrite=False)


def test_a_tag_harvest_from_before_the_context_statistics_is_another(
    tmp_path):
  """A tagged record without `tag_revision` lacks the matched neurons and
  the context statistics: today's tag harvest must not resume onto it; an
  untagged one is still the same harvest."""
  tagged = {**SETTINGS, "tag_groups": 3}
  recorded = {k: v for k, v in tagged.items() if k != "tag_revision"}
  (tmp_path / harvest_store.MANIFEST).write_text(
    json.dumps({"settings": recorded}))
  with pytest.raises(harvest_store.HarvestConflict, match="tag_revision"):
    harvest_store.resume(str(tmp_path), {}, {**tagged, "tag_revision": 1},
                         overwrite=False)
  assert harvest_store.resume(str(tmp_path), {}, tagged, False) == -1


def test_a_harvest_of_random_windows_is_not_one_of_spread_windows(
    tmp_path):
  """A record without `windows` drew its token windows at random: a toy's
  harvest still, but not a token file's harvest of today's spread
  windows, which must not resume onto it."""
  (tmp_path / harvest_store.MANIFEST).write_text(
    json.dumps({"settings": SETTINGS}))
  assert harvest_store.resume(str(tmp_path), {}, {**SETTINGS, "windows": ""},
                              False) == -1
  with pytest.raises(harvest_store.HarvestConflict, match="windows"):
    harvest_store.resume(str(tmp_path), {}, {**SETTINGS, "windows": "spread"},
                         overwrite=False)


def test_clusters_round_trip_and_a_damaged_file_is_named(tmp_path):
  run = str(tmp_path)
  os.makedirs(os.path.join(run, harvest_store.HARVEST_DIR))
  assert harvest_store.read_clusters(run) is None
  record = {"version": 1, "sites": {"a": {"clusters": [{"members": [0, 2]}]}}}
  path = harvest_store.write_clusters(run, record)
  assert harvest_store.read_clusters(run) == record
  with open(path, "w") as f:
    f.write("{not json")
  with pytest.raises(ValueError, match="cannot be read .*rerun bin/cluster"):
    harvest_store.read_clusters(run)
  with open(path, "w") as f:
    json.dump([1, 2], f)
  with pytest.raises(ValueError, match="holds no clusters; rerun bin/cluster"):
    harvest_store.read_clusters(run)
