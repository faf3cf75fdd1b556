"""The report's comparison of components with neurons on a tagged harvest
of a text run: what it stores, and the report page that shows it."""

import json
import os

import numpy as np
import pytest

from decompax.analysis import harvesting as harvest_lib
from decompax.analysis import tag_comparison
from decompax.analysis import tag_summary as tag_record
from decompax.render import run_report as report
from decompax.render import tag_report


@pytest.fixture(scope="module")
def text_run(harvested):
  return harvested("text_llama", positions=2 * 8 * 16, batch_size=8,
                   top_k=4, ablation_batches=1)


def test_the_record_holds_every_comparison_and_purity(text_run):
  harvest = harvest_lib.load_harvest(text_run)
  record = tag_record.record(harvest, seed=3, n_boot=50)
  rows = tag_comparison.comparisons(harvest, 3, 50)
  assert [(r["site"], r["baseline"]) for r in record["rows"]] == [
    (r.site, r.baseline) for r in rows]
  assert {"heads", "neurons", "gates", "rotated", "density_matched",
          "top_k"} == {r["baseline"] for r in record["rows"]}
  for stored, row in zip(record["rows"], rows):
    for w in ("weighted", "unweighted"):
      assert stored["components"][w]["median_purity"] == pytest.approx(
        row.comparison.a[w].median_purity)
      assert stored["units"][w]["coverage"] == list(
        row.comparison.b[w].coverage)
      assert stored["difference"][w]["mean_lift"][1] == pytest.approx(
        row.comparison.difference[w]["mean_lift"].low)
  fields = harvest.sites["layers.1.mlp.up_proj"]
  purities = record["purities"]["layers.1.mlp.up_proj"]
  assert len(purities["components"]) == int((fields["fired"] > 0).sum())
  assert len(purities["neurons"]) == 64   # the tiny preset's d_ff
  assert set(record["purities"]["layers.1.self_attn.o_proj"]) == {
    "components", "heads"}
  assert all(1 / 12 - 1e-9 <= p <= 1 for v in purities.values() for p in v)
  assert record["documents"] == 24 and record["n_boot"] == 50
  json.dumps(record, allow_nan=False)   # no NaN reaches the page
  _check_context(harvest, record)


def _check_context(harvest, record):
  """The context measure and robust summaries of a site's components
  against the harvested sums read directly."""
  site = "layers.1.mlp.up_proj"
  assert list(record["context"][site]) == [
    "components", "neurons", "density_matched", "top_k", "gates", "rotated"]
  assert set(record["calibration"][site]) == {"q", "k"}
  fields = harvest.sites[site]
  alive = fields["fired"] > 0
  counts = fields["tag_coarse"][:, alive].sum(axis=0)
  implied = fields["tag_implied"][alive]
  mass = counts.sum(axis=1)
  purity = counts.max(axis=1) / mass
  from_tokens = implied.max(axis=1) / implied.sum(axis=1)
  np.testing.assert_allclose(implied.sum(axis=1), mass, rtol=1e-4)
  row = record["context"][site]["components"]
  assert row["purity"] == pytest.approx((purity * mass).sum() / mass.sum())
  assert row["implied_purity"] == pytest.approx(
    (from_tokens * mass).sum() / mass.sum())
  assert row["excess"] == pytest.approx(row["purity"] - row["implied_purity"])
  assert row["median_excess"] == pytest.approx(
    np.median(purity - from_tokens))
  on = fields["tag_on"][alive]
  apart = on > 0.9 * harvest.manifest["positions"]
  assert row["always_on"] == list(np.flatnonzero(apart))
  assert row["robust"]["median_purity"][0] == pytest.approx(
    np.median(purity[~apart]))
  kept = mass[~apart]
  assert row["robust"]["activity_share_mostly_pure"][0] == pytest.approx(
    kept[purity[~apart] >= 0.5].sum() / kept.sum())


def test_the_report_shows_the_table_and_the_figure(text_run):
  assert tag_record.write(text_run, n_boot=20).endswith(tag_report.FILE)
  page_path = report.write_report(text_run)
  with open(page_path, encoding="utf-8") as f:
    page = f.read()
  assert "Part of speech: components against neurons" in page
  assert "<b>total</b> against neurons" in page
  assert "<b>total</b> against density_matched" in page
  assert "Context: purity against token-implied purity" in page
  assert "Robust summaries" in page
  assert f'src="{tag_report.FIGURE}"' in page
  figure = os.path.join(os.path.dirname(page_path), tag_report.FIGURE)
  with open(figure, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_a_tagged_harvest_gets_no_comparison(tmp_path):
  assert tag_record.write(str(tmp_path)) is None
  assert not np.any([n.startswith("tag_") for n in os.listdir(tmp_path)])


def test_rebuild_report_writes_the_comparison_then_the_page(text_run):
  """The one sequence bin/harvest and bin/report run: the page it writes
  shows the comparison it wrote just before."""
  # Whatever ran before: no comparison on disk until the rebuild writes it.
  stale = os.path.join(text_run, "report", tag_report.FILE)
  if os.path.exists(stale):
    os.remove(stale)
  written = tag_record.rebuild_report(text_run, n_boot=20)
  assert written.comparison.endswith(tag_report.FILE)
  assert os.path.isfile(written.comparison)
  with open(written.page, encoding="utf-8") as f:
    assert "Part of speech: components against neurons" in f.read()


def test_rebuild_report_without_a_tagged_harvest_writes_the_page_alone(
    tmp_path):
  (tmp_path / "flags.txt").write_text("--target=tms\n")
  written = tag_record.rebuild_report(str(tmp_path))
  assert written.comparison is None
  with open(written.page, encoding="utf-8") as f:
    assert "Part of speech" not in f.read()
  with pytest.raises(report.NotARun, match="is not a run directory"):
    tag_record.rebuild_report(str(tmp_path / "nowhere"))
