"""The eval's mask variants and hidden-activation draws run through mapped
forwards (`evals.mapped_runs`): the numbers must be those of one forward per
variant or draw, each with its own masks, on a tiny GLU LM whose layer-1
matrices are all decomposed with random components and a CI that varies
over positions, so that every variant scores differently."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, masks, optim, sites as sites_lib
from decompax.core import train_step
from decompax.core.masks import SiteMask
from decompax.core.schedules import Schedule
from decompax.losses import eval_step, evals, hidden, recon
from decompax.targets import glu_config, glu_lm, glu_target

CONFIG = glu_config.GluConfig(
  n_layers=2, d_model=8, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=8,
  vocab_size=16, rope_theta=10000.0, rms_eps=1e-6, tied=True, qk_norm=False)
B, T, C = 2, 5, 4
SITES = tuple(f"layers.1.{p}_proj" for p in (
  "self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "mlp.gate",
  "mlp.up", "mlp.down"))


def _ci_fn(sites):
  """Pre-CI a fixed random projection of the layer-1 residual, per site."""
  keys = jax.random.split(jax.random.key(7), len(sites))
  proj = {s.name: 3.0 * jax.random.normal(k, (CONFIG.d_model, s.c))
          for s, k in zip(sites, keys)}

  def apply(params, taps, components):
    del params, components
    return {s.name: taps["resid.1"] @ proj[s.name] for s in sites}

  return ci_fns.CIFn(("resid.1",), lambda key: {}, apply)


@pytest.fixture(scope="module")
def lm():
  sites = glu_target.site_specs(CONFIG, SITES, C)
  target = glu_target.target_fns(CONFIG, sites)
  seg = glu_target.span_segments(CONFIG, sites)
  stack = glu_lm.init_stack(jax.random.key(0), CONFIG, CONFIG.n_layers)
  arrays = {k: np.asarray(v) for k, v in stack._asdict().items()
            if v is not None}
  rng = np.random.default_rng(1)
  arrays["embed"] = rng.standard_normal((16, 8)).astype(np.float32)
  arrays["norm"] = np.ones(8, np.float32)
  weights = glu_target.weights_from_arrays(arrays, CONFIG, seg)
  components = {
    kind: sites_lib.Factors(
      jnp.asarray(rng.standard_normal((w.shape[0], w.shape[1], C)), w.dtype),
      jnp.asarray(rng.standard_normal((w.shape[0], C, w.shape[2])) / 4,
                  w.dtype))
    for kind, w in target.frozen_stacks(weights).items()}
  ci_fn = _ci_fn(sites)
  adam = optim.AdamWConfig(Schedule(1e-3))
  built = train_step.make_train_step(target, ci_fn, (),
                                     train_step.StepConfig(10, adam, adam))
  state = built.init(components, ci_fn.init(None), jax.random.key(3), (B, T))
  inputs = jax.random.randint(jax.random.key(4), (B, T), 0, CONFIG.vocab_size)
  return target, ci_fn, weights, state, inputs


def _context(lm, config, pin, taps):
  target, ci_fn, weights, state, inputs = lm
  plan = eval_step.eval_plan(
    target, ci_fn, (), config, None,
    stream=train_step.StreamSpec("s" if pin else "", delta_pin=pin))
  wanted = getattr(plan, taps)
  return eval_step.eval_contexts(plan, state, weights, inputs, wanted,
                                 False)[0]


def _per_variant(ctx, key, config):
  """The variants' scalars, one unrolled forward each (the reference)."""
  target = ctx.target
  wanted = target.attention_taps if config.attention_kl else ()
  labels = target.token_labels(ctx.inputs)
  out = {}
  for v, variant in enumerate(masks.VARIANTS):
    site_masks = masks.variant_site_masks(
      variant, jax.random.fold_in(key, v), ctx.ci.lower, target.sites,
      config.with_delta, config.ci_alive_threshold)
    own = (ctx._replace(delta_pin=False) if variant == "unmasked" else ctx)
    if variant in eval_step.ATTENTION_VARIANTS and wanted:
      logits, taps = own.masked_forward_with_taps(site_masks, wanted)
      kl = target.attention_divergence(ctx.weights, taps, ctx.clean_taps)
      out[f"attn_kl/{variant}/layers.1"] = kl["layers.1"]
    else:
      logits = own.masked_forward(site_masks)
    out[f"recon/{variant}"] = ctx.output_divergence(logits)
    out[f"ce/{variant}"] = evals.cross_entropy(logits, labels)
  return out


@pytest.mark.parametrize("with_delta,pin,attention", [
  (False, False, False), (True, True, True)])
def test_mapped_variants_score_as_one_forward_per_variant(
    lm, with_delta, pin, attention):
  config = eval_step.EvalConfig(1, 10, with_delta=with_delta,
                                attention_kl=attention)
  key = jax.random.key(11)

  def both():
    ctx = _context(lm, config, pin, "fast_taps")
    return (eval_step._variant_scalars(ctx, key, config),
            _per_variant(ctx, key, config))

  mapped, reference = jax.jit(both)()
  clean = mapped["ce/clean"]
  for variant in masks.VARIANTS:
    np.testing.assert_allclose(mapped[f"recon/{variant}"],
                               reference[f"recon/{variant}"], rtol=1e-5,
                               err_msg=variant)
    np.testing.assert_allclose(mapped[f"ce_diff/{variant}"],
                               reference[f"ce/{variant}"] - clean,
                               rtol=1e-5, atol=1e-6, err_msg=variant)
  for variant in eval_step.ATTENTION_VARIANTS if attention else ():
    name = f"attn_kl/{variant}/layers.1"
    np.testing.assert_allclose(mapped[name], reference[name], rtol=1e-5)
  # Every variant scores apart from every other, so a variant dropped,
  # swapped or run on another's masks cannot pass the match above.
  recons = [float(reference[f"recon/{v}"]) for v in masks.VARIANTS]
  assert len(set(recons)) == len(recons), recons
  assert float(reference["recon/unmasked"]) > 0  # the components alone
  assert {k for k in mapped if k.startswith("recon/")} == {
    f"recon/{v}" for v in masks.VARIANTS}


def test_hidden_act_stats_sum_one_forward_per_draw(lm):
  config = eval_step.EvalConfig(1, 10, with_delta=True, n_mask_samples=2)
  key = jax.random.key(12)

  def both():
    ctx = _context(lm, config, False, "slow_taps")
    return eval_step._hidden_act_stats(ctx, key, config), _per_draw(
      ctx, key, config)

  mapped, reference = jax.jit(both)()
  assert set(mapped) == set(reference)
  for name, value in reference.items():
    np.testing.assert_allclose(mapped[name], value, rtol=1e-5,
                               err_msg=name)
  site = SITES[-1]
  assert (float(reference[f"hidden_err/stochastic/{site}"])
          != float(reference[f"hidden_err/ci_masked/{site}"]))
  assert int(mapped[f"hidden_n/stochastic/{site}"]) == 2 * B * T * 8


def _per_draw(ctx, key, config):
  """The slow tier's hidden-activation sums, one forward per draw."""
  sites = ctx.target.sites
  wanted = tuple(f"{s.name}.out" for s in sites)
  draws = [("ci_masked", {s.name: SiteMask(ctx.ci.lower[s.name])
                          for s in sites})]
  entry = recon.all_sites_plan(sites)[0]
  for d in range(config.n_mask_samples):
    draws.append(("stochastic", masks.stochastic_site_masks(
      jax.random.fold_in(key, 1 + d), entry.live_sites, ctx.ci.lower,
      sites_lib.draw_paths(sites), config.with_delta, "continuous", None)))
  out = {}
  for variant, site_masks in draws:
    _, taps = ctx.masked_forward_with_taps(site_masks, wanted)
    for tap, (err, n) in hidden.site_squared_errors(
        taps, ctx.clean_taps, wanted).items():
      site = tap[:-len(".out")]
      out[f"hidden_err/{variant}/{site}"] = (
        out.get(f"hidden_err/{variant}/{site}", 0.0) + err)
      out[f"hidden_n/{variant}/{site}"] = (
        out.get(f"hidden_n/{variant}/{site}", 0) + n)
  return out


def test_mapped_runs_trace_each_kind_once_and_keep_every_entry():
  traced = []

  def run(kind, site_masks):
    traced.append(kind)
    m = site_masks["a"]
    extra = 0.0 if m.delta is None else jnp.sum(m.delta)
    return jnp.sum(m.mask) * (2.0 if kind else 1.0) + extra

  ones = jnp.ones((3, 2))
  masks_of = {
    "one": {"a": SiteMask(ones)}, "two": {"a": SiteMask(2 * ones)},
    "delta": {"a": SiteMask(3 * ones, jnp.ones(3))},
    "doubled": {"a": SiteMask(4 * ones)}, "three": {"a": SiteMask(5 * ones)}}
  kinds = {"doubled": True}
  out = evals.mapped_runs(run, masks_of, lambda n: kinds.get(n, False))
  assert list(out) == list(masks_of)
  np.testing.assert_array_equal(
    [out[n] for n in masks_of], [6.0, 12.0, 21.0, 48.0, 30.0])
  # `one`, `two` and `three` stack: one trace for the three of them.
  assert len(traced) == 3 and traced.count(False) == 2
