"""The per-run report: `<run>/report/index.html`, a static page.

The page needs no server and no script: it shows the run's flags, its loss
and eval curves (PNGs rendered into `report/`), the latest eval scalars, every
figure under `<run>/figures/` (a dual-role CI function's hidden-role CI
figures in a section of their own), and, for language-model targets, a
table of each site's most frequently firing components with the contexts
where their CI is highest. Everything it shows is read from the run
directory, so `bin/report` can rebuild it for a finished or a running run.

The component table is stored beside the page as `report/components.json`
(written by the training loop at each slow eval) so the page can be rebuilt
without the model or its tokenizer.
"""

import datetime
import html
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from decompax.io import report_files, run_dir
from decompax.render import figures, tag_report

REPORT_DIR = "report"
INDEX = "index.html"
TABLE_FILE = "components.json"
# Captions of the figures the run writes, in page order; others follow.
FIGURE_CAPTIONS = {
  "ci_on_features.png": "CI on one-hot feature inputs (permuted by each "
                        "site's expected pattern: identity or dense)",
  "components.png": "V and U of the alive components",
  "position_ci.png": "Batch-mean CI per token position",
  "ci_histograms.png": "CI and pre-activation histograms over the eval set",
  "ci_density.png": "Firing density and mean CI per component",
  "ci_log_density.png": "Share of positions per log-spaced CI band",
}
# Captions of a dual-role CI function's hidden-role figures (SPEC §6.6),
# in page order: shown in their own section, after the output role's.
HIDDEN_FIGURE_CAPTIONS = {
  "ci_histograms_hidden.png": "Hidden-role CI and pre-activation histograms "
                              "over the eval set",
  "ci_log_density_hidden.png": "Hidden-role share of positions per "
                               "log-spaced CI band",
}
HIDDEN_SECTION = "Hidden CI role"
# The loop's own loss figure duplicates the report's fresher curve.
_SKIPPED_FIGURES = ("losses.png",)
# Headline columns: mask variants in order, then per-site metrics.
RECON_ORDER = tuple(f"recon/{v}" for v in (
  "ci_masked", "stochastic", "pgd", "rounded", "unmasked", "random",
  "zero"))
SITE_COLUMNS = (
  ("ci_l0", "CI-L0"), ("ci_l0_hidden", "CI-L0 (hidden role)"),
  ("alive", "alive"),
  ("identity_ci_error", "identity CI error"),
  ("dense_ci_error", "dense CI error"),
  ("mmcs", "MMCS"), ("ml2r", "ML2R"),
  ("hidden_acts/ci_masked", "hidden MSE (CI-masked)"),
  ("hidden_acts/stochastic", "hidden MSE (stochastic)"),
)
# CE unrecovered divides by the zero-ablation CE gap. A gap at most this
# share of the clean CE is taken as noise: divided by it, a variant's small
# CE change reads as a large ratio, so the page shows n/a and says why.
CE_NOISE = 0.02
# The report's own curves: (file, metric prefix or prefixes, y label, log
# scale).
CURVES = (
  ("loss_curves.png", "loss/", "training loss", True),
  ("eval_recon.png", "eval/recon/", "eval divergence from clean", True),
  ("eval_ce.png", "eval/ce_diff/", "eval CE − clean CE", False),
  ("ci_l0.png", "eval/ci_l0/", "eval CI-L0", False),
  ("ci_l0_hidden.png", "eval/ci_l0_hidden/", "eval CI-L0 (hidden role)",
   False),
  ("ci_error.png", ("eval/identity_ci_error/", "eval/dense_ci_error/"),
   "eval CI error (identity or dense)", False),
  ("eval_mmcs.png", "eval/mmcs/", "eval MMCS", False),
  ("eval_ml2r.png", "eval/ml2r/", "eval ML2R", False),
  ("eval_nonlinearity.png", "eval/nonlinearity/",
   "eval units per component", False),
)


# A targeted run's eval scalars, by stream (`eval/<stream>/…`).
STREAMS = ("target", "nontarget")
TASK_VARIANTS = ("clean", "ci_masked", "ablated")
# A targeted run's task curves (`eval/task/…`), after its streams' own.
TASK_CURVES = (
  ("task_accuracy.png", "eval/task/answer_accuracy/", "answer accuracy",
   False),
  ("task_answer_ce.png", "eval/task/answer_ce/", "answer CE", False),
  ("task_nontarget_ce.png", "eval/task/nontarget_ce/", "non-target CE",
   False),
)


def curve_specs(keys: set[str]) -> list[tuple[str, Any, str, bool]]:
  """Return the curves to draw from the metric `keys` a run recorded, as
  `CURVES` rows: a targeted run's eval curves once per stream (its keys are
  `eval/<stream>/…`), labelled by it, then its task curves."""
  streams = [s for s in STREAMS
             if any(k.startswith(f"eval/{s}/") for k in keys)]
  specs = []
  for name, prefix, ylabel, log in CURVES:
    prefixes = (prefix,) if isinstance(prefix, str) else prefix
    if not streams or not prefixes[0].startswith("eval/"):
      specs.append((name, prefix, ylabel, log))
      continue
    for stream in streams:
      specs.append((f"{stream}_{name}", tuple(
        f"eval/{stream}/{p[len('eval/'):]}" for p in prefixes),
        f"{stream}: {ylabel}", log))
  if streams:
    specs.extend(TASK_CURVES)
  return [(name, prefix, ylabel, log) for name, prefix, ylabel, log in specs
          if any(k.startswith(prefix) for k in keys)]


class Context(NamedTuple):
  """Where a component fires: decoded tokens around one position."""

  ci: float
  tokens: tuple[str, ...]
  focus: int  # index in `tokens` of the position with this CI


class ComponentRow(NamedTuple):
  """One component of a site: how often it fires and where most."""

  component: int
  frequency: float  # fraction of eval positions with CI above threshold
  mean_ci: float
  contexts: tuple[Context, ...]


ComponentTable = dict[str, list[ComponentRow]]


def component_table(
  tokens: np.ndarray,
  top: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
  density: Mapping[str, np.ndarray],
  mean_ci: Mapping[str, np.ndarray],
  decode: Callable[[int], str],
  n_components: int = 12,
  before: int = 8,
  after: int = 2,
) -> ComponentTable:
  """Return per site its `n_components` most frequently firing components.

  Args:
    tokens: the eval batches' token ids, `[n_batches, B, T]`.
    top: per site `(ci, batch, flat position)` of each component's highest
      CI, each `[C, k]` (`eval_step.top_contexts`), positions flat over `B·T`.
    density, mean_ci: per site `[C]`.
    decode: token id -> its string.
    before, after: tokens of context shown on each side of the position.
  """
  tokens = np.asarray(tokens)
  seq_len = tokens.shape[-1]
  table = {}
  for site, (values, batches, positions) in top.items():
    order = np.argsort(-np.asarray(density[site]), kind="stable")
    rows = []
    for c in order[:n_components]:
      contexts = []
      for ci, b, flat in zip(values[c], batches[c], positions[c]):
        row, t = divmod(int(flat), seq_len)
        start, stop = max(t - before, 0), min(t + after + 1, seq_len)
        words = tuple(decode(int(i)) for i in tokens[b, row, start:stop])
        contexts.append(Context(float(ci), words, t - start))
      rows.append(ComponentRow(int(c), float(density[site][c]),
                               float(mean_ci[site][c]), tuple(contexts)))
    table[site] = rows
  return table


def table_to_json(table: ComponentTable) -> str:
  """Return the table as JSON text (`table_from_json` reads it back)."""
  return json.dumps({
    site: [{"component": r.component, "frequency": r.frequency,
            "mean_ci": r.mean_ci,
            "contexts": [c._asdict() for c in r.contexts]} for r in rows]
    for site, rows in table.items()})


def table_from_json(text: str) -> ComponentTable:
  """Return the table stored by `table_to_json`."""
  raw = json.loads(text)
  return {
    site: [ComponentRow(
      r["component"], r["frequency"], r["mean_ci"],
      tuple(Context(c["ci"], tuple(c["tokens"]), c["focus"])
            for c in r["contexts"])) for r in rows]
    for site, rows in raw.items()}


def write_table(run: run_dir.Path, table: ComponentTable) -> str:
  """Return the path after atomically writing the run's component table."""
  return report_files.save_text(
    os.path.join(os.fspath(run), REPORT_DIR, TABLE_FILE),
    table_to_json(table))


def _esc(value: Any) -> str:
  return html.escape(str(value), quote=True)


def _format(value: Any) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


def _scalar_table(record: Mapping[str, Any], title: str) -> str:
  rows = "".join(
    f"<tr><td>{_esc(k)}</td><td>{_esc(_format(v))}</td></tr>"
    for k, v in sorted(record.items()) if k != "step")
  step = record.get("step", "?")
  return (f"<h3>{_esc(title)} (step {_esc(step)})</h3>"
          f"<table class=scalars>{rows}</table>")


def _cell(record: Mapping[str, Any], key: str) -> str:
  value = record.get(key)
  if value is None:
    return "<td></td>"
  return f"<td>{_esc(_format(value))}</td>"


def zero_gap_is_noise(record: Mapping[str, Any]) -> bool:
  """Return whether zero ablation moves the CE too little to measure the
  other masks against: `CE(zero) − CE(clean)` at most `CE_NOISE` of the
  clean CE (or not positive, where the clean CE is not recorded)."""
  gap = record.get("ce_diff/zero")
  if not isinstance(gap, (int, float)):
    return False
  clean = record.get("ce/clean")
  floor = CE_NOISE * abs(clean) if isinstance(clean, (int, float)) else 0.0
  return gap <= floor


def _unrecovered_cell(record: Mapping[str, Any], key: str) -> str:
  if key in record and zero_gap_is_noise(record):
    return "<td title=\"zero ablation barely moves the CE\">n/a</td>"
  return _cell(record, key)


def _noise_note(record: Mapping[str, Any]) -> str:
  clean = record.get("ce/clean")
  of_clean = (f", under {CE_NOISE:.0%} of the clean CE ({clean:.4g})"
              if isinstance(clean, (int, float)) else "")
  return (f"<p class=note>CE unrecovered is n/a: zero ablation moves the "
          f"CE by {record['ce_diff/zero']:.3g} nats{of_clean}, too little "
          "to divide by.</p>")


def _summary_tables(record: Mapping[str, Any]) -> str:
  """Return the eval headline: the masked-output family, then per site."""
  parts = []
  variants = [k[len("recon/"):] for k in RECON_ORDER if k in record]
  if variants:
    rows = [("divergence from clean", "recon/", _cell)]
    if any(k.startswith("ce_diff/") for k in record):
      rows += [("CE − clean CE", "ce_diff/", _cell),
               ("CE unrecovered (zero = 1)", "ce_unrecovered/",
                _unrecovered_cell)]
    body = "".join(
      f"<tr><th>{_esc(name)}</th>"
      + "".join(cell(record, prefix + v) for v in variants) + "</tr>"
      for name, prefix, cell in rows)
    note = (_noise_note(record) if any(
      k.startswith("ce_unrecovered/") for k in record)
      and zero_gap_is_noise(record) else "")
    parts.append("<div><table class=summary><tr><th>masks</th>" + "".join(
      f"<th>{_esc(v)}</th>" for v in variants) + f"</tr>{body}</table>"
      f"{note}</div>")
  sites = sorted({k.split("/", 1)[1] for k in record
                  if k.startswith("ci_l0/")})
  if sites:
    columns = [(k, name) for k, name in SITE_COLUMNS
               if any(f"{k}/{s}" in record for s in sites)]
    body = "".join(
      f"<tr><th>{_esc(s)}</th>"
      + "".join(_cell(record, f"{k}/{s}") for k, _ in columns) + "</tr>"
      for s in sites)
    parts.append("<table class=summary><tr><th>site</th>" + "".join(
      f"<th>{_esc(name)}</th>" for _, name in columns) + f"</tr>{body}</table>")
  return "<div class=grid>" + "".join(parts) + "</div>"




def _eval_sections(record: Mapping[str, Any], ab_grid_page: bool = True
                   ) -> str:
  """Return the latest eval's headline: one summary, or a targeted run's
  per stream, its task metrics and the link to its A/B grid page."""
  step = _esc(record.get("step"))
  streams = [s for s in STREAMS if any(k.startswith(f"{s}/") for k in record)]
  if not streams:
    return f"<h2>Latest eval (step {step})</h2>{_summary_tables(record)}"
  parts = []
  for stream in streams:
    own = {k[len(stream) + 1:]: v for k, v in record.items()
           if k.startswith(f"{stream}/")}
    parts.append(f"<h2>Latest eval, {stream} stream (step {step})</h2>"
                 f"{_summary_tables(own)}")
  if any(k.startswith("task/") for k in record):
    parts.append(_task_table(record, ab_grid_page))
  return "".join(parts)


def _task_table(record: Mapping[str, Any], ab_grid_page: bool = True
                ) -> str:
  """Return the task metrics: answer accuracy and CE of the clean model,
  under CI masks and with the target-alive components ablated, and the
  non-target CE clean and ablated."""
  rows = [("answer accuracy", "task/answer_accuracy/"),
          ("answer CE", "task/answer_ce/"),
          ("non-target CE", "task/nontarget_ce/")]
  body = "".join(
    f"<tr><th>{_esc(name)}</th>"
    + "".join(_cell(record, prefix + v) for v in TASK_VARIANTS) + "</tr>"
    for name, prefix in rows)
  link = ("<p><a href=\"ab_grid.html\">A/B grid of the target-alive "
          "components</a></p>" if ab_grid_page else "")
  return ("<h2>Task</h2>" + link + "<table class=summary><tr><th></th>"
          + "".join(f"<th>{_esc(v)}</th>" for v in TASK_VARIANTS)
          + f"</tr>{body}</table>")


def _figure(src: str, caption: str) -> str:
  return (f"<figure><a href=\"{_esc(src)}\"><img src=\"{_esc(src)}\" "
          f"alt=\"{_esc(caption)}\"></a><figcaption>{_esc(caption)}"
          "</figcaption></figure>")


# Whitespace a token may hold, drawn visibly (after HTML escaping).
_VISIBLE_WHITESPACE = (
  (" ", "&middot;"), ("\t", "&rarr;"), ("\r", "&#x240D;"), ("\n", "&crarr;"))


def _visible(text: str) -> str:
  for char, sign in _VISIBLE_WHITESPACE:
    text = text.replace(char, sign)
  return text


def _context_html(context: Context) -> str:
  """Return one context as a table row: its CI, the text before the firing
  position (right-aligned), the marked position, and the text after, so
  that the positions of a component's contexts line up down its rows
  (contexts cut at a sequence's start hold fewer tokens before it)."""
  def text(words):
    return "".join(_visible(_esc(w)) for w in words)
  focus = context.focus
  return (f"<tr class=ctx><td class=ci>{context.ci:.2f}</td>"
          f"<td class=before><code>{text(context.tokens[:focus])}</code></td>"
          f"<td class=focus><code><mark>"
          f"{text(context.tokens[focus:focus + 1])}</mark></code></td>"
          f"<td class=after><code>{text(context.tokens[focus + 1:])}"
          "</code></td></tr>")


def _contexts_html(contexts: Sequence[Context]) -> str:
  if not contexts:
    return ""
  return ("<table class=contexts>"
          + "".join(_context_html(c) for c in contexts) + "</table>")


def _component_section(table: ComponentTable) -> str:
  parts = ["<h2>Top components per site</h2>",
           "<p>Components sorted by firing frequency on the eval set; each "
           "context ends a few tokens after the position (highlighted) where "
           "the component's CI is highest.</p>"]
  for site, rows in table.items():
    body = "".join(
      f"<tr><td>{r.component}</td><td>{r.frequency:.3g}</td>"
      f"<td>{r.mean_ci:.3g}</td>"
      f"<td>{_contexts_html(r.contexts)}</td></tr>"
      for r in rows)
    parts.append(
      f"<h3>{_esc(site)}</h3><table class=components><tr><th>component</th>"
      "<th>firing freq.</th><th>mean CI</th><th>top contexts</th></tr>"
      f"{body}</table>")
  return "".join(parts)


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; max-width: 1400px; }
h1 { font-size: 1.4em; } h2 { border-bottom: 1px solid #ccc; }
.grid { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
figure { margin: 0; } figure img { max-width: 640px; border: 1px solid #ddd; }
figcaption { font-size: 0.85em; color: #444; }
table { border-collapse: collapse; font-size: 0.85em; }
td, th { border: 1px solid #ddd; padding: 2px 6px; vertical-align: top; }
.scalars td:first-child { font-family: monospace; }
.ctx code { white-space: pre; } mark { background: #fd8; }
.contexts td { border: none; padding: 0; }
.contexts td.before { text-align: right; }
.contexts td.ci { color: #666; font-size: 0.85em; padding-right: 0.5em; }
.summary th { background: #f0f0f0; text-align: left; }
.summary { margin: 0 1em 1em 0; }
pre { background: #f6f6f6; padding: 0.6em; font-size: 0.8em; }
"""


def render_html(
  title: str,
  flags_text: str,
  latest: Sequence[tuple[str, Mapping[str, Any]]],
  curves: Sequence[tuple[str, str]],
  figure_list: Sequence[tuple[str, str]],
  table: ComponentTable | None,
  generated: str,
  hidden_figures: Sequence[tuple[str, str]] = (),
  ab_grid_page: bool = True,
  tag_section: str = "",
) -> str:
  """Return the page: `latest` as `(title, record)` scalar tables, `curves`,
  `figure_list` and a dual-role CI function's `hidden_figures` as
  `(relative src, caption)`, the optional LM table; `ab_grid_page`: a
  targeted run's A/B grid page is there to link to; `tag_section` the
  part-of-speech comparison's HTML (`render/tag_report`), if any."""
  sections = [f"<h1>{_esc(title)}</h1><p>Generated {_esc(generated)}.</p>"]
  if latest:
    name, record = latest[0]
    if name == "Eval":
      sections.append(_eval_sections(record, ab_grid_page))
    sections.append(
      "<details><summary>Every latest scalar</summary><div class=grid>"
      + "".join(_scalar_table(r, n) for n, r in latest) + "</div></details>")
  if curves:
    sections.append("<h2>Curves</h2><div class=grid>" + "".join(
      _figure(src, caption) for src, caption in curves) + "</div>")
  if figure_list:
    sections.append("<h2>Figures</h2><div class=grid>" + "".join(
      _figure(src, caption) for src, caption in figure_list) + "</div>")
  if hidden_figures:
    sections.append(
      f"<h2>{_esc(HIDDEN_SECTION)}</h2><p>The CI distributions of the "
      "dual-role CI function's hidden role, which masks the hidden-activation "
      "passes, over the same eval set; the figures above are the output "
      "role's.</p><div class=grid>" + "".join(
        _figure(src, caption) for src, caption in hidden_figures) + "</div>")
  if table:
    sections.append(_component_section(table))
  if tag_section:
    sections.append(tag_section)
  sections.append(f"<h2>Flags</h2><pre>{_esc(flags_text)}</pre>")
  return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
          f"<title>{_esc(title)}</title><link rel=\"icon\" href=\"data:,\">"
          f"<style>{_STYLE}{tag_report.STYLE}</style></head>"
          f"<body>{''.join(sections)}</body></html>\n")


def _latest(records: Sequence[Mapping[str, Any]]) -> list[tuple[str, dict]]:
  train = [r for r in records if any(k.startswith("loss/") for k in r)]
  evals = [r for r in records if any(k.startswith("eval/") for k in r)]
  out = []
  if evals:
    record = {k[len("eval/"):]: v for k, v in evals[-1].items()
              if k.startswith("eval/")}
    out.append(("Eval", {**record, "step": evals[-1]["step"]}))
  if train:
    out.append(("Training", {k: v for k, v in train[-1].items()
                             if not k.startswith("eval/")}))
  return out


def _figure_files(run: str) -> tuple[list[tuple[str, str]],
                                      list[tuple[str, str]]]:
  """Return the run's figures as `(src, caption)`: the output role's (and
  any uncaptioned ones), then the hidden role's."""
  directory = os.path.join(run, "figures")
  if not os.path.isdir(directory):
    return [], []
  names = sorted(n for n in os.listdir(directory)
                 if n.endswith(".png") and n not in _SKIPPED_FIGURES)
  ordered = [n for n in FIGURE_CAPTIONS if n in names]
  ordered += [n for n in names
              if n not in FIGURE_CAPTIONS and n not in HIDDEN_FIGURE_CAPTIONS]
  hidden = [n for n in HIDDEN_FIGURE_CAPTIONS if n in names]
  return ([(f"../figures/{n}", FIGURE_CAPTIONS.get(n, n[:-4]))
           for n in ordered],
          [(f"../figures/{n}", HIDDEN_FIGURE_CAPTIONS[n]) for n in hidden])


class NotARun(ValueError):
  """The directory asked for holds no run (no flags file)."""


def write_report(run: run_dir.Path) -> str:
  """Return the path of `<run>/report/index.html` after (re)writing it and
  its curve PNGs from the run directory's files."""
  run = os.path.abspath(os.fspath(run))
  flags_path = os.path.join(run, run_dir.FLAGS_FILE)
  if not os.path.isfile(flags_path):
    raise NotARun(f"{run} is not a run directory (no "
                  f"{run_dir.FLAGS_FILE})")
  with open(flags_path, encoding="utf-8") as f:
    flags_text = f.read()
  records = run_dir.read_metrics(os.path.join(run, run_dir.METRICS_FILE))
  directory = report_files.make_dirs(os.path.join(run, REPORT_DIR))
  curves = []
  for name, prefix, ylabel, log in curve_specs(
      {k for r in records for k in r}):
    figures.plot_metric_curves(records, prefix, os.path.join(directory, name),
                               ylabel, log)
    curves.append((name, ylabel))
  table = None
  table_path = os.path.join(directory, TABLE_FILE)
  if os.path.isfile(table_path):
    with open(table_path, encoding="utf-8") as f:
      table = table_from_json(f.read())
  generated = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
  target = [line.split("=", 1)[1] for line in flags_text.splitlines()
            if line.startswith("--target=")]
  title = f"decompax run {os.path.basename(run)}"
  if target:
    title += f" ({target[0]})"
  figure_list, hidden_figures = _figure_files(run)
  tags = tag_report.read(directory)
  page = render_html(title, flags_text,
                     _latest(records), curves, figure_list, table,
                     generated, hidden_figures,
                     os.path.isfile(os.path.join(directory, "ab_grid.html")),
                     "" if tags is None else tag_report.section_html(
                       tags, tag_report.FIGURE if os.path.isfile(
                         os.path.join(directory, tag_report.FIGURE))
                       else None))
  return report_files.save_text(os.path.join(directory, INDEX), page)
