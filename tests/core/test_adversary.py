"""Adversary sources and ascent steps (SPEC §5.6, §5.7, I18, I19)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import adversary


@pytest.mark.parametrize("scope,lead,shape", [
  ("c", (8,), (1, 6)), ("bc", (8,), (8, 6)),
  ("c", (4, 3), (1, 1, 6)), ("bc", (4, 3), (4, 1, 6)),
  ("sc", (4, 3), (1, 3, 6)), ("bsc", (4, 3), (4, 3, 6)),
])
def test_scope_shapes(scope, lead, shape):
  assert adversary.scope_shape(scope, lead, 6) == shape


def test_positionless_refuses_position_scopes():
  with pytest.raises(ValueError, match="positions"):
    adversary.scope_shape("sc", (8,), 3)


def test_inits_follow_parametrization():
  clamp = adversary.init_source(jax.random.key(0), (2000,), "clamp")
  assert 0.0 <= float(clamp.source.min()) and float(clamp.source.max()) <= 1.0
  sig = adversary.init_source(jax.random.key(0), (2000,), "sigmoid")
  assert float(sig.source.min()) < 0.0
  np.testing.assert_allclose(jnp.std(sig.source), 1.0, rtol=0.1)


def test_site_key_depends_on_the_name_alone():
  """Same name, same key whatever else is selected; names differ, keys do."""
  base = jax.random.key(4)
  data = {name: jax.random.key_data(adversary.site_key(base, name))
          for name in ("layers.0.mlp.up", "layers.0.mlp.down", "l0", "l1")}
  np.testing.assert_array_equal(
    data["l0"], jax.random.key_data(adversary.site_key(base, "l0")))
  assert len({tuple(np.asarray(d).ravel()) for d in data.values()}) == 4
  assert not np.array_equal(
    data["l0"], jax.random.key_data(adversary.site_key(jax.random.key(5),
                                                       "l0")))


def test_i19_adam_ascent_divides_by_sqrt_vhat_plus_eps():
  cfg = adversary.SourceConfig(parametrization="sigmoid", b1=0.5, b2=0.99,
                               eps=0.1)
  state = adversary.SourceState(jnp.zeros(1), jnp.zeros(1), jnp.zeros(1))
  g = jnp.array([0.04])
  out = adversary.ascend(state, g, 0, 1.0, cfg)
  # t = 1: m̂ = g, v̂ = g², step = g / (|g| + eps).
  assert float(out.source[0]) == pytest.approx(0.04 / (0.04 + 0.1), rel=1e-5)
  # eps inside the root would give g / sqrt(g² + eps) instead.
  assert float(out.source[0]) != pytest.approx(0.04 / np.sqrt(0.0016 + 0.1), rel=1e-2)


@pytest.mark.parametrize("step_rule", ["sign", "adam"])
def test_i18_every_clamp_ascent_ends_with_the_projection(step_rule):
  """Each ascent equals `clip(S + lr·step, 0, 1)` of a hand-computed step;
  the steps are large enough that most values leave [0, 1] unprojected."""
  cfg = adversary.SourceConfig(step_rule=step_rule)
  state = adversary.init_source(jax.random.key(0), (100,), "clamp")
  source = np.asarray(state.source, np.float64)
  m = v = np.zeros(100)
  g = np.asarray(jax.random.normal(jax.random.key(1), (100,)), np.float64)
  clipped = 0
  for i in range(5):
    state = adversary.ascend(state, jnp.asarray(g, jnp.float32), i, 0.7, cfg)
    if step_rule == "sign":
      step = np.sign(g)
    else:
      t = i + 1
      m = cfg.b1 * m + (1 - cfg.b1) * g
      v = cfg.b2 * v + (1 - cfg.b2) * g * g
      step = (m / (1 - cfg.b1**t)) / (np.sqrt(v / (1 - cfg.b2**t)) + cfg.eps)
    unprojected = source + 0.7 * step
    clipped += np.sum((unprojected < 0) | (unprojected > 1))
    source = np.clip(unprojected, 0.0, 1.0)
    np.testing.assert_allclose(state.source, source, rtol=1e-5, atol=1e-6)
  assert clipped > 100


def test_sign_step_moves_by_lr_times_sign():
  cfg = adversary.SourceConfig(parametrization="sigmoid", step_rule="sign")
  state = adversary.SourceState(jnp.zeros(3), jnp.zeros(3), jnp.zeros(3))
  out = adversary.ascend(state, jnp.array([-2.0, 0.0, 3.0]), 0, 0.1, cfg)
  np.testing.assert_allclose(out.source, [-0.1, 0.0, 0.1])


def test_effective_and_fresh_pgd_step():
  np.testing.assert_allclose(adversary.effective(jnp.zeros(1), "sigmoid"), [0.5])
  s = adversary.sign_pgd_step(jnp.array([0.95, 0.5]), jnp.array([1.0, -1.0]), 0.1)
  np.testing.assert_allclose(s, [1.0, 0.4])


def test_config_refuses_unknown_values():
  with pytest.raises(ValueError, match="scope"):
    adversary.SourceConfig(scope="bs")
