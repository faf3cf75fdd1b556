"""The non-target stream's terms and evals of a targeted decomposition
(SPEC §6.6, I45): the pinned delta, constant sources, the unmasked-no-delta
term."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, optim, sites as sites_lib, squash
from decompax.core import step_records, train_step
from decompax.core.schedules import Schedule
from decompax.core.masks import SiteMask
from decompax.core.step_records import StreamSpec
from decompax.losses import recon
from decompax.evals import eval_step
from decompax.losses import loss_terms as terms
from decompax.losses import recon


@pytest.fixture(scope="module")
def parts(token_target):
  target, weights = token_target
  ci = ci_fns.make_ci_fn(ci_fns.CIConfig("vector_mlp", (4,)), target.sites)
  comps = sites_lib.init_components(jax.random.key(0), target.sites)
  ci_params = ci.init(jax.random.key(1))
  tokens = jax.random.randint(jax.random.key(2), (3, 5), 0, 6)
  return target, weights, ci, comps, ci_params, tokens


def _ctx(parts, pin):
  target, weights, ci, comps, ci_params, tokens = parts
  out, taps = target.clean_forward(weights, tokens, ci.input_taps)
  ci_out = squash.squash(ci.apply(ci_params, taps, comps))
  return step_records.StepContext(
    jnp.zeros((), jnp.int32), 10, target, weights, tokens, out, comps,
    ci_out, clean_taps=taps, delta_pin=pin)


def _by_hand(parts, masks):
  target, weights, _, comps, _, tokens = parts
  clean, _ = target.clean_forward(weights, tokens, ())
  return target.divergence(
    target.masked_forward(weights, comps, tokens, masks), clean)


def test_constant_sources_mask_at_the_lower_ci_with_the_delta_pinned(parts):
  ctx = _ctx(parts, pin=True)
  term = terms.constant_recon_term(
    "nontarget_recon", 1.0, recon.all_sites_plan(ctx.target.sites))
  value, _ = term.fn(ctx, jax.random.key(3), None)
  lead = parts[-1].shape
  want = _by_hand(parts, {
    s: SiteMask(ci, jnp.ones(lead)) for s, ci in ctx.ci.lower.items()})
  np.testing.assert_allclose(value, want, rtol=1e-6)
  # Without the pin the same masks lose the residual W − VU.
  unpinned = _by_hand(parts, {s: SiteMask(ci)
                              for s, ci in ctx.ci.lower.items()})
  assert abs(float(unpinned) - float(want)) > 1e-4


def test_unmasked_no_delta_runs_the_components_alone_despite_the_pin(parts):
  ctx = _ctx(parts, pin=True)
  term = terms.unmasked_no_delta_term("nontarget_unmasked_recon", 1.0)
  value, _ = term.fn(ctx, jax.random.key(3), None)
  ones = {s: SiteMask(jnp.ones_like(ci)) for s, ci in ctx.ci.lower.items()}
  np.testing.assert_allclose(value, _by_hand(parts, ones), rtol=1e-6)
  assert float(value) > 1e-4  # random V/U are far from W
  # m ≡ 1 with δ ≡ 1 rebuilds W exactly: the pin would hide the term.
  lead = parts[-1].shape
  pinned = {s: m._replace(delta=jnp.ones(lead)) for s, m in ones.items()}
  assert float(_by_hand(parts, pinned)) < 1e-4 * float(value)


def test_stochastic_recon_on_a_pinned_stream_draws_no_delta_and_pins_it(
    parts):
  ctx = _ctx(parts, pin=True)
  plan = recon.all_sites_plan(ctx.target.sites)
  term = terms.stochastic_recon_term("nontarget_recon", 1.0, plan, False)
  value, _ = term.fn(ctx, jax.random.key(3), None)
  unpinned, _ = term.fn(ctx._replace(delta_pin=False), jax.random.key(3),
                        None)
  assert abs(float(value) - float(unpinned)) > 1e-5


def _eval(parts, stream):
  target, weights, ci, comps, ci_params, tokens = parts
  config = eval_step.EvalConfig(n_batches=1, total_steps=10, pgd_steps=0)
  opt = optim.AdamWConfig(Schedule(1e-3))
  state = train_step.make_init((), step_records.StepConfig(10, opt, opt))(
    comps, ci_params, jax.random.key(4))
  fns = eval_step.make_eval_step(target, ci, (), config, None, stream=stream)
  output, _ = fns.fast(state, weights, jax.random.key(5), tokens[None])
  return {k: float(np.asarray(v).mean()) for k, v in output.scalars.items()}


def test_nontarget_evals_pin_every_variant_but_unmasked(parts):
  plain = _eval(parts, StreamSpec(""))
  pinned = _eval(parts, StreamSpec("nontarget", delta_pin=True))
  ctx = _ctx(parts, pin=False)
  lead = parts[-1].shape
  with_delta = {s: SiteMask(ci, jnp.ones(lead))
                for s, ci in ctx.ci.lower.items()}
  np.testing.assert_allclose(pinned["recon/ci_masked"],
                             _by_hand(parts, with_delta), rtol=1e-5)
  assert abs(pinned["recon/ci_masked"] - plain["recon/ci_masked"]) > 1e-5
  # The zero variant keeps only the residual W − VU when pinned.
  assert abs(pinned["recon/zero"] - plain["recon/zero"]) > 1e-5
  # `unmasked` runs with the delta off on every stream: the components alone.
  assert pinned["recon/unmasked"] == pytest.approx(plain["recon/unmasked"])
  assert pinned["recon/unmasked"] > 1e-4


def test_a_stream_scores_its_loss_positions_only(parts):
  ctx = _ctx(parts, pin=False)
  masks = {s: SiteMask(ci) for s, ci in ctx.ci.lower.items()}
  out = ctx.masked_forward(masks)
  picked = ctx._replace(loss_positions=(1, 3)).output_divergence(out)
  want = ctx.target.divergence(out[:, [1, 3]], ctx.clean_output[:, [1, 3]])
  np.testing.assert_allclose(picked, want, rtol=1e-6)
  assert abs(float(picked) - float(ctx.output_divergence(out))) > 1e-6
