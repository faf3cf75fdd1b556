"""Graded interventions (analysis/interventions, explore.mask_sweep and
explore.intervened_forward) against their known answers: value 1 is the
target, value 0 the ablation, a sweep is affine where the output is, and
the modes are the evaluation's mask variants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.analysis import explore
from decompax.core import masks as masks_lib
from decompax.core import sites as sites_lib

PROMPT = (0, 3, 5, 7, 3, 5)


def _log_prob(logits, position, token):
  return float(jax.nn.log_softmax(logits[0, position])[token])


def test_value_one_everywhere_is_the_masked_forward_at_all_ones(induction):
  tokens = jnp.asarray(PROMPT, jnp.int32)
  site = induction.target.sites[1].name
  sweep = explore.mask_sweep(induction, tokens, site, 3, [1.0, 1.0],
                             position=2)
  plain = explore.ablated_forward(induction, tokens[None])
  assert sweep.position == 2
  assert sweep.token == int(jnp.argmax(plain.clean[0, 2]))
  want = _log_prob(plain.output, 2, sweep.token)
  np.testing.assert_allclose(sweep.output, [want, want], atol=1e-5)


def test_value_zero_is_the_components_ablation(induction):
  tokens = jnp.asarray(PROMPT, jnp.int32)
  effects = explore.ablation_effects(induction, tokens)
  assert len(effects.component) > 0
  for i in range(0, len(effects.component), 3):
    site, c = effects.site[i], int(effects.component[i])
    sweep = explore.mask_sweep(induction, tokens, site, c, [0.0, 1.0],
                               token=effects.token)
    assert float(sweep.output[1]) == pytest.approx(effects.log_prob,
                                                   abs=1e-4)
    assert float(effects.log_prob - sweep.output[0]) == pytest.approx(
      float(effects.effect[i]), abs=1e-4)


def test_one_compiled_sweep_serves_every_component(induction):
  tokens = jnp.asarray(PROMPT, jnp.int32)
  values = np.linspace(0, 2, 5)
  first = explore.mask_sweep(induction, tokens, induction.target.sites[0].name,
                             0, values)
  size = induction.jitted.sweep_log_probs._cache_size()
  for site in induction.target.sites[1:3]:
    explore.mask_sweep(induction, tokens, site.name, site.c - 1, values)
  assert induction.jitted.sweep_log_probs._cache_size() == size
  assert first.output.shape == (5,)


def test_a_toy_sweep_at_zero_and_one_is_the_ablation_and_the_target(tms):
  x = tms.target.feature_probe()[1]
  sweep = explore.mask_sweep(tms, x, "linear1", 2, [0.0, 1.0])
  ablated = explore.ablated_forward(tms, x[None], ablate={"linear1": [2]})
  np.testing.assert_allclose(sweep.output[0], ablated.output[0], atol=1e-6)
  np.testing.assert_allclose(sweep.output[1], ablated.clean[0], atol=1e-6)
  assert sweep.token is None and sweep.position is None


def test_a_sweep_is_affine_where_the_output_is(tms):
  """TMS writes `relu(h @ W + b)`: a linear2 component's mask moves the
  pre-activation affinely, so every output the ReLU passes at both ends
  of [0, 2] is affine in the mask over the whole range. The components
  sum to the weights, so each carries a feature's whole read or write."""
  run = _exact_zero_ci(tms)
  values = np.linspace(0.0, 2.0, 21)
  checked = moving = 0
  for x in run.target.feature_probe():
    for c in range(6):
      out = np.asarray(
        explore.mask_sweep(run, x, "linear2", c, values).output, np.float64)
      live = (out[0] > 1e-3) & (out[-1] > 1e-3)
      line = out[0] + values[:, None] / 2.0 * (out[-1] - out[0])
      np.testing.assert_allclose(out[:, live], line[:, live], rtol=1e-5,
                                 atol=1e-6)
      checked += int(live.sum())
      moving += int((live & (np.abs(out[-1] - out[0]) > 1e-3)).sum())
  assert checked > 0 and moving > 0


@pytest.mark.parametrize("kwargs, message", [
  ({"values": [0.5, 2.5]}, r"mask value 2.5 is outside \[0, 2\]"),
  ({"values": [-0.1]}, r"mask value -0.1 is outside \[0, 2\]"),
  ({"values": [float("nan")]}, r"mask value nan is outside"),
  ({"values": []}, "non-empty list"),
  ({"site": "nope"}, "no decomposed site 'nope'"),
  ({"component": 99}, r"has components 0..7; got 99"),
  ({"component": True}, r"has components 0..7; got True"),
  ({"position": 6}, "position 6 is outside a prompt of 6 tokens"),
  ({"token": 10 ** 6}, "outside the vocabulary"),
])
def test_bad_sweeps_are_refused(induction, kwargs, message):
  args = {"site": induction.target.sites[0].name, "component": 0,
          "values": [0.0, 1.0], **kwargs}
  with pytest.raises(ValueError, match=message):
    explore.mask_sweep(induction, jnp.asarray(PROMPT), **args)


def test_ci_masked_mode_is_the_eval_variant(tms):
  inputs = tms.target.feature_probe()
  d = tms.decomposition
  ci = explore.component_ci(tms, inputs)
  masks = masks_lib.variant_site_masks("ci_masked", jax.random.key(0), ci,
                                       tms.target.sites, True, 0.5)
  want = tms.target.masked_forward(tms.weights, d.components, inputs, masks)
  got = explore.intervened_forward(tms, inputs, "ci_masked")
  np.testing.assert_allclose(got.output, want, rtol=1e-5, atol=1e-6)


def test_stochastic_mode_is_seeded(tms):
  inputs = tms.target.feature_probe()
  a, b, c = (explore.intervened_forward(tms, inputs, "stochastic", seed=s)
             for s in (1, 1, 2))
  np.testing.assert_array_equal(a.output, b.output)
  assert not np.array_equal(a.output, c.output)


def _exact_zero_ci(run: explore.LoadedRun) -> explore.LoadedRun:
  """Return `run` with components that sum to each weight exactly (`V` the
  identity's first columns, `U` the weight's rows) and a CI of 0
  everywhere: its masks are then the adversary's sources themselves, and
  every component matters (a four-step run's are still near 0)."""
  stacks = run.target.frozen_stacks(run.weights)
  components = {}
  for kind, factors in run.decomposition.components.items():
    w = stacks[kind][0]
    d_in, c = factors.v.shape[1:]
    components[kind] = factors._replace(
      v=jnp.eye(d_in, c)[None],
      u=jnp.zeros((c, w.shape[1])).at[:d_in].set(w)[None])

  def apply(params, taps, components):
    lead = next(iter(taps.values())).shape[:-1]
    return {s.name: jnp.zeros((*lead, s.c)) for s in run.target.sites}

  ci_fn = run.ci_fn._replace(apply=apply, apply_roles=None)
  return run._replace(
    decomposition=run.decomposition._replace(components=components),
    ci_fn=ci_fn, jitted=explore.jit_functions(run.target, ci_fn))


def test_adversarial_mode_starts_at_its_draw_and_ascends(tms):
  run = _exact_zero_ci(tms)
  inputs = run.target.feature_probe()
  d = run.decomposition
  ci = explore.component_ci(run, inputs)
  assert all(float(jnp.abs(v).max()) == 0.0 for v in ci.values())
  key = jax.random.key(3)
  paths = sites_lib.draw_paths(run.target.sites)
  sources = {s.name: jax.random.uniform(
    sites_lib.fold_path(key, paths[s.name]), (1, s.c))
    for s in run.target.sites}
  masks = masks_lib.source_site_masks(ci, sources, tuple(sources), None)
  want = run.target.masked_forward(run.weights, d.components, inputs, masks)
  start = explore.intervened_forward(run, inputs, "adversarial", seed=3,
                                     pgd_steps=0)
  np.testing.assert_allclose(start.output, want, rtol=1e-5, atol=1e-6)
  after = explore.intervened_forward(run, inputs, "adversarial", seed=3,
                                     pgd_steps=10, pgd_step_size=0.1)
  assert float(after.divergence) > float(start.divergence)


@pytest.mark.parametrize("kwargs, message", [
  ({"mode": "rounded"}, "unknown intervention mode 'rounded'"),
  ({"mode": "adversarial", "pgd_steps": -1}, "pgd_steps must be"),
  ({"mode": "adversarial", "pgd_step_size": 0.0}, "pgd_step_size must be"),
])
def test_bad_modes_are_refused(tms, kwargs, message):
  with pytest.raises(ValueError, match=message):
    explore.intervened_forward(tms, tms.target.feature_probe(), **kwargs)


def test_a_prediction_under_a_mode(induction):
  tokens = jnp.asarray(PROMPT, jnp.int32)
  p = explore.intervened_prediction(induction, tokens, "ci_masked", top=3)
  plain = explore.predict(induction, tokens, None, top=3)
  np.testing.assert_array_equal(p.clean_tokens, plain.clean_tokens)
  assert p.ablated_tokens.shape == (6, 3) and bool(jnp.all(p.kl >= -1e-6))
