"""analysis/explore: a finished run opened from its directory, its components'
CI, masked forwards with components ablated or kept, and batched ablation
effects on a prompt."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.analysis import explore
from decompax.measures import probe


def test_load_run_rebuilds_the_run_from_its_directory(tms):
  assert tms.config.target == "tms_5-2" and tms.config.c == 6
  assert [s.name for s in tms.target.sites] == ["linear1", "linear2"]
  # The CI it computes is the probe CI the run's own eval computes (up to
  # the fusion differences of jitted and eager evaluation).
  probe_inputs = tms.target.feature_probe()
  d = tms.decomposition
  expected = probe.probe_ci(tms.target, tms.ci_fn, tms.weights, d.components,
                            d.ci_params)
  got = explore.component_ci(tms, probe_inputs)
  for site in expected:
    np.testing.assert_allclose(got[site], expected[site], rtol=1e-5,
                               atol=1e-7)
    assert got[site].shape == (5, 6)


def test_not_a_run_directory_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="has no flags.txt"):
    explore.load_run(str(tmp_path))


def test_nothing_ablated_is_the_clean_model(tms):
  inputs = tms.target.feature_probe()
  out = explore.ablated_forward(tms, inputs)
  np.testing.assert_allclose(out.output, out.clean, rtol=1e-5, atol=1e-6)
  assert float(out.divergence) < 1e-10


def test_ablating_or_keeping_components_changes_what_they_write(tms):
  inputs = tms.target.feature_probe()
  d = tms.decomposition
  v, u = d.components["linear1"].v[0], d.components["linear1"].u[0]
  # Component 2 of linear1 removed: the first layer's weight loses V₂U₂,
  # which the one-feature probe inputs read through their own row.
  out = explore.ablated_forward(tms, inputs, ablate={"linear1": [2]})
  kept = explore.ablated_forward(
    tms, inputs, keep={"linear1": [c for c in range(6) if c != 2]})
  np.testing.assert_allclose(out.output, kept.output, rtol=1e-5, atol=1e-6)
  assert float(jnp.linalg.norm(v[:, 2:3] @ u[2:3])) > 0
  assert float(out.divergence) > 0
  with pytest.raises(ValueError, match="no decomposed site 'linear3'"):
    explore.ablated_forward(tms, inputs, ablate={"linear3": [0]})


def test_ablation_effects_match_one_forward_per_component(induction):
  tokens = jnp.asarray([0, 3, 5, 7, 3, 5], jnp.int32)
  effects = explore.ablation_effects(induction, tokens, chunk=4)
  n = len(effects.component)
  assert n == len(effects.site) == effects.effect.shape[0] > 0
  clean = explore.ablated_forward(induction, tokens[None])
  base = jax.nn.log_softmax(clean.clean[0, -1])[effects.token]
  assert effects.log_prob == pytest.approx(float(base), abs=1e-5)
  # Each batched effect equals its own ablated forward, for a few of them.
  for i in range(0, n, max(1, n // 3)):
    one = explore.ablated_forward(
      induction, tokens[None],
      ablate={effects.site[i]: [int(effects.component[i])]})
    log_prob = jax.nn.log_softmax(one.output[0, -1])[effects.token]
    assert float(effects.effect[i]) == pytest.approx(
      float(base - log_prob), abs=1e-4)


def test_ablation_effects_need_a_language_model(tms):
  with pytest.raises(ValueError, match="not a language model"):
    explore.ablation_effects(tms, jnp.zeros((3,), jnp.int32))


def test_a_token_run_knows_its_model_s_positions(tms, induction):
  assert tms.positions is None
  assert induction.positions == 64


def test_a_prompt_past_the_model_s_positions_is_refused(induction):
  """The induction toy's rotary attention would answer 65 tokens without
  a sign that it never saw such a context; a learned position table has
  no row for them."""
  tokens = jnp.ones(65, jnp.int32)
  message = "the prompt has 65 tokens, more than the model's 64 positions"
  with pytest.raises(ValueError, match=message):
    explore.predict(induction, tokens, None)
  with pytest.raises(ValueError, match=message):
    explore.attribution_graph(induction, tokens)
  with pytest.raises(ValueError, match=message):
    explore.mask_sweep(induction, tokens, "layers.1.mlp.up_proj", 0, [1.0])
  assert len(explore.predict(induction, tokens[:64], None, top=1)[0]) == 64


@pytest.mark.parametrize("tokens, bad", [([-1, 3], -1), ([1, 32], 32)])
def test_an_attribution_graph_refuses_ids_outside_the_vocabulary(
    induction, tokens, bad):
  with pytest.raises(ValueError, match=f"token id {bad} is outside the "
                     r"vocabulary \[0, 32\)"):
    explore.attribution_graph(induction, tokens)
