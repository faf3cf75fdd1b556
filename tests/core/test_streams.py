"""The multi-stream step of a targeted decomposition (SPEC §6.6, I45)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decompax.core import ci_fns, optim, sites as sites_lib, squash
from decompax.core import step_records, train_step
from decompax.core.masks import SiteMask
from decompax.core.schedules import Schedule
from decompax.core.step_records import StreamSpec

STREAMS = (StreamSpec("target", loss_positions=(2,)),
           StreamSpec("nontarget", delta_pin=True))


def _seen_term(name, stream, seen):
  """A term whose value is the stochastic-free recon of its stream, and
  which records the delta its masked forward receives."""

  def fn(ctx, key):
    del key
    masks = {s.name: SiteMask(ctx.ci.lower[s.name]) for s in ctx.target.sites}
    seen[name] = ctx.pinned(masks)
    return ctx.output_divergence(ctx.masked_forward(masks))

  return step_records.simple_term(name, 1.0, fn)._replace(stream=stream)


def _config(streams=STREAMS, decay=0.0):
  return step_records.StepConfig(
    total_steps=10, components_opt=optim.AdamWConfig(Schedule(1e-2)),
    ci_opt=optim.AdamWConfig(Schedule(1e-2)), streams=streams,
    ci_scaled_decay=decay)


@pytest.fixture(scope="module")
def setup(token_target):
  target, weights = token_target
  ci = ci_fns.make_ci_fn(ci_fns.CIConfig("vector_mlp", (4,)), target.sites)
  comps = sites_lib.init_components(jax.random.key(0), target.sites)
  ci_params = ci.init(jax.random.key(1))
  batches = {"target": jax.random.randint(jax.random.key(2), (3, 4), 0, 6),
             "nontarget": jax.random.randint(jax.random.key(3), (2, 5), 0, 6)}
  return target, weights, ci, comps, ci_params, batches


def _init(built, comps, ci_params, batches):
  # The step donates its state: give it copies of the shared fixtures.
  comps, ci_params = jax.tree.map(jnp.copy, (comps, ci_params))
  return built.init(comps, ci_params, jax.random.key(4),
                    {k: v.shape for k, v in batches.items()})


def test_each_stream_scores_its_own_batch_and_the_nontarget_pins_delta(
    setup):
  target, weights, ci, comps, ci_params, batches = setup
  seen = {}
  terms = (_seen_term("recon", "target", seen),
           _seen_term("nontarget_recon", "nontarget", seen))
  built = train_step.make_train_step(target, ci, terms, _config())
  state = _init(built, comps, ci_params, batches)
  _, metrics = built.step(state, weights, batches)
  # I45: the non-target forward runs δ ≡ 1, the target's is left alone.
  assert all(m.delta is None for m in seen["recon"].values())
  for m in seen["nontarget_recon"].values():
    assert m.delta.shape == batches["nontarget"].shape
  assert set(metrics) >= {"target/loss/recon", "nontarget/loss/recon",
                          "target/ci_l0/mix", "nontarget/ci_l0/head"}
  # Each value is that of its stream's batch alone, at its loss positions.
  for stream, name in (("target", "recon"), ("nontarget", "nontarget_recon")):
    spec = dict((s.name, s) for s in STREAMS)[stream]
    alone = _single_stream_value(target, weights, ci, comps, ci_params,
                                 batches[stream], spec)
    np.testing.assert_allclose(metrics[f"{stream}/loss/recon"], alone,
                               rtol=1e-6)
  np.testing.assert_allclose(
    metrics["loss/total"],
    metrics["target/loss/recon"] + metrics["nontarget/loss/recon"],
    rtol=1e-6)


def _single_stream_value(target, weights, ci, comps, ci_params, tokens,
                         spec):
  """The recon of one stream computed by hand, without the step."""
  clean, taps = target.clean_forward(weights, tokens, ci.input_taps)
  lower = squash.squash(ci.apply(ci_params, taps, comps)).lower
  masks = {s.name: SiteMask(lower[s.name]) for s in target.sites}
  if spec.delta_pin:
    masks = {k: m._replace(delta=jnp.ones(m.mask.shape[:-1]))
             for k, m in masks.items()}
  out = target.masked_forward(weights, comps, tokens, masks)
  if spec.loss_positions is not None:
    pick = jnp.asarray(spec.loss_positions)
    out, clean = out[:, pick], clean[:, pick]
  return target.divergence(out, clean)


def test_one_backward_takes_the_gradient_of_both_streams_sum(setup):
  target, weights, ci, comps, ci_params, batches = setup
  seen = {}
  terms = (_seen_term("recon", "target", seen),
           _seen_term("nontarget_recon", "nontarget", seen))
  built = train_step.make_train_step(target, ci, terms, _config())
  _, metrics = built.step(_init(built, comps, ci_params, batches), weights,
                          batches)

  def total(components):
    return sum(_single_stream_value(target, weights, ci, components,
                                    ci_params, batches[spec.name], spec)
               for spec in STREAMS)

  want = optax.tree.norm(jax.grad(total)(comps))
  np.testing.assert_allclose(metrics["grad_norm/components"], want,
                             rtol=1e-5)


def test_term_keys_follow_the_terms_order_across_streams(setup):
  target, weights, ci, comps, ci_params, batches = setup

  def keyed(name, stream):
    # The value is a draw from the term's key, so the metric shows the key.
    return step_records.simple_term(
      name, 1.0, lambda ctx, key: jax.random.uniform(key))._replace(
        stream=stream)

  terms = (keyed("a", "target"), keyed("b", "target"),
           keyed("nontarget_c", "nontarget"))
  built = train_step.make_train_step(target, ci, terms, _config())
  state = _init(built, comps, ci_params, batches)
  step_key = jax.random.fold_in(state.rng, state.step)
  _, metrics = built.step(state, weights, batches)
  # Non-target term i of a run with two target terms keys `1 + 2 + i`.
  for j, metric in enumerate(("target/loss/a", "target/loss/b",
                              "nontarget/loss/c")):
    want = jax.random.uniform(jax.random.fold_in(step_key, 1 + j))
    assert float(metrics[metric]) == float(want)


def test_a_term_on_an_unknown_stream_is_refused(setup):
  target, _, ci, *_ = setup
  term = step_records.simple_term("x", 1.0, lambda c, k: 0.0)._replace(
    stream="elsewhere")
  with pytest.raises(ValueError, match="stream 'elsewhere'"):
    train_step.make_train_step(target, ci, (term,), _config())


def test_ci_scaled_decay_formula():
  factors = sites_lib.Factors(v=jnp.ones((2, 3, 4)), u=jnp.ones((2, 4, 5)))
  max_ci = {"k": jnp.asarray([[1.0, 0.5, 0.0, 0.25], [0.0] * 4])}
  out = train_step.ci_scaled_decay({"k": factors}, max_ci, 0.1, 2.0)["k"]
  scale = 1.0 - 0.1 * 2.0 * (1.0 - np.asarray(max_ci["k"]))
  np.testing.assert_allclose(out.v, np.broadcast_to(scale[:, None, :],
                                                    (2, 3, 4)), rtol=1e-6)
  np.testing.assert_allclose(out.u, np.broadcast_to(scale[:, :, None],
                                                    (2, 4, 5)), rtol=1e-6)


def test_max_ci_is_taken_over_every_stream_and_position():
  sites = (sites_lib.SiteSpec("a", "k", 0, 2, 2, 3),
           sites_lib.SiteSpec("b", "k", 1, 2, 2, 3))
  one = {"a": jnp.asarray([[[0.1, 0.9, 0.0]]]),
         "b": jnp.asarray([[[0.2, 0.0, 0.0]]])}
  two = {"a": jnp.asarray([[0.5, 0.1, 0.3], [0.0, 0.0, 0.4]]),
         "b": jnp.asarray([[0.0, 0.7, 0.0], [0.0, 0.0, 0.0]])}
  got = train_step.max_ci_per_component(sites, [one, two])["k"]
  np.testing.assert_allclose(got, [[0.5, 0.9, 0.4], [0.2, 0.7, 0.0]])


def test_the_step_applies_the_ci_scaled_decay_after_the_update(setup):
  target, weights, ci, comps, ci_params, batches = setup
  term = step_records.simple_term("zero", 1.0, lambda c, k: jnp.zeros(()))
  term = term._replace(stream="target")
  plain = train_step.make_train_step(target, ci, (term,), _config())
  decayed = train_step.make_train_step(target, ci, (term,),
                                       _config(decay=3.0))
  a, _ = plain.step(_init(plain, comps, ci_params, batches), weights,
                    batches)
  b, _ = decayed.step(_init(decayed, comps, ci_params, batches), weights,
                      batches)
  # With a zero objective the update leaves V/U as they were, so the decay
  # alone tells the two apart, by each component's own factor.
  lowers = []
  for tokens in batches.values():
    _, taps = target.clean_forward(weights, tokens, ci.input_taps)
    lowers.append(squash.squash(ci.apply(ci_params, taps, comps)).lower)
  max_ci = train_step.max_ci_per_component(target.sites, lowers)
  want = train_step.ci_scaled_decay(a.components, max_ci, 1e-2, 3.0)
  for kind in want:
    np.testing.assert_allclose(b.components[kind].v, want[kind].v, rtol=1e-5)
    np.testing.assert_allclose(b.components[kind].u, want[kind].u, rtol=1e-5)


def test_a_term_given_to_both_streams_is_refused_as_a_shared_bundle(setup):
  """I22 across streams: one name on two streams would key one state (an
  adversary's source bundle) for both."""
  target, _, ci, *_ = setup
  one = step_records.simple_term("pgd", 1.0, lambda ctx, key: 0.0)
  with pytest.raises(ValueError, match="would be shared between them"):
    train_step.make_train_step(
      target, ci, (one._replace(stream="target"),
                   one._replace(stream="nontarget")), _config())
