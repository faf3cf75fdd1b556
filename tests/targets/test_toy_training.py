"""Target training and the representation check (SPEC §10)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.targets import registry, resid_mlp, simple_mlp, tms
from decompax.targets import toy_training as train_lib


@pytest.fixture(scope="module")
def trained_tms_5_2():
  toy = registry.get("tms_5-2")
  return toy, toy.train(toy.default_seed)


def test_trained_tms_5_2_default_seed_represents_all_features(trained_tms_5_2):
  toy, weights = trained_tms_5_2
  assert toy.missing_features(weights) == ()


def test_missing_features_detects_zeroed_tms_feature(trained_tms_5_2):
  toy, weights = trained_tms_5_2
  dropped = weights._replace(w=weights.w.at[4].set(0.0))
  assert toy.missing_features(dropped) == (4,)


def test_train_raises_naming_missing_features():
  config = tms.TmsConfig(5, 2,
                         training=train_lib.TargetTraining(steps=2, lr=1e-3))
  toy = registry.build("tms_tiny", tms, config)
  with pytest.raises(
    ValueError,
    match=r"tms_tiny \(seed 3\).*features \[.*"
    r"train it from another seed",
  ):
    toy.train(3)


def test_train_is_deterministic_and_reports_progress():
  config = tms.TmsConfig(
    5,
    2,
    batch_size=64,
    training=train_lib.TargetTraining(steps=20, lr=1e-2, chunk_steps=8),
  )
  seen = []
  a = tms.train(
    jax.random.key(7), config, lambda s, loss: seen.append((s, loss))
  )
  b = tms.train(jax.random.key(7), config)
  assert [s for s, _ in seen] == [8, 16, 20]
  assert all(np.isfinite(loss) for _, loss in seen)
  assert jnp.array_equal(a.w, b.w) and jnp.array_equal(a.b, b.b)
  untrained = tms.init(jax.random.split(jax.random.key(7))[0], config)
  assert not jnp.array_equal(a.w, untrained.w)


def test_progress_reads_the_loss_explicitly(implicit_reads_fail):
  # Under a device-to-host transfer guard, as bin/train once ran it, a
  # float() of the device loss stopped every toy run on an accelerator that
  # trained its own target; a caller may still train under one.
  config = tms.TmsConfig(
    5, 2, batch_size=64,
    training=train_lib.TargetTraining(steps=8, lr=1e-2, chunk_steps=8),
  )
  seen = []
  with implicit_reads_fail():
    tms.train(jax.random.key(7), config, lambda s, loss: seen.append(loss))
  assert len(seen) == 1 and np.isfinite(seen[0])


def test_resid_training_keeps_embedding_and_kappa_fixed():
  config = resid_mlp.ResidMlpConfig(
    2,
    6,
    3,
    d_embed=8,
    in_bias=True,
    feature_probability=0.2,
    kappa_high=2.0,
    batch_size=32,
    training=train_lib.TargetTraining(steps=10, lr=1e-2, schedule="cosine"),
  )
  key = jax.random.key(2)
  before = resid_mlp.init(jax.random.split(key)[0], config)
  after = resid_mlp.train(key, config)
  assert jnp.array_equal(before.w_e, after.w_e)
  assert jnp.array_equal(before.kappa, after.kappa)
  assert not jnp.array_equal(before.w_in, after.w_in)
  assert not jnp.array_equal(before.b_in, after.b_in)
  np.testing.assert_allclose(jnp.linalg.norm(after.w_e, axis=1), 1.0, rtol=1e-6)
  assert float(after.kappa.min()) >= 1.0 and float(after.kappa.max()) <= 2.0


def test_cosine_schedule_ends_at_zero():
  config = train_lib.TargetTraining(steps=5, lr=0.1, schedule="cosine")
  opt = train_lib.optimizer(config)
  params = {"p": jnp.ones(3)}
  state = opt.init(params)
  for _ in range(config.steps):
    updates, state = opt.update({"p": jnp.ones(3)}, state, params)
  # The last step's learning rate is 0, so its update is exactly zero.
  assert jnp.array_equal(updates["p"], jnp.zeros(3))
  with pytest.raises(ValueError, match="schedule"):
    train_lib.TargetTraining(steps=5, lr=0.1, schedule="linear")


def _perfect_resid(n):
  """Return a resid MLP computing `x + relu(κx)` exactly (w_e = I)."""
  kappa = jnp.linspace(1.0, 2.0, n)
  return resid_mlp.ResidMlpWeights(
    w_e=jnp.eye(n),
    w_in=jnp.eye(n)[None],
    w_out=jnp.diag(kappa)[None],
    kappa=kappa,
    b_in=jnp.zeros((1, n)),
  )


def test_resid_missing_features_on_hand_built_models():
  weights = _perfect_resid(6)
  x = jax.random.uniform(jax.random.key(0), (8, 6), minval=-1)
  np.testing.assert_allclose(
    resid_mlp.forward(weights, x),
    resid_mlp.labels(weights.kappa, x),
    rtol=1e-6,
  )
  assert resid_mlp.missing_features(weights) == ()
  dropped = weights._replace(w_in=weights.w_in.at[0, 2, 2].set(0.0))
  assert resid_mlp.missing_features(dropped) == (2,)
  # A constant bias output is not a contribution.
  biased = dropped._replace(b_in=dropped.b_in.at[0, 2].set(3.0))
  assert resid_mlp.missing_features(biased) == (2,)
  overshoot = weights._replace(w_out=weights.w_out.at[0, 5, 5].mul(4.0))
  assert resid_mlp.missing_features(overshoot) == (5,)


def test_simple_missing_features_on_hand_built_models():
  n = 5
  weights = simple_mlp.SimpleMlpWeights(
    w=(jnp.eye(n), jnp.eye(n)), b=(jnp.zeros(n), jnp.zeros(n))
  )
  assert simple_mlp.missing_features(weights) == ()
  dropped = weights._replace(w=(weights.w[0].at[1].set(0.0), weights.w[1]))
  assert simple_mlp.missing_features(dropped) == (1,)


def test_tms_missing_features_on_hand_built_models():
  weights = tms.TmsWeights(w=jnp.eye(4), b=jnp.zeros(4), hidden=jnp.eye(4))
  assert tms.missing_features(weights) == ()
  dropped = weights._replace(w=weights.w.at[3].set(0.0))
  assert tms.missing_features(dropped) == (3,)
  weak = weights._replace(w=weights.w.at[0].mul(0.5))
  assert tms.missing_features(weak) == (0,)
