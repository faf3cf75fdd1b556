"""LM compute dtype (SPEC N4): V/U cast once per step, CI in bf16, fp32
faithfulness from the masters (N2), toys untouched."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import (
  ci_fns, ci_transformer, optim, step_objective, step_records, train_step)
from decompax.core import sites as sites_lib
from decompax.core.schedules import Schedule
from decompax.losses import faithfulness, recon
from decompax.losses import loss_terms as terms
from decompax.targets import (
  glu_arrays, glu_config, glu_sites, glu_target, glu_weights)

CONFIG = glu_config.GluConfig(
  n_layers=3, d_model=16, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=24,
  vocab_size=32, rope_theta=10000.0, rms_eps=1e-5, tied=False,
  qk_norm=False)
B, T = 2, 6
# C = 7 gives V [1, 16, 7] / [1, 24, 7] and U [1, 7, 24] / [1, 7, 16]: no
# other array of the step has these shapes.
C = 7
NAMES = (glu_weights.site_name(1, "gate"), glu_weights.site_name(1, "down"))
# The LM layout (SPEC §4.3): one chunk reading the block's residual.
CI_CONFIG = ci_transformer.TransformerCIConfig(
  chunks=(ci_transformer.Chunk(("resid.1",), NAMES),),
  tap_widths=(("resid.1", CONFIG.d_model),), d_model=8, n_blocks=2,
  n_heads=2, d_mlp=16, remat=True)


def _weights(dtype):
  rng = np.random.default_rng(0)
  arrays = {}
  for name, shape in glu_arrays.layer_array_shapes(CONFIG).items():
    value = rng.standard_normal((CONFIG.n_layers, *shape)) * 0.3
    arrays[name] = (value + (len(shape) == 1)).astype(np.float32)
  for name in ("embed", "head"):
    arrays[name] = rng.standard_normal(
      (CONFIG.vocab_size, CONFIG.d_model)).astype(np.float32)
  arrays["norm"] = np.ones(CONFIG.d_model, np.float32)
  seg = glu_weights.Segments(CONFIG.n_layers, 1, 2)
  return glu_arrays.weights_from_arrays(arrays, CONFIG, seg, dtype)


def _step(compute_dtype, weights_dtype=jnp.bfloat16):
  """Return a built LM step with two masked forwards, its state, weights."""
  fns = glu_target.target_fns(CONFIG, glu_sites.site_specs(CONFIG, NAMES, C))
  ci_fn = ci_fns.make_ci_fn(
    ci_fns.CIConfig("transformer", (), CI_CONFIG), fns.sites)
  plan = recon.all_sites_plan(fns.sites)
  loss_terms = (
    terms.faithfulness_term(1.0),
    terms.importance_minimality_term(1e-3, 1.0),
    terms.stochastic_recon_term("recon_a", 1.0, plan, False),
    terms.stochastic_recon_term("recon_b", 1.0, plan, True))
  adam = optim.AdamWConfig(Schedule(1e-3))
  built = train_step.make_train_step(
    fns, ci_fn, loss_terms,
    step_records.StepConfig(3, adam, adam, compute_dtype=compute_dtype),
    sample_inputs=lambda key: jax.random.randint(
        key, (B, T), 0, CONFIG.vocab_size))
  components = sites_lib.init_components(jax.random.key(1), fns.sites)
  state = built.init(components, ci_fn.init(jax.random.key(2)),
                     jax.random.key(3), (B, T))
  return built, state, _weights(weights_dtype), fns


def _casts_to_bf16(text, shape):
  dims = "x".join(map(str, shape))
  return len(re.findall(
    rf"\(tensor<{dims}xf32>\) -> tensor<{dims}xbf16>", text))


@pytest.fixture(scope="module")
def lowered():
  """Return per compute dtype the lowered step, its text, state, weights."""
  out = {}
  for dtype in (None, "bfloat16"):
    built, state, weights, fns = _step(dtype)
    step = built.step.lower(state, weights, jax.random.key(4))
    out[dtype] = (step, step.as_text(), state, weights, fns)
  return out


def test_lm_step_casts_each_factor_once(lowered):  # N4
  _, text, state, _, _ = lowered["bfloat16"]
  for factors in state.components.values():
    for leaf in factors:
      assert _casts_to_bf16(text, leaf.shape) == 1, leaf.shape


def test_without_compute_dtype_each_masked_forward_casts(lowered):
  # The per-forward cast that N4 removes: one per masked forward (two terms).
  _, text, state, _, _ = lowered[None]
  for factors in state.components.values():
    for leaf in factors:
      assert _casts_to_bf16(text, leaf.shape) == 2, leaf.shape


def test_ci_transformer_computes_in_its_parameters_dtype():  # N4
  sites = glu_sites.site_specs(CONFIG, NAMES, C)
  plan = ci_transformer.plan_chunks(CI_CONFIG, sites)
  params = ci_transformer.init_params(jax.random.key(5), CI_CONFIG, plan)
  taps = {"resid.1": jax.random.normal(jax.random.key(6),
                                       (B, T, CONFIG.d_model))}
  half = step_objective.cast_floats((params, taps), jnp.bfloat16)

  def pre(p, t):
    return ci_transformer.apply(p, t, CI_CONFIG, plan)

  text = jax.jit(pre).lower(*half).as_text()
  dots = re.findall(r"stablehlo.dot_general .*-> tensor<[0-9x]*x(\w+)>", text)
  assert dots and set(dots) == {"bf16"}
  low, full = jax.jit(pre)(*half), jax.jit(pre)(params, taps)
  # bf16 keeps 8 significant bits (a rounding errs by up to 2^-9 of the
  # value). Through one block's matmuls, norms and softmax the output's RMS
  # error stays within a few roundings: measured 0.6% of the output's RMS
  # (bound 2^-6 = 1.6%), and 3% of it at the worst element (bound 2^-4).
  for name in full:
    assert low[name].dtype == jnp.bfloat16
    got, want = np.asarray(low[name], np.float32), np.asarray(full[name])
    scale = np.sqrt(np.mean(want ** 2))
    assert np.sqrt(np.mean((got - want) ** 2)) <= 2 ** -6 * scale, name
    np.testing.assert_allclose(got, want, atol=2 ** -4 * scale, rtol=0)


def test_faithfulness_reads_the_fp32_masters(lowered):  # N2
  step, _, state, weights, fns = lowered["bfloat16"]
  masters = jax.tree.map(jnp.array, state.components)  # the step donates
  _, metrics = step.compile()(state, weights, jax.random.key(4))
  w_stacks = fns.frozen_stacks(weights)
  exact = faithfulness.faithfulness_per_kind(w_stacks, masters)
  rounded = faithfulness.faithfulness_per_kind(
    w_stacks, step_objective.cast_floats(masters, jnp.bfloat16))
  got = float(metrics["loss/faithfulness"])
  np.testing.assert_allclose(got, float(exact), rtol=1e-6)
  assert abs(float(rounded) - float(exact)) > 1e-6 * float(exact)
  assert float(metrics["loss/recon_a"]) > 0


def test_fp32_step_has_no_bf16():  # N4: toys fp32 throughout
  built, state, weights, _ = _step(None, jnp.float32)
  text = built.step.lower(state, weights, jax.random.key(4)).as_text()
  assert "bf16" not in text


@pytest.mark.parametrize("dtype,casts", [("bfloat16", 1), (None, None)])
def test_eval_pass_computes_like_the_train_step(lowered, dtype, casts):
  # The eval's masked forwards (mask variants, terms, PGD probe) read the
  # V/U the train step would: cast once per batch under N4.
  from decompax.evals import eval_step

  _, _, state, weights, fns = lowered[dtype]
  ci_fn = ci_fns.make_ci_fn(
    ci_fns.CIConfig("transformer", (), CI_CONFIG), fns.sites)
  plan = recon.all_sites_plan(fns.sites)
  evaluated = eval_step.make_eval_step(
    fns, ci_fn, (terms.stochastic_recon_term("recon", 1.0, plan, False),),
    eval_step.EvalConfig(n_batches=1, total_steps=3, pgd_steps=1,
                         compute_dtype=dtype),
    lambda key: jax.random.randint(key, (B, T), 0, CONFIG.vocab_size))
  text = evaluated.fast.lower(state, weights, jax.random.key(0)).as_text()
  for factors in state.components.values():
    for leaf in factors:
      found = _casts_to_bf16(text, leaf.shape)
      assert found == casts if casts else found > 1, (leaf.shape, found)
