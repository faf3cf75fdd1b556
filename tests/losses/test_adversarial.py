"""Persistent, merged and fresh PGD terms in the step (SPEC §5.6-§5.8,
I17-I24)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import adversary, ci_fns, optim, sites as sites_lib
from decompax.core import squash, step_records, train_step
from decompax.core.schedules import Schedule
from decompax.losses import adversarial, hidden, recon
from decompax.losses import loss_terms as terms

B = 8


def _persistent(target, coeff, n_warmup, step_rule="adam", lr=0.05):
  config = adversarial.PersistentConfig(
    adversary.SourceConfig(scope="c", step_rule=step_rule),
    Schedule(lr), n_warmup=n_warmup)
  plan = recon.all_sites_plan(target.sites, "uniform_k", 1)
  return adversarial.persistent_pgd_term(
    "persistent", coeff, plan, config, target.sites, with_delta=True)


def _ci_and_x(chain):
  """Return `_run`'s CI function and batch, without building its step (a
  compile of seconds) for tests that call a term outside the step."""
  ci = ci_fns.make_ci_fn(ci_fns.CIConfig("site_mlp", (4,)), chain[0].sites)
  return ci, jax.random.normal(jax.random.key(3), (B, 4))


def _run(chain, extra_terms):
  target, weights = chain
  ci, x = _ci_and_x(chain)
  cfg = step_records.StepConfig(
    total_steps=10, components_opt=optim.AdamWConfig(Schedule(1e-2)),
    ci_opt=optim.AdamWConfig(Schedule(1e-2)))
  all_terms = (terms.faithfulness_term(1.0), *extra_terms)
  built = train_step.make_train_step(target, ci, all_terms, cfg)
  comps = sites_lib.init_components(jax.random.key(0), target.sites)
  state = built.init(comps, ci.init(jax.random.key(1)), jax.random.key(2), (B,))
  before = jax.tree.map(np.asarray, state._replace(rng=None))
  after, metrics = built.step(state, weights, x)
  return before, after, metrics, built, ci, x


@pytest.mark.parametrize("n_warmup", [0, 2])
def test_i17_source_updates_per_step(chain, n_warmup):
  _, after, _, _, _, _ = _run(chain, (_persistent(chain[0], 1.0, n_warmup),))
  assert list(after.term_states) == ["persistent"]  # faithfulness: none
  assert isinstance(after.term_states["persistent"],
                    adversarial.PersistentSources)
  assert int(after.term_states["persistent"].count) == n_warmup + 1


SRC_LR_PEAK, SRC_WARMUP = 0.05, 4  # lr(s) = 0.05·s/4 for s < 4 (10 steps)


def test_i17_every_ascent_of_a_step_uses_that_steps_source_lr(chain):
  """A source LR that changes from step to step (a warmup: decays are
  refused) with the sign rule and unprojected sigmoid sources: each of the
  n_warmup + 1 ascents of step s moves a source by exactly ±lr(s), so the
  step's displacement is an integer multiple of lr(s) of size at most
  n_warmup + 1, reached where the ascents agree. An LR read per ascent (at
  the ascent count) or at another step breaks the integers."""
  n_warmup = 2
  target, weights = chain
  config = adversarial.PersistentConfig(
    adversary.SourceConfig(scope="c", parametrization="sigmoid",
                           step_rule="sign"),
    Schedule(SRC_LR_PEAK, warmup_pct=SRC_WARMUP / 10), n_warmup=n_warmup)
  term = adversarial.persistent_pgd_term(
    "persistent", 1.0, recon.all_sites_plan(target.sites, "uniform_k", 1),
    config, target.sites, with_delta=True)
  ci = ci_fns.make_ci_fn(ci_fns.CIConfig("site_mlp", (4,)), target.sites)
  adam = optim.AdamWConfig(Schedule(1e-2))
  built = train_step.make_train_step(
    target, ci, (terms.faithfulness_term(1.0), term),
    step_records.StepConfig(10, adam, adam))
  state = built.init(sites_lib.init_components(jax.random.key(0), target.sites),
                     ci.init(jax.random.key(1)), jax.random.key(2), (B,))
  x = jax.random.normal(jax.random.key(3), (B, 4))
  def sources_f64(state):
    return {k: np.array(v, np.float64) for k, v in _sources(state).items()}

  previous = sources_f64(state)
  for s in range(SRC_WARMUP):
    state, _ = built.step(state, weights, x)
    count = state.term_states["persistent"].count
    assert int(count) == (s + 1) * (n_warmup + 1)
    now = sources_f64(state)
    lr = SRC_LR_PEAK * s / SRC_WARMUP
    for site, source in now.items():
      delta = source - previous[site]
      if s == 0:
        np.testing.assert_array_equal(delta, 0.0)  # lr(0) = 0
        continue
      steps = delta / lr
      np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
      assert np.abs(np.round(steps)).max() == n_warmup + 1, steps
    previous = now


def test_i20_final_ascent_independent_of_coefficient(chain):
  _, after0, _, _, _, _ = _run(chain, (_persistent(chain[0], 0.0, 1),))
  _, after1, _, _, _, _ = _run(chain, (_persistent(chain[0], 3.0, 1),))
  for site in after0.term_states["persistent"].sources:
    np.testing.assert_allclose(
      after0.term_states["persistent"].sources[site].source,
      after1.term_states["persistent"].sources[site].source,
      rtol=1e-6, atol=1e-7)


def test_i21_warmup_ascents_touch_no_parameter(chain):
  _, with_adv, _, _, _, _ = _run(chain, (_persistent(chain[0], 0.0, 3),))
  _, without, _, _, _, _ = _run(chain, ())
  for kind in without.components:
    np.testing.assert_array_equal(with_adv.components[kind].v,
                                  without.components[kind].v)
  np.testing.assert_array_equal(
    with_adv.ci_params["l0"][0].w, without.ci_params["l0"][0].w)


def test_i18_clamp_sources_stay_in_range_after_steps(chain):
  """Three sign ascents of 0.4 from U[0, 1]: without the projection after
  each, most sources would leave [0, 1]; with it they sit in range, many
  exactly on an edge, and the others a whole number of ±0.4 steps away from
  their start or from an edge they were cut at."""
  before, after, _, _, _, _ = _run(
    chain, (_persistent(chain[0], 1.0, 2, "sign", lr=0.4),))
  on_edge = 0
  for site, s in after.term_states["persistent"].sources.items():
    source = np.asarray(s.source)
    assert source.min() >= 0.0 and source.max() <= 1.0
    on_edge += np.sum((source == 0.0) | (source == 1.0))
    start = np.asarray(before.term_states["persistent"].sources[site].source)
    inside = (source > 0.0) & (source < 1.0)
    for origin in (start, 0.0, 1.0):
      moves = (source - origin) / 0.4
      inside &= np.abs(moves - np.round(moves)) > 1e-4
    assert not inside.any(), source
  assert on_edge >= 9  # of 18 values


def test_persistent_config_refusals():
  with pytest.raises(ValueError, match="not linear"):
    adversarial.PersistentConfig(adversary.SourceConfig(),
                                 Schedule(0.1, "linear", final_frac=0.0))
  with pytest.raises(ValueError, match="objective"):
    adversarial.PersistentConfig(adversary.SourceConfig(), Schedule(0.1),
                                 objective="both")


@pytest.mark.parametrize("n_draws", [1, 2])
def test_fresh_pgd_term_runs_and_is_finite(chain, n_draws):
  target = chain[0]
  term = adversarial.fresh_pgd_term(
    "fresh", 1.0, recon.all_sites_plan(target.sites, "uniform_k", n_draws),
    adversarial.FreshConfig("random", "bc", n_steps=2, step_size=0.1), True)
  _, after, metrics, _, _, _ = _run(chain, (term,))
  assert np.isfinite(float(metrics["loss/fresh"]))
  assert int(after.step) == 1


def test_i24_fresh_pgd_raises_the_loss_over_its_init(chain):
  target = chain[0]
  plan = recon.all_sites_plan(target.sites, "all", 1)
  values = {}
  for n_steps in (0, 3):
    term = adversarial.fresh_pgd_term(
      "fresh", 1.0, plan,
      adversarial.FreshConfig("ones", "bc", n_steps=n_steps, step_size=0.2),
      False)
    _, _, metrics, _, _, _ = _run(chain, (term,))
    values[n_steps] = float(metrics["loss/fresh"])
  assert values[3] > values[0]


def _persistent_with(target, objective="e2e", rider=None, merged=None,
                     coeff=1.0):
  config = adversarial.PersistentConfig(
    adversary.SourceConfig(scope="c"), Schedule(0.05), n_warmup=1,
    objective=objective)
  plan = recon.all_sites_plan(target.sites, "uniform_k", 1)
  return adversarial.persistent_pgd_term(
    "persistent", coeff, plan, config, target.sites, with_delta=True,
    rider=rider, merged=merged)


def _sources(after):
  return {k: np.asarray(s.source)
          for k, s in after.term_states["persistent"].sources.items()}


RIDER = hidden.HiddenRider(2.0, ("l0.out", "l1.out"))


@pytest.fixture(scope="module")
def persistent_run(chain):
  """Return `run(objective, rider)`: `_run` of the persistent term
  `_persistent_with` builds, stepped once per module for each pair (the
  I23 tests share the plain e2e run, a compile of seconds)."""
  done = {}

  def run(objective, rider):
    if (objective, rider) not in done:
      done[objective, rider] = _run(chain, (
        _persistent_with(chain[0], objective, rider=rider),))
    return done[objective, rider]

  return run


def test_i23_e2e_without_rider_is_term(persistent_run):
  _, e2e, m_e2e, *_ = persistent_run("e2e", None)
  _, term, m_term, *_ = persistent_run("term", None)
  chex.assert_trees_all_equal(e2e._replace(rng=None), term._replace(rng=None))
  assert float(m_e2e["loss/persistent"]) == float(m_term["loss/persistent"])


def test_i23_e2e_with_rider_ascends_on_output_only(persistent_run):
  """Same draws and pre-update parameters: the e2e sources move exactly as
  without the rider, while the rider still changes the loss and the model."""
  _, plain, m_plain, *_ = persistent_run("e2e", None)
  _, e2e, m_e2e, *_ = persistent_run("e2e", RIDER)
  _, term, _, *_ = persistent_run("term", RIDER)
  for site, source in _sources(plain).items():
    np.testing.assert_allclose(_sources(e2e)[site], source, rtol=1e-6,
                               atol=1e-7)
  assert any(not np.allclose(_sources(term)[s], v, rtol=1e-4, atol=1e-6)
             for s, v in _sources(plain).items())
  assert float(m_e2e["loss/persistent"]) > float(m_plain["loss/persistent"])
  assert not np.allclose(e2e.components["sq"].v, plain.components["sq"].v)


def test_merged_term_all_adversarial_is_the_persistent_route_all_term(chain):
  target = chain[0]
  config = adversarial.PersistentConfig(
    adversary.SourceConfig(scope="c"), Schedule(0.05), n_warmup=1)
  route_all = recon.all_sites_plan(target.sites, "all", 1)
  uniform_k = recon.all_sites_plan(target.sites, "uniform_k", 1)
  persistent = adversarial.persistent_pgd_term(
    "persistent", 1.0, route_all, config, target.sites, True)
  merged = adversarial.persistent_pgd_term(
    "persistent", 1.0, uniform_k, config, target.sites, True,
    merged=adversarial.Merged(1.0))
  _, after_p, m_p, *_ = _run(chain, (persistent,))
  _, after_m, m_m, *_ = _run(chain, (merged,))
  np.testing.assert_allclose(float(m_m["loss/persistent"]),
                             float(m_p["loss/persistent"]), rtol=1e-6)
  for site, source in _sources(after_p).items():
    np.testing.assert_allclose(_sources(after_m)[site], source, rtol=1e-6,
                               atol=1e-7)


def test_merged_term_without_adversarial_rows_leaves_sources_still(chain):
  """At fraction 0 every row draws fresh sources: the persistent ones get a
  zero gradient, so the final ascent moves nothing (Adam: 0 / (0 + eps))."""
  config = adversarial.PersistentConfig(
    adversary.SourceConfig(scope="c"), Schedule(0.05), n_warmup=0)
  term = adversarial.persistent_pgd_term(
    "persistent", 1.0, recon.all_sites_plan(chain[0].sites, "uniform_k", 1),
    config, chain[0].sites, True, merged=adversarial.Merged(0.0))
  before, after, metrics, *_ = _run(chain, (term,))
  assert float(metrics["loss/persistent"]) > 0
  for site, source in _sources(after).items():
    np.testing.assert_array_equal(
      source, before.term_states["persistent"].sources[site].source)


def test_i22_a_bundle_feeds_one_term():
  adversarial.check_bundles({"pgd": "a", "merged": "b"})
  with pytest.raises(ValueError, match="bundle 'a' feeds two terms"):
    adversarial.check_bundles({"pgd": "a", "merged": "a"})


def test_i24_fresh_pgd_one_routing_draw_and_no_main_loss_gradient(
    chain, monkeypatch):
  """Every ascent and the loss forward route from one key per forward (the
  step's one routing draw), and the sources enter the objective as
  constants."""
  target = chain[0]
  plan = recon.all_sites_plan(target.sites, "uniform_k", 1)
  term = adversarial.fresh_pgd_term(
    "fresh", 1.0, plan, adversarial.FreshConfig("random", "bc", 2, 0.1), True)
  ci, x = _ci_and_x(chain)
  route_keys = []
  real_routes = recon.entry_routes

  def recording(key, entry, lead):
    route_keys.append(tuple(np.asarray(jax.random.key_data(key)).ravel()))
    return real_routes(key, entry, lead)

  monkeypatch.setattr(recon, "entry_routes", recording)
  ctx = _context(chain, ci, x)
  _, sources = term.prepare(ctx, jax.random.key(7), None)
  assert len(route_keys) == 2  # one forward per ascent
  value_grad = jax.grad(
    lambda s: term.fn(ctx, jax.random.key(7), s)[0])(sources)
  assert len(route_keys) == 3
  assert len(set(route_keys)) == len(plan)
  for g in jax.tree.leaves(value_grad):
    assert not np.any(np.asarray(g))


def _context(chain, ci, x):
  target, weights = chain
  comps = sites_lib.init_components(jax.random.key(0), target.sites)
  ci_params = ci.init(jax.random.key(1))
  out, taps = target.clean_forward(weights, x, ci.input_taps)
  ci_out = squash.squash(ci.apply(ci_params, taps, comps))
  return step_records.StepContext(
    jnp.zeros((), jnp.int32), 10, target, weights, x, out, comps, ci_out,
    clean_taps=taps)


def _recording(ctx):
  """Return `ctx` whose target records the masks of every masked forward it
  traces, and the list they land in."""
  seen = []
  target = ctx.target

  def plain(weights, comps, x, site_masks):
    seen.append(site_masks)
    return target.masked_forward(weights, comps, x, site_masks)

  def with_taps(weights, comps, x, site_masks, clean_taps, wanted):
    seen.append(site_masks)
    return target.masked_forward_taps(weights, comps, x, site_masks,
                                      clean_taps, wanted)

  return ctx._replace(target=target._replace(
    masked_forward=plain, masked_forward_taps=with_taps)), seen


def _fresh_forwards(chain, init, routing, n_draws):
  """Return the fresh term's loss and the masks of each forward of `fn`."""
  target = chain[0]
  term = adversarial.fresh_pgd_term(
    "fresh", 1.0, recon.all_sites_plan(target.sites, routing, n_draws),
    adversarial.FreshConfig(init, "bc", n_steps=1, step_size=0.1), True)
  ci, x = _ci_and_x(chain)
  ctx, seen = _recording(_context(chain, ci, x))
  _, inputs = term.prepare(ctx, jax.random.key(7), None)
  del seen[:]
  value, _ = term.fn(ctx, jax.random.key(7), inputs)
  return float(value), list(seen)


def test_fresh_pgd_identical_draws_run_one_forward(chain):
  """`ones` sources routed everywhere are deterministic: n_mask_samples=2
  asks for the same forward twice, so the term runs it once, same value."""
  value_1, forwards_1 = _fresh_forwards(chain, "ones", "all", 1)
  value_2, forwards_2 = _fresh_forwards(chain, "ones", "all", 2)
  assert len(forwards_1) == len(forwards_2) == 1
  assert value_2 == value_1


@pytest.mark.parametrize("init, routing", [("random", "all"),
                                           ("ones", "uniform_k")])
def test_fresh_pgd_random_draws_differ(chain, init, routing):
  """A random init or random routing makes every draw its own adversary:
  the two forwards see different masks or routes."""
  _, forwards = _fresh_forwards(chain, init, routing, 2)
  assert len(forwards) == 2
  first, second = forwards
  assert any(
    not np.array_equal(first[s].mask, second[s].mask)
    or (first[s].route is not None
        and not np.array_equal(first[s].route, second[s].route))
    for s in first)


@pytest.mark.parametrize("routing, n_forwards", [("all", 1),
                                                 ("uniform_k", 2)])
def test_persistent_draws_share_sources_so_route_all_runs_once(
    chain, routing, n_forwards):
  target = chain[0]
  ci, x = _ci_and_x(chain)
  ctx, seen = _recording(_context(chain, ci, x))
  sources = {s.name: jnp.full((1, s.c + 1), 0.5) for s in target.sites}
  values = {}
  for n_draws in (1, 2):
    del seen[:]
    plan = recon.all_sites_plan(target.sites, routing, n_draws)
    values[n_draws] = float(adversarial.plan_loss(
      ctx, sources, plan, jax.random.key(3)))
  assert len(seen) == n_forwards
  if routing == "all":
    assert values[2] == values[1]


def test_persistent_initial_sources_do_not_depend_on_other_sites(chain):
  """`--sites` picks a subset: the head's initial source is the same whether
  the term covers every site or the head alone, and sites still differ."""
  target = chain[0]
  config = adversarial.PersistentConfig(
    adversary.SourceConfig(scope="bc"), Schedule(0.05))
  states = {}
  for sites in (target.sites, target.sites[2:]):
    term = adversarial.persistent_pgd_term(
      "persistent", 1.0, recon.all_sites_plan(sites), config, sites, True)
    states[len(sites)] = term.init_state(jax.random.key(5), (B,)).sources
  np.testing.assert_array_equal(states[3]["head"].source,
                                states[1]["head"].source)
  assert not np.array_equal(states[3]["l0"].source, states[3]["l1"].source)


def test_fresh_pgd_random_init_follows_draw_paths(chain):
  """A site's fresh random start is keyed by its draw path, so it does not
  change when other sites are left out."""
  target, _ = chain
  paths = {"l0": (0, 0), "l1": (0, 1), "head": (1, 0)}
  sites = tuple(dataclasses.replace(s, draw_path=paths[s.name])
                for s in target.sites)
  ci, x = _ci_and_x(chain)
  ctx = _context(chain, ci, x)
  term = adversarial.fresh_pgd_term(
    "fresh", 1.0, recon.all_sites_plan(sites[2:]),
    adversarial.FreshConfig("random", "bc", n_steps=0), True)
  starts = []
  for subset in (sites, sites[2:]):
    sub_ctx = ctx._replace(target=ctx.target._replace(sites=subset))
    _, sources = term.prepare(sub_ctx, jax.random.key(9), None)
    starts.append(np.asarray(sources[0]["head"]))
  np.testing.assert_array_equal(starts[0], starts[1])


def _terms_by_kind(sites):
  plan = recon.all_sites_plan(sites, "uniform_k", 2)
  persistent = adversarial.PersistentConfig(
    adversary.SourceConfig(scope="c"), Schedule(0.05))
  return {
    "stochastic": (terms.stochastic_recon_term("t", 1.0, plan, True), True),
    "persistent": (adversarial.persistent_pgd_term(
      "t", 1.0, plan, persistent, sites, True), False),
    "merged": (adversarial.persistent_pgd_term(
      "t", 1.0, plan, persistent, sites, True,
      merged=adversarial.Merged(0.5)), True),
    "fresh": (adversarial.fresh_pgd_term(
      "t", 1.0, plan, adversarial.FreshConfig("ones", "c", 0), True),
      True),  # random routing: each draw its own source set
  }


@pytest.mark.parametrize("kind", ["stochastic", "persistent", "merged",
                                  "fresh"])
def test_every_recon_term_averages_through_plan_mean(chain, kind,
                                                     monkeypatch):
  """Each term's value is `recon.plan_mean` over its plan: the one place
  that folds the entry and draw into the keys and averages."""
  target = chain[0]
  term, draws_differ = _terms_by_kind(target.sites)[kind]
  ci, x = _ci_and_x(chain)
  ctx = _context(chain, ci, x)
  key = jax.random.key(11)
  state = (None if term.init_state is None
           else term.init_state(jax.random.key(1), (B,)))
  _, inputs = (None, None) if term.prepare is None else term.prepare(
    ctx, key, state)
  calls = []
  real_plan_mean = recon.plan_mean

  def recording(draw_loss, plan, keys, draws_differ=True):
    value = real_plan_mean(draw_loss, plan, keys, draws_differ)
    calls.append((plan, draws_differ, value))
    return value

  monkeypatch.setattr(recon, "plan_mean", recording)
  value, _ = term.fn(ctx, key, inputs)
  assert [(p, d) for p, d, _ in calls] == [
    (recon.all_sites_plan(target.sites, "uniform_k", 2), draws_differ)]
  assert float(value) == float(calls[0][2])


def test_pgd_probe_averages_through_plan_mean(chain, monkeypatch):
  ci, x = _ci_and_x(chain)
  ctx = _context(chain, ci, x)
  calls = []
  real_plan_mean = recon.plan_mean

  def recording(draw_loss, plan, keys, draws_differ=True):
    calls.append(draws_differ)
    return real_plan_mean(draw_loss, plan, keys, draws_differ)

  monkeypatch.setattr(recon, "plan_mean", recording)
  value = adversarial.pgd_probe(ctx, jax.random.key(2), 0, 0.1)
  # The ascent loop traces once even at 0 steps, then the final divergence.
  assert calls == [False, False] and np.isfinite(float(value))


def test_probe_sources_take_exactly_n_sign_steps():
  """SPEC §5.7: the probe's sources are its `U[0, 1]` draw (one `[C]` row
  per site, shared by the batch) after `n_steps` ascents, each `clip(S + η·sign(∂D/∂S), 0, 1)`; here D is linear, so its
  gradient is a fixed sign pattern and each step is applied by hand."""
  sites = (sites_lib.SiteSpec("a", "a", 0, 2, 2, 3),
           sites_lib.SiteSpec("b", "b", 0, 2, 2, 2))
  signs = {"a": jnp.asarray([1.0, -1.0, 1.0]), "b": jnp.asarray([-1.0, 1.0])}

  def divergence(s):
    return sum(jnp.sum(s[k] * signs[k]) for k in s)

  def probe(n_steps):
    return adversarial.probe_sources(sites, (2,), jax.random.key(5),
                                     divergence, n_steps, 0.25)

  drawn = probe(0)
  paths = sites_lib.draw_paths(sites)
  for s in sites:
    np.testing.assert_array_equal(drawn[s.name], jax.random.uniform(
      sites_lib.fold_path(jax.random.key(5), paths[s.name]), (1, s.c)))
  want = drawn
  for n_steps in (1, 2):
    want = {k: np.clip(v + 0.25 * np.asarray(signs[k]), 0, 1)
            for k, v in want.items()}
    got = probe(n_steps)
    for k in want:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)
