"""Components against the neurons of their layer, from a harvest's tag
statistics, on a harvest written by hand."""

import concurrent.futures

import numpy as np
import pytest

from decompax.analysis import harvesting as harvest_lib
from decompax.analysis import harvest_settings, tag_comparison
from decompax.measures import tag_metrics

BASE = np.asarray([[10, 10, 10], [20, 0, 10]])  # 2 documents, 3 classes


def _fields(coarse, fired=None):
  """A store key's fields for per-document class profiles `[g, u, k]`."""
  u, k = coarse.shape[1:]
  fields = dict(zip(harvest_settings.TAG_FIELDS, (
    coarse.sum(0), coarse, np.zeros((u, k, k)), BASE.sum(0), BASE)))
  if fired is not None:
    fields["fired"] = np.asarray(fired)
  return fields


@pytest.fixture(scope="module")
def harvest():
  # Components: two pure ones and a dead one (never fired, a little mass).
  components = np.asarray([[[4, 0, 0], [0, 0, 2], [0, 1, 0]],
                           [[3, 0, 0], [0, 0, 5], [0, 0, 0]]], float)
  neurons = np.asarray([[[2, 2, 0], [1, 1, 1]],
                        [[3, 0, 3], [2, 0, 2]]], float)
  sites = {"layers.0.mlp.up_proj": _fields(components, [5, 3, 0]),
           "layers.0.self_attn.q_proj": _fields(components, [1, 1, 1])}
  baselines = {f"layers.0.mlp.{kind}": _fields(neurons)
               for kind in harvest_settings.BASELINES}
  baselines["layers.0.self_attn.heads"] = _fields(neurons[:, :1])
  manifest = {"tags": {"baselines": list(baselines)}}
  return harvest_lib.Harvest(manifest, sites, baselines)


def test_a_thread_pools_map_gives_the_same_rows_in_order(harvest):
  """bin/harvest and bin/report run the comparisons on a thread pool."""
  plain = tag_comparison.comparisons(harvest, seed=0, n_boot=20)
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    pooled = tag_comparison.comparisons(harvest, 0, 20, map_fn=pool.map)
  assert [(r.site, r.baseline) for r in pooled] == [
    (r.site, r.baseline) for r in plain]
  assert [r.comparison.difference for r in pooled] == [
    r.comparison.difference for r in plain]


def test_each_mlp_site_meets_each_baseline_and_the_total(harvest):
  rows = tag_comparison.comparisons(harvest, seed=0, n_boot=20)
  assert [(r.site, r.baseline) for r in rows] == [
    ("layers.0.mlp.up_proj", kind) for kind in harvest_settings.BASELINES] + [
    ("layers.0.self_attn.q_proj", "heads")] + [
    ("total", kind) for kind in harvest_settings.BASELINES + ("heads",)]
  heads = rows[3].comparison
  assert heads.a["unweighted"].units == 3  # every q_proj component fired
  assert heads.b["unweighted"].units == 1
  assert heads.b["unweighted"].median_purity == pytest.approx(.5)
  # One MLP site, one layer: its total is the site.
  assert rows[4].comparison.difference == rows[0].comparison.difference
  got = rows[0].comparison
  assert got.a["unweighted"].units == 2  # the dead component is left out
  assert got.a["unweighted"].median_purity == 1.0
  # Neurons: [5, 2, 3] → .5 and [3, 1, 3] → 3/7; median of the two.
  assert got.b["unweighted"].median_purity == pytest.approx((.5 + 3 / 7) / 2)
  diff = got.difference["unweighted"]["median_purity"]
  assert diff.estimate == pytest.approx(1 - (.5 + 3 / 7) / 2)
  assert diff.low <= diff.estimate <= diff.high
  assert got.difference == tag_metrics.compare(
    tag_comparison.alive_components(harvest.sites["layers.0.mlp.up_proj"]),
    tag_comparison.tag_stats(harvest.baselines["layers.0.mlp.neurons"]),
    0, 20).difference


def test_a_harvest_without_tags_is_refused(harvest):
  with pytest.raises(ValueError, match="no tag statistics"):
    tag_comparison.comparisons(harvest._replace(manifest={}))


def test_baselines_of_each_site_kind():
  assert tag_comparison.baselines_of("layers.1.mlp.up_proj") == (
    ("neurons", "layers.1.mlp.neurons"),
    ("density_matched", "layers.1.mlp.up_proj.density_matched"),
    ("top_k", "layers.1.mlp.up_proj.top_k"),
    ("gates", "layers.1.mlp.gates"), ("rotated", "layers.1.mlp.rotated"))
  assert tag_comparison.baselines_of("layers.1.self_attn.q_proj") == ((
    harvest_settings.HEADS, "layers.1.self_attn.heads"),)
  # A mixture of experts' site: its own expert's neurons.
  assert [key for _, key in tag_comparison.baselines_of(
    "layers.1.mlp.experts.2.up_proj")] == [
      "layers.1.mlp.experts.2.neurons",
      "layers.1.mlp.experts.2.up_proj.density_matched",
      "layers.1.mlp.experts.2.up_proj.top_k",
      "layers.1.mlp.experts.2.gates", "layers.1.mlp.experts.2.rotated"]
  assert tag_comparison.baselines_of("lm_head") == ()


def _with_context(fields):
  """A store key's fields with context statistics: on at every position
  where it has activity in this sketch, its token-implied profile flat."""
  u, k = fields["tag_fine"].shape
  mass = fields["tag_coarse"].sum(axis=(0, 2))
  return {**fields, "tag_on": (mass > 0).astype(np.int64) * 7,
          "tag_implied": np.repeat(mass[:, None] / k, k, axis=1)}


@pytest.fixture(scope="module")
def matched(harvest):
  """The same harvest with each site's matched neurons and context
  statistics on every unit set."""
  site = "layers.0.mlp.up_proj"
  neurons = harvest.baselines["layers.0.mlp.neurons"]
  baselines = {key: _with_context(f) for key, f in harvest.baselines.items()}
  for kind in harvest_settings.SITE_BASELINES:
    baselines[f"{site}.{kind}"] = _with_context(
      {**neurons, "tag_coarse": neurons["tag_coarse"] * [1, 0, 0]})
  sites = {name: _with_context(f) for name, f in harvest.sites.items()}
  manifest = {"tags": {"baselines": list(baselines)},
              "settings": {"tag_revision": harvest_settings.TAG_REVISION}}
  return harvest_lib.Harvest(manifest, sites, baselines)


def test_matched_neurons_are_compared_where_the_harvest_has_them(matched):
  rows = tag_comparison.comparisons(matched, seed=0, n_boot=20)
  site = "layers.0.mlp.up_proj"
  assert [r.baseline for r in rows if r.site == site] == [
    "neurons", "density_matched", "top_k", "gates", "rotated"]
  dm = next(r for r in rows if r.baseline == "density_matched"
            and r.site == site).comparison
  assert dm.b["unweighted"].median_purity == 1.0  # only class 0 kept
  totals = [r.baseline for r in rows if r.site == tag_comparison.TOTAL]
  assert "density_matched" in totals and "top_k" in totals


def test_unit_sets_carry_their_context_statistics(harvest, matched):
  site = "layers.0.mlp.up_proj"
  got = tag_comparison.unit_sets(matched, site)
  assert [u.name for u in got] == [
    "components", "neurons", "density_matched", "top_k", "gates", "rotated"]
  # The components that fired: two of three.
  np.testing.assert_array_equal(got[0].context.on, [7, 7])
  assert got[0].context.implied.shape == (2, 3)
  assert got[0].stats.coarse.shape[1] == 2
  older = tag_comparison.unit_sets(harvest, site)
  assert [u.name for u in older] == ["components", "neurons", "gates",
                                     "rotated"]
  assert all(u.context is None for u in older)
