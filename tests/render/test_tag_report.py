"""The report's part-of-speech section: verdicts from intervals, the stored
comparison read back, the table and the purity figure on the page."""

import os

from decompax.render import tag_report

PNG = b"\x89PNG\r\n\x1a\n"


def _summary(units, median, lift):
  return {"units": units, "median_purity": median, "share_pure": 0.0,
          "share_mostly_pure": 0.5, "mean_lift": lift,
          "coverage": [1, 2] + [0] * 10}


def _record():
  """Components purer than neurons by median purity, less lifted, and
  tied on the shares."""
  def difference(median, lift):
    return {"median_purity": median, "share_pure": [0.0, -0.1, 0.1],
            "share_mostly_pure": [0.0, None, None], "mean_lift": lift}
  row = {"site": "layers.1.mlp.up_proj", "baseline": "neurons",
         "components": {w: _summary(5, 0.7, 1.5)
                        for w in ("weighted", "unweighted")},
         "units": {w: _summary(64, 0.4, 2.5)
                   for w in ("weighted", "unweighted")},
         "difference": {w: difference([0.3, 0.1, 0.5], [-1.0, -1.5, -0.2])
                        for w in ("weighted", "unweighted")}}
  classes = ["noun", "verb", "adjective", "adverb", "pronoun", "determiner",
             "preposition", "conjunction", "number", "punctuation", "other",
             "boundary"]
  return {"classes": classes, "n_boot": 200, "documents": 24, "groups": 24,
          "positions": 256, "rows": [row],
          "purities": {"layers.1.mlp.up_proj": {
            "components": [0.9, 0.7, 0.3], "neurons": [0.2, 0.4, 0.5],
            "rotated": [0.2, 0.25]}}}


def test_a_verdict_needs_the_interval_off_zero():
  assert tag_report.verdict([0.3, 0.1, 0.5]) == "higher"
  assert tag_report.verdict([-0.3, -0.5, -0.1]) == "lower"
  assert tag_report.verdict([0.3, -0.1, 0.5]) == "unclear"
  assert tag_report.verdict([None, None, None]) == "unclear"


def test_the_section_states_each_sites_verdict_and_coverage(tmp_path):
  record = _record()
  assert tag_report.read(str(tmp_path)) is None
  tag_report.write(str(tmp_path), record)
  assert tag_report.read(str(tmp_path)) == record
  page = tag_report.section_html(record, tag_report.FIGURE)
  assert ("<b>layers.1.mlp.up_proj</b> against neurons: components higher "
          "by median purity; neurons higher by mean lift") in page
  # Weighted and unweighted rows; each difference with its interval.
  assert page.count("<td>weighted</td>") == 1
  assert page.count("<td>unweighted</td>") == 1
  assert "<td class='higher'>0.3 [0.1, 0.5]</td>" in page
  assert "<td class='unclear'>0 [n/a, n/a]</td>" in page
  assert "<td>1 · 1</td><td>2 · 2</td>" in page   # coverage per class
  assert f'src="{tag_report.FIGURE}"' in page
  assert "200 bootstrap resamples of the documents" in page
  assert "<img" not in tag_report.section_html(record, None)


def test_the_purity_figure_is_a_png(tmp_path):
  path = tag_report.plot_purities(_record(), str(tmp_path / "tag_purity.png"))
  with open(path, "rb") as f:
    assert f.read(8) == PNG
  assert os.path.getsize(path) > 1000


def _context_row(excess):
  interval = [0.5, 0.4, 0.6]
  return {"units": 3, "purity": 0.6, "implied_purity": 0.6 - excess,
          "excess": excess, "median_excess": excess,
          "robust": {name: interval for name, _ in tag_report.ROBUST},
          "robust_units": 2, "always_on": [4], "always_on_share": 0.7}


def test_the_context_and_robust_tables_show_each_unit_set():
  record = {**_record(), "calibration": {
    "layers.1.mlp.up_proj": {"q": 0.125, "k": 3}}, "context": {
      "layers.1.mlp.up_proj": {"components": _context_row(0.25),
                               "density_matched": _context_row(0.0)}}}
  page = tag_report.section_html(record, None)
  assert "Context: purity against token-implied purity" in page
  assert ("<td>layers.1.mlp.up_proj</td><td>components</td><td>3</td>"
          "<td>0.6</td><td>0.35</td><td>0.25</td><td>0.25</td>"
          "<td>q 0.125, k 3</td>") in page
  assert "<td>density_matched</td>" in page
  # The always-on unit apart, its share of the activity beside it.
  assert "<td>2</td><td>1 (0.7)</td>" + "<td>0.5 [0.4, 0.6]</td>" * 3 in page
  assert "Robust summaries" not in tag_report.section_html(_record(), None)
