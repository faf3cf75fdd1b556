"""recipe/evaluation: eval cadence, an LM-shaped eval, its lines and
renders."""

import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, optim, sites as sites_lib, train_step
from decompax.core import step_records
from decompax.core.schedules import Schedule
from decompax.core.target import Expected
from decompax.evals import eval_step
from decompax.io import run_dir
from decompax.losses import loss_terms as terms
from decompax.losses import recon
from decompax.measures import ci_counts
from decompax.recipe import evaluation
from decompax.recipe.config import TrainConfig
from decompax.render import run_report as report
from decompax.targets import tms

PNG = b"\x89PNG\r\n\x1a\n"


def _cadence(**overrides):
  values = dict(eval_every=2, slow_eval_every=4, slow_on_first_step=True,
                num_steps=10)
  return types.SimpleNamespace(**{**values, **overrides})


@pytest.mark.parametrize("slow_on_first_step", [True, False])
def test_tiers_nest_and_the_slow_baseline_needs_its_flag(slow_on_first_step):
  # I44: the slow tier at step 0 only with slow_on_first_step (the caller
  # asks for step 0 on fresh runs only); cadences nest.
  config = _cadence(slow_on_first_step=slow_on_first_step)
  tiers = {done: evaluation.due(config, done) for done in range(11)}
  assert [d for d, (fast, _) in tiers.items() if fast] == [0, 2, 4, 6, 8, 10]
  slow = [d for d, (_, s) in tiers.items() if s]
  assert slow == ([0] if slow_on_first_step else []) + [4, 8, 10]
  assert all(fast for fast, s in tiers.values() if s)


def test_last_step_evaluates_off_cadence_and_zero_disables():
  assert evaluation.due(_cadence(num_steps=7), 7) == (True, True)
  assert evaluation.due(_cadence(slow_eval_every=0), 4) == (True, False)
  assert evaluation.due(_cadence(slow_eval_every=0), 0) == (True, False)
  off = _cadence(eval_every=0, slow_eval_every=0)
  assert not any(any(evaluation.due(off, d)) for d in range(11))


def test_uv_columns_picks_the_ordered_columns_with_one_compiled_gather():
  sites = (sites_lib.SiteSpec("a", "a", 0, 3, 2, 5),
           sites_lib.SiteSpec("b", "b", 0, 2, 4, 70))
  components = sites_lib.init_components(jax.random.key(0), sites)
  before = evaluation._gather_columns._cache_size()
  for order in ({"a": [4, 0], "b": [69, 3, 1]},
                {"a": [2], "b": list(range(70))}):
    picked = evaluation.uv_columns(components, sites, order)
    for site in sites:
      v, u = (np.asarray(f) for f in sites_lib.site_factors(components, site))
      want = order[site.name][:evaluation.MAX_UV_COLUMNS]
      got_v, got_u = picked[site.name]
      np.testing.assert_array_equal(got_v, v[:, want])
      np.testing.assert_array_equal(got_u, u[want])
  assert evaluation._gather_columns._cache_size() == before + 1


def test_lm_eval_writes_component_table_figures_and_report(
    token_target, tmp_path, capsys):
  target, weights = token_target
  ci_fn = ci_fns.make_ci_fn(ci_fns.CIConfig("vector_mlp", (4,)), target.sites)
  loss_terms = (
    terms.faithfulness_term(1.0),
    terms.stochastic_recon_term("stochastic_recon", 1.0,
                                recon.all_sites_plan(target.sites), False))
  adam = optim.AdamWConfig(Schedule(1e-3))
  built = train_step.make_train_step(target, ci_fn, loss_terms,
                                     step_records.StepConfig(4, adam, adam))
  state = built.init(sites_lib.init_components(jax.random.key(1),
                                               target.sites),
                     ci_fn.init(jax.random.key(2)), jax.random.key(3), (3, 5))
  config = TrainConfig(
    eval_every=2, slow_eval_every=2, slow_on_first_step=True, num_steps=4,
    eval_batches=2, ci_alive_threshold=0.1, use_delta_component=False,
    n_mask_samples=1, seed=0, eval_pgd_steps=3, eval_pgd_lr=0.1,
    figure_cpu_share=1.0, eval_attention_kl=False)
  (tmp_path / run_dir.FLAGS_FILE).write_text("--target=tiny_lm\n")
  metrics = str(tmp_path / run_dir.METRICS_FILE)
  vocab = ["<bos>", " the", " cat", " sat", " on", "<&>"]
  evaluator = evaluation.make_evaluator(
    config, target, ci_fn, loss_terms,
    lambda key: jax.random.randint(key, (3, 5), 0, 6), weights,
    str(tmp_path), decode=vocab.__getitem__, renderer=evaluation.Renderer(
      lambda job: job(), lambda: None, lambda: None), say=print)
  evaluation.log_baseline(evaluator, state, metrics)
  assert evaluator.evaluate(state, 1) == {}
  # A stop signal pending during a due pass abandons it (SPEC §12).
  assert evaluator.evaluate(state, 2, lambda: True) == {}
  polls = iter((False, True))
  assert evaluator.evaluate(state, 2, lambda: next(polls)) == {}
  evaluator.close()
  evaluation.write_final_report(str(tmp_path))
  (record,) = run_dir.read_metrics(metrics)
  assert record["step"] == 0
  for key in ("eval/ce/clean", "eval/ce_diff/ci_masked",
              "eval/ce_unrecovered/zero", "eval/recon/stochastic",
              "eval/hidden_acts/ci_masked/mix", "eval/loss/faithfulness",
              "eval/recon/pgd"):
    assert key in record
  assert record["eval/recon/pgd"] > 0  # untrained factors: VU ≠ W
  assert re.search(r"\[eval\] step 0 .* pgd \d", capsys.readouterr().out)
  assert (tmp_path / "report" / "components.json").is_file()
  assert (tmp_path / "figures" / "position_ci.png").read_bytes()[:8] == PNG
  page = (tmp_path / "report" / "index.html").read_text()
  assert "Top components per site" in page and "&middot;" in page
  # One CI role: no hidden-role figures, no hidden-role section.
  assert not (tmp_path / "figures" / "ci_histograms_hidden.png").exists()
  assert report.HIDDEN_SECTION not in page
  # A data: URL (the page's empty favicon) names no file.
  refs = re.findall(r'(?:src|href)="(?!data:)([^"]+)"', page)
  assert refs
  for ref in refs:
    path = os.path.normpath(os.path.join(tmp_path, "report", ref))
    with open(path, "rb") as f:
      assert f.read(8) == PNG, ref


def _slow_summary(rng, roles):
  """Return a hand-made slow-tier summary of one site with `C = 3` for
  `roles`' CI distributions."""
  arrays = {"density": {"a": rng.uniform(size=3)}}
  for suffix in (eval_step.ROLE_SUFFIXES[r] for r in roles):
    arrays.update({
      f"mean_ci{suffix}": {"a": rng.uniform(size=3)},
      f"hist_lower{suffix}": {"a": rng.integers(0, 9, len(
        ci_counts.LOWER_EDGES) + 1)},
      f"hist_pre{suffix}": {"a": rng.integers(0, 9, len(
        ci_counts.PRE_EDGES) + 1)},
      f"log_density{suffix}": {"a": rng.integers(
        0, 9, (3, ci_counts.LOG_DENSITY_BINS + 1))}})
  return eval_step.EvalSummary({}, arrays, {})


def test_the_slow_render_shows_the_hidden_roles_ci_in_its_own_section(
    tmp_path):
  (tmp_path / run_dir.FLAGS_FILE).write_text("--target=t\n")
  rng = np.random.default_rng(0)
  uv = {"a": (rng.normal(size=(4, 3)), rng.normal(size=(3, 4)))}
  evaluation.render_slow(str(tmp_path), _slow_summary(rng, ci_fns.ROLES),
                         uv, {"a": [0, 1, 2]}, None, 0.1)
  names = {"ci_histograms", "ci_log_density"}
  for name in names:
    for suffix in ("", "_hidden"):
      path = tmp_path / "figures" / f"{name}{suffix}.png"
      assert path.read_bytes()[:8] == PNG, path
  page = (tmp_path / "report" / "index.html").read_text()
  head, hidden = page.split(f"<h2>{report.HIDDEN_SECTION}</h2>")
  for name in names:
    assert f"../figures/{name}.png" in head
    assert f"../figures/{name}_hidden.png" not in head
    assert f"../figures/{name}_hidden.png" in hidden
  for caption in report.HIDDEN_FIGURE_CAPTIONS.values():
    assert f"<figcaption>{caption}</figcaption>" in hidden


def _tms_id_split():
  """Return TMS 5-2+ID's function table and weights (SPEC §10), and its
  exact split: one rank-1 component per feature in both embeddings (the
  last of 6 components zero), two adding up to the hidden identity."""
  config = tms.TmsConfig(5, 2, hidden_identity=True)
  target = tms.target_fns(config, 6)
  w = np.random.default_rng(0).normal(size=(5, 2)).astype(np.float32)
  weights = tms.TmsWeights(w=jnp.asarray(w), b=jnp.zeros(5),
                           hidden=jnp.eye(2))
  eye = np.eye(6, dtype=np.float32)
  split = {
    "linear1": (eye[:5], np.concatenate([w, np.zeros((1, 2))])),
    "hidden_layers.0": (eye[:2], eye[:, :2]),
    "linear2": (np.concatenate([w.T, np.zeros((2, 1))], 1), eye[:, :5]),
  }
  components = {k: sites_lib.Factors(v[None].astype(np.float32),
                                     u[None].astype(np.float32))
                for k, (v, u) in split.items()}
  return target, weights, components


def test_recovery_lines_name_each_pattern_and_match_the_features():
  target, weights, components = _tms_id_split()
  identity = np.eye(5, 6)
  dense = np.zeros((5, 6))
  dense[:, [3, 0]] = 1.0
  ci = {"linear1": identity, "hidden_layers.0": dense, "linear2": identity}
  lines = evaluation.recovery_lines(ci, target, weights, components)
  assert lines[0] == (
    "[result] linear1: 5 alive, identity CI error 0, MMCS 1.000, "
    "ML2R 1.000; c0->f[0], c1->f[1], c2->f[2], c3->f[3], c4->f[4]")
  assert lines[1].startswith(
    "[result] hidden_layers.0: 2 alive, dense CI error 0 (k=2); c0->f[0, 1")
  assert "identity CI error 0, MMCS 1.000, ML2R 1.000" in lines[2]
  # Halving linear1's U halves its norm ratio.
  halved = {**components, "linear1": components["linear1"]._replace(
    u=components["linear1"].u / 2)}
  assert "MMCS 1.000, ML2R 0.500" in evaluation.recovery_lines(
    ci, target, weights, halved)[0]


def test_probe_column_order_follows_the_expected_pattern():
  ci = np.array([[1.0, 0.0, 0.0, 0.95],
                 [0.0, 0.0, 1.0, 0.95],
                 [0.0, 0.0, 0.0, 0.95]])
  # Dense: descending column mass, the silent column dropped.
  assert evaluation.probe_column_order(ci, Expected("dense", 1)) == [3, 0, 2]
  # Identity (also without a pattern): the Hungarian match of rows.
  assert evaluation.probe_column_order(ci, None) == \
    evaluation.probe_column_order(ci, Expected("identity")) == [0, 2, 3]


def test_eval_line_shows_each_sites_pattern_error_and_match():
  sites = tuple(sites_lib.SiteSpec(n, n, 0, 2, 2, 3) for n in ("a", "b"))
  scalars = {"ci_l0/a": 1.0, "ci_l0/b": 2.0, "identity_ci_error/a": 0.0,
             "dense_ci_error/b": 3.0, "mmcs/a": 0.99, "ml2r/a": 1.01}
  line = evaluation._eval_line(7, scalars, sites, 0.5, False)
  assert "ci_error 0/3" in line and "mmcs 0.99/-" in line
  assert "ml2r 1.01/-" in line and "alive" not in line


def test_eval_and_task_lines_show_the_hidden_role_only_when_present():
  sites = tuple(sites_lib.SiteSpec(n, n, 0, 2, 2, 3) for n in ("a", "b"))
  scalars = {"ci_l0/a": 1.0, "ci_l0/b": 2.0}
  assert "hidden" not in evaluation._eval_line(7, scalars, sites, 0.5, False)
  line = evaluation._eval_line(7, {
    **scalars, "ci_l0_hidden/a": 3.0, "ci_l0_hidden/b": 4.0,
    "recon/hidden_ci_masked": 0.25}, sites, 0.5, False)
  assert "ci_l0_hidden 3/4" in line and "hidden_ci_masked 2.500e-01" in line
  task = {f"task/{m}/{v}": 1.0 for m in ("answer_accuracy", "answer_ce")
          for v in ("clean", "ci_masked", "ablated")}
  task.update({"task/nontarget_ce/clean": 1.0,
               "task/nontarget_ce/ablated": 2.0})
  for s in ("a", "b"):
    task.update({f"task/alive/{s}": 2, f"task/answer_l0/{s}": 1.0})
  assert "hidden" not in evaluation._task_line(3, task, sites)
  for s, v in (("a", 0.5), ("b", 1.5)):
    task[f"task/answer_l0_hidden/{s}"] = v
  assert ("answer L0 1.00/1.00 (hidden 0.50/1.50)"
          in evaluation._task_line(3, task, sites))


@pytest.mark.parametrize("roles", [("output",), ("output", "hidden")])
def test_the_evaluator_reconstructs_the_runs_hidden_pass_points(
    chain, monkeypatch, tmp_path, roles):
  """The eval's hidden passes reconstruct what the train step's do (none
  with one-role CI)."""
  target, weights = chain
  built = []

  def make_eval_step(*args):
    built.append(args[3])
    return eval_step.EvalFns(None, None)

  monkeypatch.setattr(eval_step, "make_eval_step", make_eval_step)
  config = TrainConfig(ci_roles=roles, eval_every=1)
  evaluation.make_evaluator(config, target, None, (), lambda key: None,
                            weights, str(tmp_path))
  want = tuple(f"{s.name}.out" for s in target.sites) if len(roles) > 1 else ()
  assert built[0].hidden_points == want
