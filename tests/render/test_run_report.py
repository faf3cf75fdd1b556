"""The static run report and its LM component table."""

import json
import os
import re

import numpy as np
import pytest

from decompax.io import run_dir
from decompax.render import figures
from decompax.render import run_report as report

PNG = b"\x89PNG\r\n\x1a\n"


def referenced_files(page_path):
  """Return the files an HTML page links or embeds, resolved to paths."""
  with open(page_path, encoding="utf-8") as f:
    page = f.read()
  refs = [r for r in re.findall(r'(?:src|href)="([^"]+)"', page)
          if not r.startswith("data:")]
  base = os.path.dirname(page_path)
  return [os.path.normpath(os.path.join(base, r)) for r in refs]


def _synthetic_table():
  context = report.Context(0.93, ("the", " <cat>", " sat"), 1)
  return {
    "layers.0.mlp.up_proj": [
      report.ComponentRow(7, 0.25, 0.2, (context,)),
      report.ComponentRow(2, 0.01, 0.005, ()),
    ],
    "layers.0.mlp.down_proj": [report.ComponentRow(0, 0.5, 0.4, (context,))],
  }


def test_component_table_round_trips_through_json():
  table = _synthetic_table()
  assert report.table_from_json(report.table_to_json(table)) == table


def test_component_table_from_tokens_picks_frequent_components_and_windows():
  tokens = np.arange(2 * 3 * 6).reshape(2, 3, 6)  # [n_batches, B, T]
  density = {"s": np.array([0.1, 0.5, 0.0])}
  mean_ci = {"s": np.array([0.05, 0.3, 0.0])}
  # Component 1 fires most at batch 1, row 2, position 4 (flat 2·6 + 4).
  top = {"s": (np.array([[0.5], [0.9], [0.0]]), np.array([[0], [1], [0]]),
               np.array([[0], [16], [0]]))}
  table = report.component_table(tokens, top, density, mean_ci,
                                 lambda i: f"<{i}>", n_components=2,
                                 before=2, after=1)
  rows = table["s"]
  assert [r.component for r in rows] == [1, 0]
  assert rows[0].frequency == 0.5 and rows[0].mean_ci == 0.3
  ctx = rows[0].contexts[0]
  assert ctx.tokens == ("<32>", "<33>", "<34>", "<35>") and ctx.focus == 2
  # At a sequence start the window is cut, and the focus moves with it.
  assert rows[1].contexts[0].tokens == ("<0>", "<1>")
  assert rows[1].contexts[0].focus == 0


def test_render_escapes_tokens_and_marks_the_firing_position():
  page = report.render_html("run <x>", "--target=t\n", [], [], [],
                            _synthetic_table(), "now")
  assert "<mark>&middot;&lt;cat&gt;</mark>" in page
  assert "run &lt;x&gt;" in page and "<x>" not in page
  assert page.count("<tr><td>7</td>") == 1
  assert "<script" not in page


@pytest.fixture
def synthetic_run(tmp_path):
  """A run directory as a finished toy run leaves it, plus an LM table."""
  run = tmp_path / "run"
  run.mkdir()
  (run / run_dir.FLAGS_FILE).write_text("--target=tms_5-2\n--c=4\n")
  metrics = run / run_dir.METRICS_FILE
  run_dir.append_metrics(metrics, {"step": 0, "eval/recon/zero": 0.5,
                                   "eval/recon/ci_masked": 0.1,
                                   "eval/ci_l0/a": 2.0})
  for step in (10, 20):
    run_dir.append_metrics(metrics, {
      "step": step, "loss/faithfulness": 1.0 / step, "ci_l0/a": 1.5,
      "eval/recon/zero": 0.5, "eval/recon/ci_masked": 0.1 / step,
      "eval/ci_l0/a": 1.0, "eval/ce_diff/zero": 2.0})
  rng = np.random.default_rng(0)
  figures.plot_ci_on_features({"a": rng.uniform(size=(3, 4))},
                              run / "figures" / "ci_on_features.png", "CI")
  figures.plot_component_density(
    {"a": rng.uniform(size=4)}, {"a": rng.uniform(size=4)},
    run / "figures" / "ci_density.png", 0.1)
  figures.plot_loss_curves([], run / "figures" / "losses.png")
  report.write_table(run, _synthetic_table())
  return run


def test_report_references_only_existing_pngs(synthetic_run):
  page = report.write_report(synthetic_run)
  assert page == str(synthetic_run / "report" / "index.html")
  refs = referenced_files(page)
  assert refs, "the page shows no figure"
  for ref in refs:
    with open(ref, "rb") as f:
      assert f.read(8) == PNG, ref
  shown = {os.path.basename(r) for r in refs}
  assert {"ci_on_features.png", "ci_density.png", "loss_curves.png",
          "eval_recon.png", "eval_ce.png", "ci_l0.png"} <= shown
  assert "losses.png" not in shown  # the report draws its own loss curve
  text = (synthetic_run / "report" / "index.html").read_text()
  assert "layers.0.mlp.up_proj" in text and "--c=4" in text
  assert "(tms_5-2)" in text
  assert report.HIDDEN_SECTION not in text  # one CI role


def test_hidden_role_figures_get_their_own_labelled_section(synthetic_run):
  """A dual-role run's hidden-role CI figures follow the output role's
  under their own heading, each captioned as the hidden role's."""
  figures_dir = synthetic_run / "figures"
  for name in ("ci_histograms", "ci_histograms_hidden",
               "ci_log_density_hidden"):
    (figures_dir / f"{name}.png").write_bytes(PNG)
  page = report.write_report(synthetic_run)
  text = open(page, encoding="utf-8").read()
  head, hidden = text.split(f"<h2>{report.HIDDEN_SECTION}</h2>")
  assert "../figures/ci_histograms.png" in head and "_hidden" not in head
  shown = re.findall(r'<img src="([^"]+)"', hidden.split("<h2>")[0])
  assert shown == ["../figures/ci_histograms_hidden.png",
                   "../figures/ci_log_density_hidden.png"]
  for caption in report.HIDDEN_FIGURE_CAPTIONS.values():
    assert caption.startswith("Hidden-role")
    assert f"<figcaption>{caption}</figcaption>" in hidden


def test_report_of_a_directory_without_flags_is_refused(tmp_path):
  with pytest.raises(ValueError, match="not a run directory"):
    report.write_report(tmp_path)
  assert not (tmp_path / "report").exists()


def test_report_of_a_run_without_records_still_renders(tmp_path):
  (tmp_path / run_dir.FLAGS_FILE).write_text("--target=x\n")
  page = report.write_report(tmp_path)
  assert referenced_files(page) == []
  assert "--target=x" in open(page, encoding="utf-8").read()
  json.dumps(os.listdir(tmp_path / "report"))


def test_report_shows_pattern_errors_and_the_feature_match(tmp_path):
  """Per-site CI errors under the site's pattern, MMCS and ML2R in the
  headline table, each with its curve; locality stats as a curve."""
  (tmp_path / run_dir.FLAGS_FILE).write_text("--target=tms_5-2-id\n")
  metrics = tmp_path / run_dir.METRICS_FILE
  for step in (0, 10):
    run_dir.append_metrics(metrics, {
      "step": step, "eval/recon/ci_masked": 0.1, "eval/ci_l0/linear1": 1.0,
      "eval/ci_l0/hidden_layers.0": 2.0,
      "eval/identity_ci_error/linear1": 1.0,
      "eval/dense_ci_error/hidden_layers.0": 0.0,
      "eval/mmcs/linear1": 0.99, "eval/ml2r/linear1": 0.98,
      "eval/nonlinearity/soft_count/neuron": 0.6})
  page = report.write_report(tmp_path)
  text = open(page, encoding="utf-8").read()
  headline = text.split("<details>")[0]
  for header in ("identity CI error", "dense CI error", "MMCS", "ML2R"):
    assert f"<th>{header}</th>" in headline
  assert "<td>0.99</td><td>0.98</td>" in headline
  shown = {os.path.basename(r) for r in referenced_files(page)}
  assert {"ci_error.png", "eval_mmcs.png", "eval_ml2r.png",
          "eval_nonlinearity.png"} <= shown


def test_the_site_table_shows_the_hidden_roles_ci_l0_when_present():
  def headline(record):
    page = report.render_html("run", "", [("Eval", {"step": 3, **record})],
                              (), (), None, "now")
    return page.split("<details>")[0]

  one_role = {"recon/ci_masked": 0.1, "ci_l0/a": 1.5, "alive/a": 4.0}
  assert "hidden role" not in headline(one_role)
  dual = headline({**one_role, "ci_l0_hidden/a": 2.5})
  assert "<th>CI-L0</th><th>CI-L0 (hidden role)</th>" in dual
  assert "<td>1.5</td><td>2.5</td><td>4</td>" in dual


def test_the_task_table_links_the_ab_grid_only_where_the_page_is():
  record = {"step": 3, "target/recon/ci_masked": 0.1,
            "task/answer_accuracy/clean": 1.0}

  def page(linked):
    return report.render_html("run", "", [("Eval", record)], (), (), None,
                              "now", ab_grid_page=linked)

  assert 'href="ab_grid.html"' in page(True)
  assert "<h2>Task</h2>" in page(False)
  assert "ab_grid.html" not in page(False)


def test_a_components_contexts_line_up_at_the_firing_position():
  """Contexts cut at a sequence's start (the arithmetic toy's five-token
  prompts) hold fewer tokens before the position: each is a row whose
  text before the position is its own right-aligned cell, so the marked
  positions share a column."""
  contexts = (report.Context(0.9, ("a", "+", "b", "="), 3),
              report.Context(0.8, ("12", "=", "7"), 1))
  page = report.render_html(
    "run", "", [], [], [],
    {"s": [report.ComponentRow(0, 0.5, 0.4, contexts)]}, "now")
  rows = re.findall(r"<tr class=ctx>(.*?)</tr>", page)
  cells = [re.findall(r"<td class=(\w+)>(.*?)</td>", row) for row in rows]
  assert [[name for name, _ in row] for row in cells] == [
    ["ci", "before", "focus", "after"]] * 2
  assert [row[1][1] for row in cells] == ["<code>a+b</code>", "<code>12</code>"]
  assert [row[2][1] for row in cells] == ["<code><mark>=</mark></code>"] * 2
  assert ".contexts td.before { text-align: right; }" in page


def _ce_record(zero_gap, clean=2.0):
  return {"step": 3, "recon/ci_masked": 0.1, "recon/zero": 0.9,
          "ce/clean": clean, "ce_diff/ci_masked": 0.78,
          "ce_diff/zero": zero_gap,
          # As evals.eval_metrics divides: by 1 where the gap is exactly 0.
          "ce_unrecovered/ci_masked": 0.78 / (zero_gap or 1.0),
          "ce_unrecovered/zero": 1.0}


def _headline(record):
  return report.render_html("run", "", [("Eval", record)], (), (), None,
                            "now").split("<details>")[0]


@pytest.mark.parametrize("zero_gap, shown", [
  (-0.015, False), (0.0, False), (0.039, False), (0.041, True), (3.0, True)])
def test_ce_unrecovered_is_na_when_zero_ablation_barely_moves_the_ce(
    zero_gap, shown):
  """Divided by a zero-ablation gap within 2% of the clean CE (2.0), a
  small CE change reads as a large ratio (52 at a gap of −0.015): the
  table says n/a and why instead."""
  assert report.zero_gap_is_noise(_ce_record(zero_gap)) is not shown
  page = _headline(_ce_record(zero_gap))
  row = re.search(r"<th>CE unrecovered \(zero = 1\)</th>(.*?)</tr>",
                  page).group(1)
  ratio = report._format(0.78 / (zero_gap or 1.0))
  if shown:
    assert f"<td>{ratio}</td><td>1</td>" in row and "n/a" not in page
  else:
    assert row.count(">n/a</td>") == 2 and ratio not in row
    assert "CE unrecovered is n/a: zero ablation moves the CE by" in page
    assert "under 2% of the clean CE (2)" in page
  # The CE differences themselves are always shown.
  assert f"<td>{report._format(zero_gap)}</td>" in page


def _targeted_run(tmp_path):
  (tmp_path / run_dir.FLAGS_FILE).write_text("--target=induction\n")
  metrics = tmp_path / run_dir.METRICS_FILE
  for step in (0, 10):
    record = {"step": step, "loss/faithfulness": 1.0 / (step + 1)}
    for stream in ("target", "nontarget"):
      record.update({f"eval/{stream}/recon/ci_masked": 0.1,
                     f"eval/{stream}/ce_diff/ci_masked": 0.2,
                     f"eval/{stream}/ci_l0/s": 1.0})
    record.update({"eval/task/answer_accuracy/clean": 1.0,
                   "eval/task/answer_ce/ablated": 2.0,
                   "eval/task/nontarget_ce/clean": 1.5})
    run_dir.append_metrics(metrics, record)
  return tmp_path


def test_a_targeted_runs_curves_show_each_stream_and_the_task(tmp_path):
  page = report.write_report(_targeted_run(tmp_path))
  shown = list(dict.fromkeys(
    os.path.basename(r) for r in referenced_files(page)))
  assert shown == [
    "loss_curves.png", "target_eval_recon.png", "nontarget_eval_recon.png",
    "target_eval_ce.png", "nontarget_eval_ce.png", "target_ci_l0.png",
    "nontarget_ci_l0.png", "task_accuracy.png", "task_answer_ce.png",
    "task_nontarget_ce.png"]
  for ref in referenced_files(page):
    with open(ref, "rb") as f:
      assert f.read(8) == PNG, ref
  text = open(page, encoding="utf-8").read()
  assert "<figcaption>nontarget: eval CE − clean CE</figcaption>" in text


def test_an_untargeted_runs_curves_keep_their_names():
  keys = {"loss/faithfulness", "eval/recon/zero", "eval/ci_l0/a",
          "eval/identity_ci_error/a"}
  assert [name for name, *_ in report.curve_specs(keys)] == [
    "loss_curves.png", "eval_recon.png", "ci_l0.png", "ci_error.png"]


def test_the_pages_ask_for_no_favicon(synthetic_run):
  """A page without an icon of its own makes the browser request
  /favicon.ico, missing wherever the report is served."""
  page = open(report.write_report(synthetic_run), encoding="utf-8").read()
  assert '<link rel="icon" href="data:,">' in page.split("</head>")[0]


# The page of the docs that explains the report and shows its screenshot.
EVALUATION_DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs",
                              "evaluation.md")


def test_the_documented_screenshot_command_runs_as_written(synthetic_run,
                                                           tmp_path):
  """docs/evaluation.md's Chromium command makes the report's screenshot,
  also as root (where Chromium needs --no-sandbox)."""
  import shlex  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  with open(EVALUATION_DOC, encoding="utf-8") as f:
    command = re.search(r"`(chromium --headless[^`]*)`", f.read()).group(1)
  page = report.write_report(synthetic_run)
  shot = tmp_path / "shot.png"
  argv = [{"docs/report.png": str(shot)}.get(a, a) for a in shlex.split(
    command.replace("--screenshot=docs/report.png",
                    f"--screenshot={shot}").replace(
      "<run>/report/index.html", page))]
  assert argv[0] == "chromium" and page in argv
  import time  # noqa: PLC0415
  start = time.monotonic()
  done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
  # Without a session bus Chromium logs every D-Bus call it cannot make.
  said = "\n".join(line for line in (done.stdout + done.stderr).splitlines()
                   if "dbus" not in line)
  assert done.returncode == 0 and shot.is_file(), (
    f"exit {done.returncode} after {time.monotonic() - start:.0f} s, "
    f"screenshot {'written' if shot.is_file() else 'missing'}; Chromium "
    f"said:\n{said[-2000:]}")
  assert shot.read_bytes()[:8] == PNG
