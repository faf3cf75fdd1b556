"""One full VPD training step against a slow, readable reference (issue: VPD step).

The factory fuses everything into one backward, prepares CI once, and applies
persistent-adversary coefficients on the model side. The reference below
takes each piece separately, in SPEC §6.1's order, with two plain
`jax.grad` calls, hand-written clip and AdamW, and hand-built masks; every
leaf of the resulting state must agree to rel 1e-6 (fp32).
"""

import jax
import jax.numpy as jnp
import numpy as np

from decompax.core import adversary, ci_fns, masks, optim, rng, squash
from decompax.core import sites as sites_lib
from decompax.core import train_step
from decompax.core.schedules import Schedule
from decompax.core.site_forward import SiteMask
from decompax.losses import adversarial, recon, terms

B, C, SEED_STEP = 8, 5, 0
COEFFS = {"faith": 2.0, "imp": 3e-2, "stoch": 1.0, "pgd": 0.5}
P, LR, CI_LR, CLIP, SRC_LR, N_WARMUP = 1.5, 1e-2, 3e-3, 0.05, 0.1, 1


def _factory_terms(target):
  sites = target.sites
  pgd = adversarial.PersistentConfig(
    adversary.SourceConfig(scope="c"), Schedule(SRC_LR), n_warmup=N_WARMUP)
  return (
    terms.faithfulness_term(COEFFS["faith"]),
    terms.importance_minimality_term(COEFFS["imp"], P),
    terms.stochastic_recon_term(
      "stoch", COEFFS["stoch"], recon.all_sites_plan(sites, "uniform_k"), True),
    adversarial.persistent_pgd_term(
      "pgd", COEFFS["pgd"], recon.all_sites_plan(sites, "uniform_k"), pgd,
      sites, with_delta=True),
  )


def _setup(chain):
  target, weights = chain
  ci_fn = ci_fns.make_ci_fn(ci_fns.CIConfig("site_mlp", (4,)), target.sites)
  cfg = train_step.StepConfig(
    total_steps=10,
    components_opt=optim.AdamWConfig(Schedule(LR), clip_max_norm=CLIP),
    ci_opt=optim.AdamWConfig(Schedule(CI_LR)))
  built = train_step.make_train_step(target, ci_fn, _factory_terms(target), cfg)
  comps = sites_lib.init_components(jax.random.key(0), target.sites)
  state = built.init(comps, ci_fn.init(jax.random.key(1)), jax.random.key(2),
                     (B,))
  x = jax.random.normal(jax.random.key(3), (B, 4))
  return target, weights, ci_fn, built, state, x


def _forward(target, weights, comps, x, masks_by_site):
  return target.masked_forward(weights, comps, x, masks_by_site)


def _reference_step(target, weights, ci_fn, state, x):
  sites = target.sites
  index = {s.name: i for i, s in enumerate(sites)}
  step_key = jax.random.fold_in(state.rng, state.step)
  key_stoch = jax.random.fold_in(step_key, 3)
  key_pgd = jax.random.fold_in(step_key, 4)
  clean, taps = target.clean_forward(weights, x, ci_fn.input_taps)

  def ci(theta):
    comps, ci_params = theta
    pre = ci_fn.apply(ci_params, taps, comps)
    lower = {k: squash.lower_leaky_hard(v) for k, v in pre.items()}
    upper = {k: squash.upper_leaky_hard(v) for k, v in pre.items()}
    return lower, upper

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
    out = _forward(target, weights, comps, x, site_masks)
    return jnp.mean(jnp.square(out - clean))

  # Persistent sources: the warmup ascent, all sites routed, no parameter grad.
  theta = (state.components, state.ci_params)
  lower0, _ = ci(theta)
  src_state = state.term_states[3]["sources"]
  everywhere = {s.name: jnp.ones((B,), bool) for s in sites}
  cfg = adversary.SourceConfig(scope="c")
  for _ in range(N_WARMUP):
    raw = {k: v.source for k, v in src_state.items()}
    g = jax.grad(lambda r: recon_mse(
      state.components, lower0, r, everywhere))(raw)
    src_state = {k: adversary.ascend(src_state[k], g[k], 0, SRC_LR, cfg)
                 for k in src_state}
  raw = {k: v.source for k, v in src_state.items()}
  stoch_draw, stoch_route = jax.random.split(key_stoch)
  _, pgd_route = jax.random.split(key_pgd)
  fwd_key = jax.random.fold_in(jax.random.fold_in(stoch_draw, 0), 0)
  stoch_sources = {
    s.name: rng.uniform(jax.random.fold_in(fwd_key, index[s.name]), (B, C + 1))
    for s in sites}

  def model_loss(theta):
    comps, _ = theta
    lower, upper = ci(theta)
    faith_num = sum(jnp.sum(jnp.square(
      weights[s.kind][s.row] - comps[s.kind].v[s.row] @ comps[s.kind].u[s.row]))
      for s in sites)
    faith = faith_num / sum(s.d_in * s.d_out for s in sites)
    imp = sum(jnp.sum(jnp.mean((u + 1e-12) ** P, axis=0))
              for u in upper.values())
    stoch = recon_mse(comps, lower, stoch_sources, routes(stoch_route))
    pgd = recon_mse(comps, lower, raw, routes(pgd_route))
    return (COEFFS["faith"] * faith + COEFFS["imp"] * imp
            + COEFFS["stoch"] * stoch + COEFFS["pgd"] * pgd)

  g_comps, g_ci = jax.grad(model_loss)(theta)
  # The final ascent: the term's own gradient at pre-update parameters,
  # without its coefficient.
  g_src = jax.grad(lambda r: recon_mse(
    state.components, ci(theta)[0], r, routes(pgd_route)))(raw)
  src_state = {k: adversary.ascend(src_state[k], g_src[k], N_WARMUP, SRC_LR,
                                   cfg) for k in src_state}

  def adam_first_step(param, grad, lr):
    m = 0.1 * grad
    v = 0.001 * grad * grad
    return param - lr * ((m / 0.1) / (jnp.sqrt(v / 0.001) + 1e-8))

  norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(g_comps)))
  scale = jnp.minimum(1.0, CLIP / (norm + 1e-6))
  comps = jax.tree.map(lambda p, g: adam_first_step(p, g * scale, LR),
                       state.components, g_comps)
  ci_params = jax.tree.map(lambda p, g: adam_first_step(p, g, CI_LR),
                           state.ci_params, g_ci)
  return comps, ci_params, src_state


def test_full_step_matches_readable_reference(chain):
  target, weights, ci_fn, built, state, x = _setup(chain)
  comps, ci_params, sources = _reference_step(target, weights, ci_fn, state, x)
  after, _ = built.step(state, weights, x)
  pairs = [(after.components, comps), (after.ci_params, ci_params),
           (after.term_states[3]["sources"], sources)]
  for got_tree, want_tree in pairs:
    for got, want in zip(jax.tree.leaves(got_tree), jax.tree.leaves(want_tree)):
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert int(after.term_states[3]["count"]) == N_WARMUP + 1
