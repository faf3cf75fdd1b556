"""Transcoders on a run's language model: the spliced model is the clean
one when the stand-in is exact, k is the layers' CI-L0, and the
evaluation's numbers are the direct ones on the harvest's positions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.analysis import (
  explore, harvest_batches, harvest_settings, harvesting, transcoder_eval,
  transcoder_lm)
from decompax.analysis import transcoder as tc
from decompax.evals import eval_metrics
from decompax.io import run_dir
from decompax.measures import tag_context, tag_profile
from decompax.recipe import assembly
from decompax.targets import brown_tags, glu_target

LAYER = 1  # the text run decomposes layer 1's MLP


@pytest.fixture(scope="module")
def text_run(harvested):
  # The same request as the other text-run tests: harvested once.
  return harvested("text_llama", positions=2 * 8 * 16, batch_size=8,
                   top_k=4, ablation_batches=1)


@pytest.fixture(scope="module")
def loaded(text_run):
  run = explore.load_run(text_run)
  settings, from_harvest = transcoder_eval.eval_settings(
    text_run, run, harvest_settings.Request())
  assert from_harvest
  tokens = harvest_batches.batch_source(run, settings)(0)
  return run, settings, tokens


def _config(run):
  return assembly.resolve_target(run.config).record.token_model


def _own_mlp(run, layer):
  lw = transcoder_lm.layer_weights(run.weights, layer)
  return lambda x: (jax.nn.silu(x @ lw.gate) * (x @ lw.up)) @ lw.down


def test_splicing_each_layer_s_own_mlp_gives_the_clean_logits(loaded):
  run, _, tokens = loaded
  config = _config(run)
  clean, taps = run.target.clean_forward(
    run.weights, tokens, tuple(f"resid.{i}" for i in range(2)))
  own = {i: _own_mlp(run, i) for i in range(config.n_layers)}
  for first in (0, 1):
    spliced = transcoder_lm.spliced_logits(
      run.weights, config, run.config.attention, taps[f"resid.{first}"],
      first, own)
    np.testing.assert_allclose(spliced, clean, atol=2e-5, rtol=1e-5)
  zero = transcoder_lm.spliced_logits(
    run.weights, config, run.config.attention, taps["resid.1"], 1,
    {1: jnp.zeros_like})
  assert float(jnp.max(jnp.abs(zero - clean))) > 1e-3


def test_an_exact_transcoder_splices_to_the_clean_ce(loaded):
  # Every MLP's down projection zeroed: a transcoder of zero decoder and
  # bias is then exact, and every spliced CE is the clean CE.
  run, _, tokens = loaded
  no_mlp = run.weights._replace(**{
    name: stack._replace(down=jnp.zeros_like(stack.down))
    for name in ("prefix", "span", "tail")
    if (stack := getattr(run.weights, name)) is not None})
  d = run.weights.embed.shape[1]
  exact = tc.Transcoder(jnp.zeros((d, 6)), jnp.ones(6), jnp.zeros((6, d)),
                        jnp.zeros(d))
  metrics = transcoder_eval.make_batch_metrics(run, {LAYER: 2}, None, 1)
  scalars, fits, _ = metrics(no_mlp, {LAYER: exact}, tokens, None)
  clean = float(scalars["ce/clean"])
  assert abs(float(scalars["ce/all"]) - clean) < 1e-6
  assert abs(float(scalars[f"ce/layer.{LAYER}"]) - clean) < 1e-6
  assert float(fits[LAYER].sse) == 0.0
  assert float(scalars[f"l0/layer.{LAYER}"]) == 2.0


def test_layers_are_the_decomposed_mlps_with_their_sites(loaded):
  run = loaded[0]
  assert transcoder_lm.layer_sites(run) == {
    1: tuple(f"layers.1.mlp.{r}_proj" for r in ("gate", "up", "down"))}


def test_k_is_the_layer_s_ci_l0_summed_and_rounded():
  sites = {0: ("a", "b"), 3: ("c",)}
  l0 = transcoder_lm.matched_l0({"a": 2.3, "b": 4.4, "c": 0.2, "x": 9.0},
                                sites)
  assert l0 == pytest.approx({0: 6.7, 3: 0.2})
  assert transcoder_lm.matched_k(l0) == {0: 7, 3: 1}
  with pytest.raises(ValueError, match=r"no CI-L0 recorded for sites \['c'"):
    transcoder_lm.matched_l0({"a": 1.0, "b": 1.0}, sites)


def test_ci_l0_is_the_harvest_s_firing_over_its_positions(text_run):
  found = harvesting.load_harvest(text_run)
  l0, source = transcoder_lm.site_ci_l0(text_run)
  assert source == "harvest"
  for site, fields in found.sites.items():
    assert l0[site] == pytest.approx(
      fields["fired"].sum() / found.manifest["positions"])


def test_without_a_harvest_ci_l0_is_the_last_evaluation_s(tmp_path):
  path = tmp_path / run_dir.METRICS_FILE
  run_dir.append_metrics(path, {"step": 1, "eval/ci_l0/s": 3.0})
  run_dir.append_metrics(path, {"step": 2, "eval/ci_l0/s": 5.0,
                                "ci_l0/s": 9.0})
  run_dir.append_metrics(path, {"step": 3, "loss": 1.0})
  assert transcoder_lm.site_ci_l0(str(tmp_path)) == ({"s": 5.0}, "eval")
  with pytest.raises(ValueError, match="records no CI-L0"):
    transcoder_lm.site_ci_l0(str(tmp_path / "none"))


def test_the_evaluation_is_the_direct_computation_on_the_harvest(
    text_run, loaded):
  run, settings, _ = loaded
  ks = {LAYER: 3}
  settings_t = transcoder_lm.TrainSettings(
    settings.data_path, (LAYER,), (3,), (12,), 1, 4, 8, 1e-3, 0.0, 0)
  params = transcoder_lm.initial(
    run, settings_t, transcoder_lm.token_batches(settings_t, 300)(0))
  lines = []
  evaluation = transcoder_eval.evaluate(run, params, ks, settings,
                                        lines.append)
  batches = harvest_batches.batch_source(run, settings)
  tap = transcoder_lm.mlp_input_tap(LAYER)

  @jax.jit
  def direct(tokens):
    logits, taps = run.target.clean_forward(run.weights, tokens, (tap,))
    labels = glu_target.token_labels(tokens)
    z = tc.encode(params[LAYER], taps[tap], 3)
    return (eval_metrics.cross_entropy(logits, labels),
            jnp.mean(jnp.sum(z > 0, axis=-1)))

  clean, masked, z_count = [], [], 0.0
  for b in range(settings.n_batches):
    tokens = batches(b)
    ce, count = direct(tokens)
    clean.append(float(ce))
    out = explore.intervened_forward(run, tokens, "ci_masked").output
    masked.append(float(eval_metrics.cross_entropy(
      out, glu_target.token_labels(tokens))))
    z_count += float(count)
  s = evaluation.scalars
  assert s["ce/clean"] == pytest.approx(np.mean(clean), rel=1e-5)
  assert s["ce/ci_masked"] == pytest.approx(np.mean(masked), rel=1e-5)
  assert s[f"l0/layer.{LAYER}"] == pytest.approx(z_count / len(clean))
  assert s[f"l0/layer.{LAYER}"] <= 3
  assert lines[-1].startswith(
    f"[transcoder] eval batch {settings.n_batches}/{settings.n_batches}")
  # The latents' statistics are over the harvest's very positions.
  others = transcoder_eval.harvest_units(text_run,
                                         transcoder_lm.layer_sites(run))
  latents = evaluation.units[LAYER].tags
  np.testing.assert_array_equal(latents.base_coarse,
                                others[LAYER]["neurons"].tags.base_coarse)
  assert tag_profile.unit_mass(latents).sum() > 0
  record = transcoder_eval.layer_record(LAYER, evaluation, 3, 2.5, 12,
                                        others[LAYER], 0)
  assert set(record["purity"]) == {
    "latents", "components", "neurons", "latents_minus_components",
    "latents_minus_neurons", "context"}
  assert set(record["purity"]["context"]) == {"latents", "components",
                                              "neurons"}
  _context_is_the_direct_one(run, settings, params, evaluation)
  assert record["ce_diff"] == pytest.approx(
    s[f"ce/layer.{LAYER}"] - s["ce/clean"])


def _context_is_the_direct_one(run, settings, params, evaluation):
  """The latents' streamed context statistics against
  `tag_context.unit_context_purity` of their activity gathered over the
  same positions, the token mix counted over them."""
  batches = harvest_batches.batch_source(run, settings)
  tags = harvest_batches.tag_source(settings)
  tap = transcoder_lm.mlp_input_tap(LAYER)
  z, ids, classes = [], [], []
  for b in range(settings.n_batches):
    tokens = batches(b)
    _, taps = run.target.clean_forward(run.weights, tokens, (tap,))
    z.append(np.asarray(tc.encode(params[LAYER], taps[tap], 3)).reshape(
      -1, params[LAYER].w_enc.shape[1]))
    ids.append(np.asarray(tokens).reshape(-1))
    classes.append(tags.coarse_of[np.asarray(tags.read(b)[0]).reshape(-1)])
  direct = tag_context.unit_context_purity(
    np.concatenate(z), np.concatenate(ids), np.concatenate(classes),
    len(brown_tags.COARSE))
  streamed = evaluation.units[LAYER]
  counts = tag_profile.class_counts(streamed.tags)
  got = tag_context.context_purity(counts, streamed.context.implied)
  fired = np.isfinite(direct.purity)
  assert fired.any()
  np.testing.assert_allclose(got.implied_purity[fired],
                             direct.implied_purity[fired], atol=1e-5)
  np.testing.assert_allclose(got.excess[fired], direct.excess[fired],
                             atol=1e-5)
  np.testing.assert_array_equal(
    streamed.context.on, (np.concatenate(z) > 0).sum(axis=0))


def test_the_table_has_a_row_per_layer_and_the_all_layers_line():
  purity = {n: {"weighted": {"median_purity": v}}
            for n, v in (("latents", 0.5), ("components", 0.25))}
  purity["context"] = {"latents": {"excess": 0.125}, "components": None,
                       "neurons": {"excess": -0.0625}}
  record = {"positions": 64, "ce": {"clean": 4.0, "all": 4.5,
                                    "ci_masked": None},
            "layers": {"2": {"k": 3, "ci_l0": 2.6, "latent_l0": 2.5,
                             "fvu": 0.125, "ce_spliced": 4.25,
                             "ce_diff": 0.25, "purity": purity}}}
  lines = transcoder_eval.results_table(record).splitlines()
  assert lines[2] == ("| 2 | 3 | 2.60 | 2.50 | 0.125 | 4.2500 | +0.2500 | "
                      "0.500 / 0.250 / — | +0.125 / — / -0.062 |")
  assert lines[-1] == (
    "Clean CE 4.0000; every layer's transcoder at once 4.5000 (+0.5000); "
    "the decomposition under its CI masks not measured, over 64 positions.")
