"""The step factory on a tiny chain target (SPEC §6.1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, optim, sites as sites_lib, train_step
from decompax.core import step_records
from decompax.core.schedules import Schedule
from decompax.core.masks import SiteMask


def _recon_like_term():
  """A term reading CI, masks and the masked forward: all-ones-mask MSE."""

  def fn(ctx, key):
    del key
    out = ctx.masked_forward(
      {s.name: SiteMask(ctx.ci.lower[s.name]) for s in ctx.target.sites})
    return jnp.mean(jnp.square(out - ctx.clean_output))

  return step_records.simple_term("recon", 1.0, fn)


def _build(chain, terms, **step_options):
  target, _ = chain
  ci = ci_fns.make_ci_fn(ci_fns.CIConfig("component_mlp", (4,)), target.sites)
  cfg = step_records.StepConfig(
    total_steps=10,
    components_opt=optim.AdamWConfig(Schedule(1e-2), clip_max_norm=1.0),
    ci_opt=optim.AdamWConfig(Schedule(1e-2)),
  )
  return ci, train_step.make_train_step(target, ci, terms, cfg,
                                        **step_options)


def _state(chain, ci, built):
  target, _ = chain
  comps = sites_lib.init_components(jax.random.key(0), target.sites)
  return built.init(comps, ci.init(jax.random.key(1)), jax.random.key(2))


def test_step_updates_everything_and_counts(chain):
  target, weights = chain
  ci, built = _build(chain, (_recon_like_term(),))
  state = _state(chain, ci, built)
  before = jax.tree.map(np.asarray, state._replace(rng=None))
  x = jax.random.normal(jax.random.key(3), (8, 4))
  state, metrics = built.step(state, weights, x)
  assert int(state.step) == 1
  assert not np.allclose(state.components["sq"].v, before.components["sq"].v)
  assert not np.allclose(state.ci_params["l0"].w_in, before.ci_params["l0"].w_in)
  for key in ("loss/total", "loss/recon", "ci_l0/l0", "ci_l0/head",
              "grad_norm/components", "lr/components"):
    assert key in metrics and np.isfinite(float(metrics[key]))


def test_step_traces_once_and_takes_weights_as_arguments(chain):
  target, weights = chain
  ci, built = _build(chain, (_recon_like_term(),))
  state = _state(chain, ci, built)
  x = jax.random.normal(jax.random.key(3), (8, 4))
  state, _ = built.step(state, weights, x)
  state, _ = built.step(state, weights, x + 1.0)
  assert built.step._cache_size() == 1
  # Frozen weights are runtime arguments: they appear as parameters of the
  # lowered module, not as baked constants.
  assert _main_arguments(built.step.lower(state, weights, x)).count(
    "tensor<2x4x4xf32>") == 1
  # The check sees the difference: closed over, they are not parameters.
  baked = jax.jit(lambda s, inputs: built.step(s, weights, inputs))
  assert "tensor<2x4x4xf32>" not in _main_arguments(baked.lower(state, x))


def _main_arguments(lowered) -> str:
  """Return the argument list of the lowered module's entry function."""
  (line,) = [l for l in lowered.as_text().splitlines()
             if "func.func public @main(" in l]
  return line.split("@main(", 1)[1].split(") -> ", 1)[0]


def test_duplicate_term_names_are_refused(chain):
  with pytest.raises(ValueError, match="unique"):
    _build(chain, (_recon_like_term(), _recon_like_term()))


def test_ci_l0_counts_components_above_threshold():
  ci = {"a": jnp.array([[0.0, 0.5, 1.0], [0.0, 0.0, 0.2]])}
  assert float(train_step.ci_l0(ci, 0.0)["a"]) == pytest.approx(1.5)
  assert float(train_step.ci_l0(ci, 0.3)["a"]) == pytest.approx(1.0)


def test_model_side_coefficient_scales_params_not_inputs(chain):
  """SPEC §5.6 / I20: the inputs' gradient is unscaled, even at coeff 0."""
  target, weights = chain

  def fn(ctx, key, inputs):
    del key
    masks = {s.name: SiteMask(ctx.ci.lower[s.name] * inputs[s.name])
             for s in ctx.target.sites}
    out = ctx.masked_forward(masks)
    return jnp.mean(jnp.square(out - ctx.clean_output)), None

  def prepare(ctx, key, state):
    del key
    return state, {s.name: jnp.full((8, 5), 0.5) for s in ctx.target.sites}

  def finish(ctx, key, state, inputs, grads, aux):
    del ctx, key, state, inputs, aux
    return grads  # the test reads the inputs' gradient back from the state

  def init_state(key, lead_shape):
    del key
    return {s.name: jnp.zeros((*lead_shape, 5)) for s in target.sites}

  def build(coeff):
    term = step_records.LossTerm("adv", coeff, fn, init_state, prepare, finish,
                                 coeff_on_model_side=True)
    ci, built = _build(chain, (term,))
    target_, _ = chain
    comps = sites_lib.init_components(jax.random.key(0), target_.sites)
    state = built.init(comps, ci.init(jax.random.key(1)), jax.random.key(2),
                       (8,))
    before = jax.tree.map(np.asarray, state._replace(rng=None))
    x = jax.random.normal(jax.random.key(3), (8, 4))
    new_state, _ = built.step(state, weights, x)
    return new_state.term_states["adv"], new_state, before

  g0, after0, before0 = build(0.0)
  g1, after1, _ = build(1.0)
  for site in g0:
    np.testing.assert_allclose(g0[site], g1[site], rtol=1e-6)
    assert float(jnp.abs(g0[site]).sum()) > 0
  # Coefficient 0 leaves the CI params' gradient zero: Adam moves nothing.
  np.testing.assert_array_equal(after0.ci_params["l0"].w_in,
                                before0.ci_params["l0"].w_in)
  assert not np.allclose(after1.ci_params["l0"].w_in,
                         before0.ci_params["l0"].w_in)



def _key_reporting_terms():
  """Term `a` reports the key its step hands it; term `b` keeps, as its
  state, the key its initial state was drawn from."""

  def report_key(ctx, key, inputs):
    del ctx, inputs
    return jnp.zeros(()), jax.random.key_data(key).astype(jnp.float32)

  def keep_key(ctx, key, inputs):
    del ctx, key, inputs
    return jnp.zeros(()), None

  a = step_records.LossTerm("a", 1.0, report_key, report=lambda aux: {
    "key0": aux[0], "key1": aux[1]})
  b = step_records.LossTerm("b", 1.0, keep_key, init_state=lambda key, lead: (
    jax.random.key_data(key).astype(jnp.float32)))
  return a, b


def test_no_step_replays_the_term_states_initial_draws(chain):
  # Term states were once drawn from fold_in(run_key, 0x5EED), which is
  # also the key of step 0x5EED = 24301: term b's initial draw was term a's
  # draw at that step.
  target, weights = chain
  ci, built = _build(chain, _key_reporting_terms())
  state = _state(chain, ci, built)
  initial = np.asarray(state.term_states["b"])
  for step in (0, 1, 0x5EED):
    _, metrics = built.step(jax.tree.map(jnp.copy, state._replace(
      step=jnp.asarray(step, jnp.int32))), weights, jnp.ones((8, 4)))
    drawn = np.array([float(metrics["loss/key0"]), float(metrics["loss/key1"])])
    assert not np.array_equal(drawn, initial), step


def test_term_states_are_keyed_by_name_and_hold_stateful_terms_only(chain):
  ci, built = _build(chain, _key_reporting_terms())
  state = _state(chain, ci, built)
  assert list(state.term_states) == ["b"]
  # Term b is second: its state draws from position 1 of the state stream.
  stream = jax.random.fold_in(jax.random.key(2), train_step.TERM_STATE_STREAM)
  np.testing.assert_array_equal(
    state.term_states["b"],
    jax.random.key_data(jax.random.fold_in(stream, 1)).astype(jnp.float32))


def test_finish_is_handed_the_key_its_term_saw(chain):
  """`finish` gets the step's key for its term as an argument: the one
  `prepare` and `fn` were handed."""
  _, weights = chain

  def fn(ctx, key, inputs):
    del ctx
    return jnp.zeros(()), {"fn": jax.random.key_data(key), "prepare": inputs}

  def prepare(ctx, key, state):
    del ctx
    return state, jax.random.key_data(key)

  def finish(ctx, key, state, inputs, grads, aux):
    del ctx, state, inputs, grads
    return jnp.stack([jax.random.key_data(key), aux["fn"], aux["prepare"]])

  term = step_records.LossTerm(
    "k", 1.0, fn, init_state=lambda key, lead: jnp.zeros((3, 2), jnp.uint32),
    prepare=prepare, finish=finish)
  ci, built = _build(chain, (_recon_like_term(), term))
  state = _state(chain, ci, built)
  after, _ = built.step(state, weights, jnp.ones((8, 4)))
  step_key = jax.random.fold_in(jax.random.key(2), 0)
  want = jax.random.key_data(jax.random.fold_in(step_key, 1 + 1))
  np.testing.assert_array_equal(after.term_states["k"],
                                np.stack([want] * 3))


def test_a_finish_without_a_state_is_refused(chain):
  term = step_records.LossTerm(
    "f", 1.0, lambda ctx, key, inputs: (jnp.zeros(()), None),
    finish=lambda ctx, key, state, inputs, grads, aux: state)
  with pytest.raises(ValueError, match="finish but no init_state"):
    _build(chain, (term,))


def _key_term():
  """A term whose value is a draw from the key the step hands it."""

  def fn(ctx, key):
    del ctx
    return jax.random.uniform(key)

  return step_records.simple_term("draw", 1.0, fn)


def test_each_step_draws_from_its_own_key(chain):
  """R2: a term's key comes from the run's key and the step, folded in
  per term (`fold_in(fold_in(rng, step), 1 + j)`): new draws every step,
  the same draws at the same step, whatever came before."""
  target, weights = chain
  ci, built = _build(chain, (_key_term(),))
  start = _state(chain, ci, built)
  x = jax.random.normal(jax.random.key(3), (8, 4))
  rng = np.asarray(jax.random.key_data(start.rng))  # the step donates it
  later = jax.tree.map(jnp.copy, start)._replace(step=jnp.asarray(5))
  draws = []
  state = start
  for _ in range(2):
    state, metrics = built.step(state, weights, x)
    draws.append(float(metrics["loss/draw"]))
  _, at_5 = built.step(later, weights, x)
  want = [float(jax.random.uniform(jax.random.fold_in(jax.random.fold_in(
    jax.random.wrap_key_data(rng), s), 1))) for s in (0, 1, 5)]
  assert draws[0] != draws[1]
  np.testing.assert_array_equal([*draws, float(at_5["loss/draw"])], want)


def test_steps_are_bitwise_the_single_steps_in_one_program(
    chain, assert_bitwise_equal):
  """`TrainStep.steps`: n sampled steps in one call end in the very state
  and last metrics of n calls of the step, whatever each call's length, one
  trace and one program for every length, the frozen weights an argument
  of it and nothing read back to the host inside it."""
  _, weights = chain
  ci, built = _build(
    chain, (_recon_like_term(), _key_term()),
    sample_inputs=lambda key: jax.random.normal(key, (8, 4)), max_traces=1)
  start = _state(chain, ci, built)
  key = jax.random.key(3)
  lowered = built.steps.lower(start, weights, key, 1).as_text()
  assert _main_arguments(built.steps.lower(start, weights, key, 1)).count(
    "tensor<2x4x4xf32>") == 1
  assert "callback" not in lowered
  single, metrics = jax.tree.map(jnp.copy, start), []
  for _ in range(6):
    single, m = built.step(single, weights, key)
    metrics.append(m)
  state = start
  for n, last in ((1, 0), (3, 3), (2, 5)):
    state, m = built.steps(state, weights, key, n)
    assert_bitwise_equal(m, metrics[last])
  assert int(state.step) == 6
  assert_bitwise_equal(state, single)
  assert built.steps._cache_size() == 1
