"""Units' labels and tagged contexts on a tagged harvest of a text run,
against direct computation: the CI at each kept position, the token file
and tag stream windows, and each label's purity and lift."""

import numpy as np
import pytest

from decompax.analysis import (
  explore, harvest_baselines, harvest_batches, unit_contexts, unit_labels)
from decompax.analysis import harvesting as harvest_lib
from decompax.io import tokens

SITE = "layers.1.mlp.up_proj"


@pytest.fixture(scope="module")
def text_run(harvested):
  path = harvested("text_llama", positions=2 * 8 * 16, batch_size=8,
                   top_k=4, ablation_batches=1)
  harvest = harvest_lib.load_harvest(path)
  run = explore.load_run(path)
  settings = unit_contexts.settings_of(harvest.manifest)
  # One sample for every test: its two batches compile once.
  return run, harvest, settings, unit_contexts.top_positions(
    run, settings, k=3, batches=2)


def test_top_positions_are_the_highest_ci_of_the_harvested_batches(
    text_run):
  run, _, settings, top = text_run
  assert set(top) == {s.name for s in run.target.sites} | set(
    harvest_baselines.baseline_keys((1,), (1,),
                                    sites=harvest_baselines.site_mlps(run)))
  n = tokens.open_tokens(settings.data_path).header.num_tokens
  read = harvest_batches.batch_source(run, settings)
  # Every harvested position's CI, by its offset in the token file.
  at = {}
  for i in range(2):
    ci = np.asarray(explore.component_ci(run, read(i))[SITE])
    starts = tokens.spread_window_starts(range(8 * i, 8 * i + 8),
                                         8 * settings.n_batches, n, 16)
    for row, first in enumerate(starts):
      for col in range(16):
        at[(int(first), int(first) + col)] = ci[row, col]
  every = np.stack(list(at.values()))
  np.testing.assert_allclose(top[SITE].activity,
                             -np.sort(-every, axis=0)[:3].T, rtol=1e-5)
  for u in range(8):
    for value, offset, first in zip(*(x[u] for x in top[SITE])):
      assert at[(int(first), int(offset))][u] == pytest.approx(value,
                                                               rel=1e-5)
  assert top["layers.1.mlp.neurons"].activity.shape == (64, 3)
  assert top["layers.1.self_attn.heads"].activity.shape == (2, 3)


def test_contexts_are_windows_of_the_token_file_and_its_tags(text_run):
  _, _, settings, top = text_run
  opened = tokens.open_tokens(settings.data_path)
  stream = tokens.open_tags(opened)
  found = unit_contexts.contexts(top[SITE], 1, opened.ids, stream.ids,
                                 settings.seq_len, 3, 2)
  assert found
  for x, value, at, start in zip(found, *(a[1] for a in top[SITE])):
    lo = int(at) - x.focus
    assert lo >= start and lo + len(x.ids) <= start + settings.seq_len
    assert x.focus <= 3 and len(x.ids) - x.focus - 1 <= 2
    assert list(x.ids) == opened.ids[lo:lo + len(x.ids)].tolist()
    assert list(x.tags) == stream.ids[lo:lo + len(x.ids)].tolist()
    assert x.activity == value and lo + x.focus == at


def test_labels_are_the_profiles_of_the_harvested_counts(text_run):
  _, harvest, _, _ = text_run
  fields = harvest.sites[SITE]
  counts = fields["tag_coarse"].sum(axis=0)
  base = fields["tag_base_coarse"].sum(axis=0)
  names = harvest.manifest["tags"]["tags"]
  classes = harvest.manifest["tags"]["classes"]
  for u, label in enumerate(unit_labels.labels(harvest, SITE)):
    mass = counts[u].sum()
    if mass == 0:
      assert label["class"] is None and label["purity"] is None
      continue
    k = int(np.argmax(counts[u]))
    assert label["class"] == classes[k]
    assert label["purity"] == pytest.approx(counts[u, k] / mass)
    assert label["lift"] == pytest.approx(
      counts[u, k] / mass / (base[k] / base.sum()))
    assert label["tag"] == names[int(np.argmax(fields["tag_fine"][u]))]
    assert label["activity"] == pytest.approx(mass / counts.sum())
    assert label["top_tags"][0][0] == label["tag"]
    implied = fields["tag_implied"][u]
    assert label["implied_purity"] == pytest.approx(implied.max() / mass,
                                                    rel=1e-4)
    assert label["excess"] == pytest.approx(
      label["purity"] - label["implied_purity"])
