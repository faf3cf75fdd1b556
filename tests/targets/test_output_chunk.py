"""The LM head's KL over chunks of positions (`--output_chunk`): the same
values and gradients as whole logits, at less memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import adversary, ci_fns, optim, step_records, train_step
from decompax.core import masks as masks_lib
from decompax.core import sites as sites_lib
from decompax.core.schedules import Schedule
from decompax.losses import adversarial, recon
from decompax.losses import loss_terms as terms
from decompax.targets import (
  glu_arrays, glu_config, glu_divergence, glu_lm, glu_sites, glu_target,
  glu_weights)

CONFIG = glu_config.GluConfig(
  n_layers=3, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24,
  vocab_size=40, rope_theta=10000.0, rms_eps=1e-5, tied=False,
  qk_norm=False)
B, T, C = 2, 7, 4
NAMES = (glu_weights.site_name(1, "q"), glu_weights.site_name(1, "down"))
# 14 positions: 4 leaves a ragged last chunk of 2, 7 divides, 32 is one
# chunk longer than the positions.
CHUNKS = (4, 7, 32)
# fp32 throughout; the chunked sum reassociates the mean's additions.
RTOL, ATOL = 1e-5, 1e-7


@pytest.fixture(scope="module")
def lm():
  rng = np.random.default_rng(0)
  arrays = {}
  for name, shape in glu_arrays.layer_array_shapes(CONFIG).items():
    scale = 1 / np.sqrt(shape[0]) if len(shape) == 2 else 0.1
    value = rng.standard_normal((CONFIG.n_layers, *shape)) * scale
    arrays[name] = (value + (len(shape) == 1)).astype(np.float32)
  for name in ("embed", "head"):
    arrays[name] = rng.standard_normal(
      (CONFIG.vocab_size, CONFIG.d_model)).astype(np.float32)
  arrays["norm"] = np.ones(CONFIG.d_model, np.float32)
  sites = glu_sites.site_specs(CONFIG, NAMES, C)
  weights = glu_arrays.weights_from_arrays(
    arrays, CONFIG, glu_sites.span_segments(CONFIG, sites))
  components = sites_lib.init_components(jax.random.key(1), sites)
  tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (B, T)), jnp.int32)
  return sites, weights, components, tokens


def test_chunked_kl_equals_whole_logits_values_and_gradients():  # I14
  rng = np.random.default_rng(2)
  head = jnp.asarray(rng.standard_normal((50, 8)), jnp.float32)
  masked, clean = jnp.asarray(rng.standard_normal((2, B, T, 8)), jnp.float32)

  def whole(m, h):
    return glu_divergence.kl_clean_to_masked(m @ h.T, clean @ h.T)

  value, grads = jax.value_and_grad(whole, argnums=(0, 1))(masked, head)
  for chunk in CHUNKS:
    fn = jax.jit(jax.value_and_grad(
      lambda m, h, k=chunk: glu_divergence.chunked_head_kl(h, m, clean, k),
      argnums=(0, 1)))
    got, got_grads = fn(masked, head)
    np.testing.assert_allclose(got, value, rtol=RTOL, atol=ATOL)
    for g, want in zip(got_grads, grads):
      np.testing.assert_allclose(g, want, rtol=RTOL, atol=ATOL)
  assert float(value) > 0


def test_split_forwards_through_the_head_match_the_whole_ones(lm):
  sites, weights, components, tokens = lm
  whole = glu_target.target_fns(CONFIG, sites)
  split = glu_target.target_fns(CONFIG, sites, output_chunk=4).split_head
  masks = {s.name: masks_lib.SiteMask(jax.random.uniform(
    jax.random.key(i), (B, T, s.c))) for i, s in enumerate(sites)}
  clean_logits, clean_taps = whole.clean_forward(weights, tokens,
                                                 whole.start_taps)
  clean_x, split_taps = split.clean_forward(weights, tokens, whole.start_taps)
  np.testing.assert_allclose(glu_lm.head_logits(weights, clean_x),
                             clean_logits, rtol=RTOL, atol=1e-6)

  def whole_kl(comps):
    out = whole.masked_forward_taps(weights, comps, tokens, masks,
                                    clean_taps, ())[0]
    return whole.divergence(out, clean_logits)

  def split_kl(comps):
    out = split.masked_forward_taps(weights, comps, tokens, masks,
                                    split_taps, ())[0]
    return split.divergence(weights, out, clean_x)

  value, grads = jax.jit(jax.value_and_grad(whole_kl))(components)
  got, got_grads = jax.jit(jax.value_and_grad(split_kl))(components)
  np.testing.assert_allclose(got, value, rtol=RTOL)
  assert float(value) > 0
  jax.tree.map(lambda g, w: np.testing.assert_allclose(
    g, w, rtol=RTOL, atol=1e-8), got_grads, grads)


def _step_terms(sites):
  plan = recon.all_sites_plan(sites, "uniform_k")
  pgd = adversarial.PersistentConfig(
    adversary.SourceConfig(scope="c"), Schedule(0.05), n_warmup=2)
  return (terms.faithfulness_term(1.0),
          terms.stochastic_recon_term("stochastic_recon", 1.0, plan, True),
          adversarial.persistent_pgd_term("pgd_recon", 1.0, plan, pgd, sites,
                                          with_delta=True))


def _first_step(lm, output_chunk):
  sites, weights, components, tokens = lm
  fns = glu_target.target_fns(CONFIG, sites, output_chunk=output_chunk)
  ci_fn = ci_fns.make_ci_fn(ci_fns.CIConfig("vector_mlp", (4,)), sites)
  adam = optim.AdamWConfig(Schedule(1e-2))
  built = train_step.make_train_step(
    fns, ci_fn, _step_terms(sites), step_records.StepConfig(3, adam, adam),
    sample_inputs=lambda key: tokens)
  # The step donates its state: each run starts from its own copy.
  state = built.init(jax.tree.map(jnp.copy, components),
                     ci_fn.init(jax.random.key(3)),
                     jax.random.key(4), (B, T))
  text = built.step.lower(state, weights, jax.random.key(5)).as_text()
  return jax.device_get(built.step(state, weights, jax.random.key(5))[1]), text


def test_a_step_with_chunked_output_matches_whole_logits(lm):
  # The stochastic and the persistent PGD recon share the output path; the
  # gradient norm covers every term's gradient through the head.
  whole, whole_text = _first_step(lm, 0)
  chunked, chunked_text = _first_step(lm, 4)
  logits = f"tensor<{B}x{T}x{CONFIG.vocab_size}xf32>"
  assert logits in whole_text and logits not in chunked_text
  for name in ("loss/stochastic_recon", "loss/pgd_recon", "loss/total",
               "grad_norm/components"):
    np.testing.assert_allclose(chunked[name], whole[name], rtol=RTOL,
                               err_msg=name)
  assert float(whole["loss/pgd_recon"]) > 0


def test_a_negative_chunk_is_refused(lm):
  with pytest.raises(ValueError, match="output_chunk must be >= 0"):
    glu_target.target_fns(CONFIG, lm[0], output_chunk=-1)


def _temp_bytes(fn, *args) -> int:
  compiled = jax.jit(jax.value_and_grad(fn)).lower(*args).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunks_hold_less_temporary_memory_than_whole_logits():
  # 256 positions over a 4096-wide vocabulary: whole fp32 logits are 4 MiB
  # per forward, a 32-position chunk's 0.5 MiB.
  rng = np.random.default_rng(4)
  head = jnp.asarray(rng.standard_normal((4096, 16)), jnp.float32)
  masked, clean = jnp.asarray(rng.standard_normal((2, 1, 256, 16)),
                              jnp.float32)
  whole = _temp_bytes(lambda m, c, h: glu_divergence.kl_clean_to_masked(
    m @ h.T, c @ h.T), masked, clean, head)
  chunked = _temp_bytes(lambda m, c, h: glu_divergence.chunked_head_kl(
    h, m, c, 32), masked, clean, head)
  assert chunked < whole / 4, (chunked, whole)
