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


def test_i18_clamp_sources_stay_in_unit_interval():
  cfg = adversary.SourceConfig(step_rule="sign")
  state = adversary.init_source(jax.random.key(0), (100,), "clamp")
  g = jax.random.normal(jax.random.key(1), (100,))
  for i in range(5):
    state = adversary.ascend(state, g, i, 0.7, cfg)
    assert float(state.source.min()) >= 0.0 and float(state.source.max()) <= 1.0


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
