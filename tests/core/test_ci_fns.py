"""MLP CI functions (SPEC §4.2, I7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, sites as sites_lib

SITES = (sites_lib.SiteSpec("a", "a", 0, 4, 3, 5),
         sites_lib.SiteSpec("b", "b", 0, 3, 4, 2))


def _inputs():
  return {"a": jax.random.normal(jax.random.key(1), (6, 4)),
          "b": jax.random.normal(jax.random.key(2), (6, 3))}


@pytest.mark.parametrize("kind,hidden", [
  ("component_mlp", (8,)), ("vector_mlp", (8,)), ("site_mlp", (8, 4)),
  ("site_mlp", ()), ("global_mlp", (8,)),
])
def test_i7_outputs_partition_sites_with_their_c(kind, hidden):
  fn = ci_fns.make_ci_fn(ci_fns.CIConfig(kind, hidden), SITES)
  comps = sites_lib.init_components(jax.random.key(0), SITES)
  pre = jax.jit(fn.apply)(fn.init(jax.random.key(3)), _inputs(), comps)
  assert set(pre) == {"a", "b"}
  assert pre["a"].shape == (6, 5) and pre["b"].shape == (6, 2)
  assert fn.input_taps == ("a", "b")


def test_component_mlp_matches_per_component_loop_and_feeds_v():
  fn = ci_fns.make_ci_fn(ci_fns.CIConfig("component_mlp", (8,)), SITES)
  params = fn.init(jax.random.key(3))
  comps = sites_lib.init_components(jax.random.key(0), SITES)
  x = _inputs()
  pre = fn.apply(params, x, comps)["a"]
  p = params["a"]
  inner = x["a"] @ comps["a"].v[0]
  for c in range(5):
    hidden = jax.nn.gelu(inner[:, c:c + 1] * p.w_in[c] + p.b_in[c],
                         approximate=False)
    np.testing.assert_allclose(pre[:, c], hidden @ p.w_out[c] + p.b_out[c],
                               rtol=1e-5, atol=1e-6)
  grad_v = jax.grad(lambda c: jnp.sum(fn.apply(params, x, c)["a"]))(comps)
  assert float(jnp.abs(grad_v["a"].v).sum()) > 0


def test_init_gains_and_zero_biases():
  params = ci_fns.init_component_mlp(jax.random.key(0), 2000, 16)
  np.testing.assert_allclose(jnp.std(params.w_in), np.sqrt(2.0), rtol=0.03)
  np.testing.assert_allclose(jnp.std(params.w_out), 1 / 4, rtol=0.03)
  assert not params.b_in.any() and not params.b_out.any()


def test_config_refuses_bad_kinds_and_widths():
  with pytest.raises(ValueError, match="unknown CI function"):
    ci_fns.CIConfig("lstm", (4,))
  with pytest.raises(ValueError, match="one hidden width"):
    ci_fns.CIConfig("component_mlp", (4, 4))
