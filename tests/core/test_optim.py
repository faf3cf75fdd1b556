"""Clipping and AdamW (SPEC §6.3, I30, I31)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decompax.core import optim
from decompax.core.schedules import Schedule


def test_i30_clip_coefficient_uses_eps_after_norm():
  g = {"a": jnp.array([3.0, 4.0])}
  tx = optim.clip_by_global_norm(1.0)
  out, _ = tx.update(g, tx.init(g))
  np.testing.assert_allclose(out["a"], g["a"] * (1.0 / (5.0 + 1e-6)), rtol=1e-7)
  small_g = {"a": jnp.array([0.1, 0.0], jnp.float32)}
  small, _ = tx.update(small_g, tx.init(g))
  np.testing.assert_array_equal(small["a"], small_g["a"])
  # At a norm of 5e-4 the 1e-6 moves the factor by 2e-3, far above fp32.
  tiny = {"a": jnp.array([3e-4, 4e-4])}
  tx = optim.clip_by_global_norm(1e-4)
  out, _ = tx.update(tiny, tx.init(tiny))
  np.testing.assert_allclose(
    out["a"], np.array([3e-4, 4e-4]) * 1e-4 / (5e-4 + 1e-6), rtol=1e-5)
  assert not np.allclose(out["a"], np.array([3e-4, 4e-4]) * 1e-4 / 5e-4,
                         rtol=1e-4, atol=0)


def test_i31_adamw_first_step_matches_formula_and_schedule():
  cfg = optim.AdamWConfig(lr=Schedule(0.1, "linear", final_frac=0.0),
                          weight_decay=0.5)
  tx = optim.adamw(cfg, total_steps=3)
  params = {"w": jnp.array([2.0])}
  g = {"w": jnp.array([0.3])}
  state = tx.init(params)
  upd, state = tx.update(g, state, params)
  # m̂/(√v̂+ε) = sign(g) at t=1; decoupled decay adds wd·θ; lr = sched(0).
  expected = -0.1 * (0.3 / (0.3 + 1e-8) + 0.5 * 2.0)
  # fp32 bias corrections (1 − 0.999 rounds at 1e-5 relative).
  assert float(upd["w"][0]) == pytest.approx(expected, rel=1e-5)
  p1 = optax.apply_updates(params, upd)
  upd2, _ = tx.update(g, state, p1)
  # Second update uses lr = sched(1) = 0.05.
  m = 0.1 * 0.3 + 0.9 * 0.1 * 0.3
  m_hat = m / (1 - 0.9**2)
  v_hat = (0.001 * 0.09 + 0.999 * 0.001 * 0.09) / (1 - 0.999**2)
  exp2 = -0.05 * (m_hat / (np.sqrt(v_hat) + 1e-8) + 0.5 * float(p1["w"][0]))
  assert float(upd2["w"][0]) == pytest.approx(exp2, rel=1e-5)


def test_i31_no_weight_decay_by_default():
  cfg = optim.AdamWConfig(lr=Schedule(1.0))
  assert cfg.weight_decay == 0.0
  tx = optim.adamw(cfg, total_steps=1)
  params = {"w": jnp.array([5.0])}
  upd, _ = tx.update({"w": jnp.array([1e-3])}, tx.init(params), params)
  assert float(upd["w"][0]) == pytest.approx(-1.0, rel=1e-4)


def test_newton_schulz_orthogonalises_batched_and_tall():
  g = jax.random.normal(jax.random.key(0), (3, 8, 4))
  x = optim.newton_schulz(g)
  assert x.shape == g.shape
  # Singular values land near 1 (the quintic's band is about [0.7, 1.2]).
  s = np.linalg.svd(np.asarray(x), compute_uv=False)
  assert s.min() > 0.5 and s.max() < 1.3
  np.testing.assert_array_equal(optim.newton_schulz(jnp.zeros((4, 2))),
                                jnp.zeros((4, 2)))


def test_muon_momentum_nesterov_and_scale():
  cfg = optim.MuonConfig(lr=Schedule(1.0))
  tx = optim.scale_by_muon(cfg)
  params = {"m": jnp.zeros((2, 6)), "b": jnp.zeros(3)}
  g = {"m": jax.random.normal(jax.random.key(1), (2, 6)), "b": jnp.ones(3)}
  out, state = tx.update(g, tx.init(params), params)
  expected = np.sqrt(3.0) * optim.newton_schulz(g["m"] + 0.95 * g["m"])
  np.testing.assert_allclose(out["m"], expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(state.momentum["m"], g["m"])
  # Vector leaves fall back to Adam: sign-like first step.
  np.testing.assert_allclose(out["b"], jnp.ones(3), rtol=1e-5)
