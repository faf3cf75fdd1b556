"""The training step against a slow, readable reference (issue: VPD step).

The factory fuses everything into one backward, prepares CI once, and applies
persistent-adversary coefficients on the model side. The reference below
takes each piece separately, in SPEC §6.1's order, with plain `jax.grad`
calls, hand-written squashings, clip, AdamW and source Adam, and hand-built
masks.

One AdamW step from zero moments moves every parameter by about
`lr·sign(g)`, so comparing parameters after it checks gradient signs, not
sizes. The tests therefore compare what the optimizers received: the Adam
moments after the first step are `(1 − β1)·g` and `(1 − β2)·g²`, i.e. the
(clipped) component gradients, the raw CI gradients and the source-Adam
moments of the adversary's input gradients, together with the raw
component-gradient norm the step reports. Then several steps with real
moments and decaying learning rates must agree leaf by leaf. Finally the
same comparison must FAIL against references with a changed clip constant,
a changed coefficient or clipped CI gradients: the checker detects them.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import (
  adversary, ci_fns, masks, optim, rng, step_records, train_step)
from decompax.core import sites as sites_lib
from decompax.core.schedules import Schedule
from decompax.core.masks import SiteMask
from decompax.losses import adversarial, recon
from decompax.losses import loss_terms as terms

B, C, TOTAL, N_STEPS = 8, 5, 10, 3
P, N_WARMUP = 1.5, 1
LR, LR_FINAL = 1e-2, 0.1        # components: cosine to 0.1×
CI_LR, CI_LR_FINAL = 3e-3, 0.5  # CI: linear to 0.5×
SRC_LR = 0.1
B1, B2, EPS = 0.9, 0.999, 1e-8
SRC_B1, SRC_B2, SRC_EPS = 0.5, 0.99, 1e-8
RTOL = 1e-5


class Ref(NamedTuple):
  """The constants of the reference step; tests perturb one at a time.

  A traced argument of the jitted reference, so every variant shares one
  compilation.
  """

  # Small coefficients keep the raw gradient norm near 1e-2, where the
  # clip's `+ 1e-6` is observable at RTOL.
  faith: float = 2e-2
  imp: float = 3e-4
  stoch: float = 1e-2
  pgd: float = 5e-3
  clip: float = 5e-4
  clip_eps: float = 1e-6
  clip_ci: bool = False           # clip the CI gradients too (a bug)
  pgd_on_sources: bool = False    # coefficient on the source gradient (a bug)


REF = Ref()


def _factory_terms(target):
  sites = target.sites
  pgd = adversarial.PersistentConfig(
    adversary.SourceConfig(scope="c"), Schedule(SRC_LR), n_warmup=N_WARMUP)
  return (
    terms.faithfulness_term(REF.faith),
    terms.importance_minimality_term(REF.imp, P),
    terms.stochastic_recon_term(
      "stoch", REF.stoch, recon.all_sites_plan(sites, "uniform_k"), True),
    adversarial.persistent_pgd_term(
      "pgd", REF.pgd, recon.all_sites_plan(sites, "uniform_k"), pgd,
      sites, with_delta=True),
  )


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


class RefState(NamedTuple):
  """The reference's own copy of everything a step changes."""

  comps: dict
  ci_params: dict
  comps_m: dict
  comps_v: dict
  ci_m: dict
  ci_v: dict
  sources: dict   # site -> (source, m, v)
  count: int
  step: int


class RefGrads(NamedTuple):
  """One reference step: its raw gradients and the state after it."""

  comps: dict      # components, before the clip
  norm: jax.Array  # their global norm
  ci: dict         # CI parameters
  state: RefState


@jax.custom_vjp
def _lower(x):
  return jnp.clip(x, 0.0, 1.0)


def _lower_fwd(x):
  return jnp.clip(x, 0.0, 1.0), x


def _lower_bwd(x, g):
  # SPEC §4.1: g for 0 < x <= 1; 0.01·g for x <= 0 and g < 0; else 0.
  return (jnp.where(x <= 0.0, jnp.where(g < 0, 0.01 * g, 0.0),
                    jnp.where(x <= 1.0, g, 0.0)),)


_lower.defvjp(_lower_fwd, _lower_bwd)


def _upper(x):
  return jnp.where(x > 1.0, 1.0 + 0.01 * (x - 1.0), jnp.clip(x, 0.0, 1.0))


def _cosine(start, final, s):
  return start * (final + (1 - final) * 0.5 * (1 + jnp.cos(
    jnp.pi * s / (TOTAL - 1))))


def _linear(start, final, s):
  return start * (final + (1 - final) * (1 - s / (TOTAL - 1)))


def _adam(p, m, v, g, t, lr):
  m = B1 * m + (1 - B1) * g
  v = B2 * v + (1 - B2) * g * g
  m_hat, v_hat = m / (1 - B1 ** t), v / (1 - B2 ** t)
  return p - lr * m_hat / (jnp.sqrt(v_hat) + EPS), m, v


def _source_adam(s, m, v, g, count):
  t = count + 1
  m = SRC_B1 * m + (1 - SRC_B1) * g
  v = SRC_B2 * v + (1 - SRC_B2) * g * g
  step = (m / (1 - SRC_B1 ** t)) / (jnp.sqrt(v / (1 - SRC_B2 ** t)) + SRC_EPS)
  return jnp.clip(s + SRC_LR * step, 0.0, 1.0), m, v


def _make_reference(target, weights, ci_fn, x, run_key):
  """Return `step(ref, ref_state) -> RefGrads`, one unfused step."""
  sites = target.sites
  index = {s.name: i for i, s in enumerate(sites)}
  clean, taps = target.clean_forward(weights, x, ci_fn.input_taps)

  def ci(comps, ci_params):
    pre = ci_fn.apply(ci_params, taps, comps)
    return ({k: _lower(v) for k, v in pre.items()},
            {k: _upper(v) for k, v in pre.items()})

  def routes(key):
    r = masks.uniform_k_routes(
      jax.random.fold_in(jax.random.fold_in(key, 0), 0), (B,), len(sites))
    return {s.name: r[:, index[s.name]] for s in sites}

  def recon_mse(comps, lower, sources, route):
    site_masks = {}
    for s in sites:
      src = jnp.broadcast_to(sources[s.name], (B, C + 1))
      m = lower[s.name] + (1 - lower[s.name]) * src[:, :C]
      site_masks[s.name] = SiteMask(m, src[:, C], route[s.name])
    out = target.masked_forward(weights, comps, x, site_masks)
    return jnp.mean(jnp.square(out - clean))

  @jax.jit
  def step(ref, state, s):
    step_key = jax.random.fold_in(run_key, s)
    key_stoch = jax.random.fold_in(step_key, 3)
    key_pgd = jax.random.fold_in(step_key, 4)
    sg = jax.lax.stop_gradient
    lower0 = sg(ci(state.comps, state.ci_params)[0])
    everywhere = {site.name: jnp.ones((B,), bool) for site in sites}
    # Warmup ascents: every site routed, no parameter gradient.
    sources, count = dict(state.sources), state.count
    for _ in range(N_WARMUP):
      raw = {k: v[0] for k, v in sources.items()}
      g = jax.grad(lambda r: recon_mse(
        sg(state.comps), lower0, r, everywhere))(raw)
      sources = {k: _source_adam(*sources[k], g[k], count) for k in sources}
      count += 1
    raw = {k: v[0] for k, v in sources.items()}
    stoch_draw, stoch_route = jax.random.split(key_stoch)
    _, pgd_route = jax.random.split(key_pgd)
    fwd_key = jax.random.fold_in(jax.random.fold_in(stoch_draw, 0), 0)
    stoch_sources = {
      site.name: rng.uniform(jax.random.fold_in(fwd_key, index[site.name]),
                             (B, C + 1)) for site in sites}

    def model_loss(comps, ci_params):
      lower, upper = ci(comps, ci_params)
      faith_num = sum(jnp.sum(jnp.square(
        weights[t.kind][t.row] - comps[t.kind].v[t.row] @ comps[t.kind].u[
          t.row])) for t in sites)
      faith = faith_num / sum(t.d_in * t.d_out for t in sites)
      imp = sum(jnp.sum(jnp.mean((u + 1e-12) ** P, axis=0))
                for u in upper.values())
      stoch = recon_mse(comps, lower, stoch_sources, routes(stoch_route))
      pgd = recon_mse(comps, lower, raw, routes(pgd_route))
      return (ref.faith * faith + ref.imp * imp + ref.stoch * stoch
              + ref.pgd * pgd)

    g_comps, g_ci = jax.grad(model_loss, argnums=(0, 1))(
      state.comps, state.ci_params)
    # The final ascent: the term's own gradient at pre-update parameters.
    g_src = jax.grad(lambda r: recon_mse(
      state.comps, ci(state.comps, state.ci_params)[0], r,
      routes(pgd_route)))(raw)
    src_scale = jnp.where(ref.pgd_on_sources, ref.pgd, 1.0)
    g_src = jax.tree.map(lambda g: src_scale * g, g_src)
    sources = {k: _source_adam(*sources[k], g_src[k], count) for k in sources}
    count += 1

    def clip(tree):
      norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(tree)))
      scale = jnp.minimum(1.0, ref.clip / (norm + ref.clip_eps))
      return jax.tree.map(lambda g: g * scale, tree), norm

    clipped, norm = clip(g_comps)
    g_ci_used = jax.tree.map(lambda a, b: jnp.where(ref.clip_ci, a, b),
                             clip(g_ci)[0], g_ci)
    t = s + 1
    new_c = jax.tree.map(
      lambda p, m, v, g: _adam(p, m, v, g, t, _cosine(LR, LR_FINAL, s)),
      state.comps, state.comps_m, state.comps_v, clipped)
    new_ci = jax.tree.map(
      lambda p, m, v, g: _adam(p, m, v, g, t, _linear(CI_LR, CI_LR_FINAL, s)),
      state.ci_params, state.ci_m, state.ci_v, g_ci_used)

    def part(tree, like, i):
      # `like`'s structure is a prefix of `tree`'s: each leaf maps to (p, m, v).
      return jax.tree.map(lambda _, r: r[i], like, tree)

    after = RefState(
      part(new_c, state.comps, 0), part(new_ci, state.ci_params, 0),
      part(new_c, state.comps, 1), part(new_c, state.comps, 2),
      part(new_ci, state.ci_params, 1), part(new_ci, state.ci_params, 2),
      sources, count, s + 1)
    return RefGrads(g_comps, norm, g_ci, after)

  return step


def _adam_state(opt_state):
  (adam,) = [s for s in opt_state if hasattr(s, "mu")]
  return adam


def _ref_state_of(state) -> RefState:
  """Return the reference's view of a factory state (host arrays)."""
  comps_adam = _adam_state(state.components_opt)
  ci_adam = _adam_state(state.ci_opt)
  pgd = state.term_states["pgd"]
  return RefState(
    state.components, state.ci_params, comps_adam.mu, comps_adam.nu,
    ci_adam.mu, ci_adam.nu,
    {k: (v.source, v.m, v.v) for k, v in pgd.sources.items()},
    int(pgd.count), int(state.step))


@pytest.fixture(scope="module")
def runs(chain):
  """The factory's states over `N_STEPS` steps, and the reference."""
  target, weights = chain
  ci_fn = ci_fns.make_ci_fn(ci_fns.CIConfig("component_mlp", (4,)),
                            target.sites)
  cfg = step_records.StepConfig(
    total_steps=TOTAL,
    components_opt=optim.AdamWConfig(
      Schedule(LR, "cosine", final_frac=LR_FINAL), clip_max_norm=REF.clip),
    ci_opt=optim.AdamWConfig(
      Schedule(CI_LR, "linear", final_frac=CI_LR_FINAL)))
  built = train_step.make_train_step(target, ci_fn, _factory_terms(target),
                                     cfg)
  comps = sites_lib.init_components(jax.random.key(0), target.sites)
  state = built.init(comps, ci_fn.init(jax.random.key(1)), jax.random.key(2),
                     (B,))
  x = jax.random.normal(jax.random.key(3), (B, 4))
  states, metrics = [_host(state._replace(rng=None))], []
  for _ in range(N_STEPS):
    state, m = built.step(state, weights, x)
    states.append(_host(state._replace(rng=None)))
    metrics.append(_host(m))
  # A key of its own: the step donates the state's.
  reference = _make_reference(target, weights, ci_fn, x, jax.random.key(2))
  return states, metrics, reference


def _close(got, want, what, rtol=RTOL):
  """Assert two trees agree leafwise within `rtol` of each leaf's scale."""
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves), what
  for a, b in zip(got_leaves, want_leaves):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, what
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max(),
                               err_msg=what)


def _check_first_step_gradients(runs, ref):
  """Compare the gradients the first step's optimizers received with `ref`'s.

  From zero moments, Adam's `mu = (1 − β1)·g` and `nu = (1 − β2)·g²` hold
  the gradients themselves: the clipped component gradient (with the raw
  norm the step reports before the clip), the CI gradient, and for the
  sources the warmup and final ascents' input gradients.
  """
  states, metrics, reference = runs
  want = reference(ref, _ref_state_of(states[0]), 0)
  got = _ref_state_of(states[1])
  norm = metrics[0]["grad_norm/components"]
  np.testing.assert_allclose(norm, want.norm, rtol=RTOL)
  # The raw component gradient: the first moment with the clip undone.
  scale = min(1.0, ref.clip / (float(norm) + ref.clip_eps))
  _close(jax.tree.map(lambda m: m / ((1 - B1) * scale), got.comps_m),
         want.comps, "raw component gradients")
  for field in ("comps_m", "comps_v", "ci_m", "ci_v", "sources"):
    _close(getattr(got, field), getattr(want.state, field), field)
  assert got.count == want.state.count == N_WARMUP + 1


def test_first_step_gradients_match_the_reference(runs):
  states, metrics, reference = runs
  _check_first_step_gradients(runs, REF)
  # The setup keeps every perturbation below observable: the clip is
  # active, the CI gradient is larger than the clip (clipping it would
  # change it), and the clip's 1e-6 moves the scale by 10× the tolerance.
  want = reference(REF, _ref_state_of(states[0]), 0)
  norm = float(want.norm)
  assert norm > REF.clip
  ci_norm = math.sqrt(sum(float(jnp.sum(g * g))
                          for g in jax.tree.leaves(want.ci)))
  assert ci_norm > REF.clip
  assert REF.clip_eps / norm > 10 * RTOL


@pytest.mark.parametrize("perturbed", [
  Ref(clip=REF.clip * 1.001),
  Ref(clip_eps=0.0),
  Ref(faith=REF.faith * 1.001),
  Ref(imp=REF.imp * 1.001),
  Ref(stoch=REF.stoch * 1.001),
  Ref(pgd=REF.pgd * 1.001),
  Ref(clip_ci=True),
  Ref(pgd_on_sources=True),
], ids=["clip", "clip_eps", "faith", "imp", "stoch", "pgd", "clip_ci",
        "pgd_on_sources"])
def test_the_gradient_check_detects_a_changed_reference(runs, perturbed):
  with pytest.raises(AssertionError):
    _check_first_step_gradients(runs, perturbed)


def test_several_steps_with_real_moments_match_the_reference(runs):
  states, metrics, reference = runs
  want = _ref_state_of(states[0])
  for s in range(N_STEPS):
    want = reference(REF, want, s).state
    got = _ref_state_of(states[s + 1])
    for field in RefState._fields:
      if field in ("count", "step"):
        assert getattr(got, field) == getattr(want, field), field
      else:
        _close(getattr(got, field), getattr(want, field), f"{field} @ {s}")
  assert want.count == N_STEPS * (N_WARMUP + 1)
