"""Forward semantics of every toy target on tiny shapes (SPEC §3, I2, I3)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import factored, sites
from decompax.core.masks import SiteMask
from decompax.targets import resid_mlp, simple_mlp, tms

TOYS = {
  "tms": (tms, tms.TmsConfig(5, 2)),
  "tms_id": (tms, tms.TmsConfig(5, 3, hidden_identity=True)),
  "resid2": (resid_mlp, resid_mlp.ResidMlpConfig(2, 6, 3, d_embed=8)),
  "resid1_out_bias": (
    resid_mlp,
    resid_mlp.ResidMlpConfig(1, 5, 4, d_embed=7, in_bias=False, out_bias=True),
  ),
  "simple": (simple_mlp, simple_mlp.SimpleMlpConfig(6, (4, 5))),
}


@functools.cache
def _toy(name):
  """Return `(module, config, weights, x)`; cached, as every use is pure."""
  module, config = TOYS[name]
  weights = jax.jit(module.init, static_argnums=1)(jax.random.key(1), config)
  # Dense inputs exercise every path; sparse ones are mostly zero.
  x = jax.random.uniform(jax.random.key(2), (4, config.n_features), minval=-1)
  return module, config, weights, x


def _exact_components(stacks):
  """Return SVD factors with `V·U = W` (C = min(d_in, d_out)) per kind."""
  out = {}
  for kind, w in stacks.items():
    left, s, right = jnp.linalg.svd(w, full_matrices=False)
    out[kind] = sites.Factors(v=left * s[:, None, :], u=right)
  return out


def _exact_c(module, config):
  specs = module.site_specs(config, 1)
  return {s.name: min(s.d_in, s.d_out) for s in specs}


def _all_live(specs, lead, mask=1.0, delta=None, route=None):
  return {
    s.name: SiteMask(
      mask=jnp.full(lead + (s.c,), mask),
      delta=None if delta is None else jnp.full(lead, delta),
      route=None if route is None else jnp.full(lead, route),
    )
    for s in specs
  }


def _reference_site_inputs(module, weights, x):
  """Return each site's input, computed by hand from the model's definition."""
  if module is tms:
    h = x @ weights.w
    if weights.hidden is None:
      return {"linear1": x, "linear2": h}
    return {"linear1": x, "hidden_layers.0": h, "linear2": h @ weights.hidden}
  if module is resid_mlp:
    taps, r = {}, x @ weights.w_e
    for i in range(weights.w_in.shape[0]):
      taps[f"layers.{i}.mlp_in"] = r
      pre = r @ weights.w_in[i]
      if weights.b_in is not None:
        pre = pre + weights.b_in[i]
      h = jnp.maximum(pre, 0)
      taps[f"layers.{i}.mlp_out"] = h
      r = r + h @ weights.w_out[i]
      if weights.b_out is not None:
        r = r + weights.b_out[i]
    return taps
  taps, h = {}, x
  for i, (w, b) in enumerate(zip(weights.w, weights.b)):
    taps[f"layers.{i}"] = h
    h = jnp.maximum(h @ w + b, 0)
  return taps


@pytest.mark.parametrize("name", list(TOYS))
def test_sites_and_stacks_shapes(name):
  module, config, weights, _ = _toy(name)
  specs = module.site_specs(config, 3)
  sites.validate_sites(specs)
  stacks = module.frozen_stacks(weights)
  kinds = sites.kind_specs(specs)
  assert list(stacks) == list(kinds)
  for kind, spec in kinds.items():
    assert stacks[kind].shape == (spec.n, spec.d_in, spec.d_out)
    assert spec.c == 3


def test_site_order_and_kinds():
  def names(module, config):
    return [(s.name, s.kind, s.row) for s in module.site_specs(config, 2)]

  assert names(tms, TOYS["tms_id"][1]) == [
    ("linear1", "linear1", 0),
    ("hidden_layers.0", "hidden_layers.0", 0),
    ("linear2", "linear2", 0),
  ]
  assert names(resid_mlp, TOYS["resid2"][1]) == [
    ("layers.0.mlp_in", "mlp_in", 0),
    ("layers.0.mlp_out", "mlp_out", 0),
    ("layers.1.mlp_in", "mlp_in", 1),
    ("layers.1.mlp_out", "mlp_out", 1),
  ]
  assert names(simple_mlp, TOYS["simple"][1]) == [
    ("layers.0", "layers.0", 0),
    ("layers.1", "layers.1", 0),
    ("layers.2", "layers.2", 0),
  ]


def test_c_per_site_dict_and_errors():
  config = TOYS["tms"][1]
  specs = tms.site_specs(config, {"linear1": 4, "linear2": 6})
  assert [s.c for s in specs] == [4, 6]
  with pytest.raises(ValueError, match="missing"):
    tms.site_specs(config, {"linear1": 4})
  with pytest.raises(ValueError, match="same|share"):
    # Sites of one kind must share C.
    resid_mlp.site_specs(
      TOYS["resid2"][1],
      {
        "layers.0.mlp_in": 2,
        "layers.0.mlp_out": 2,
        "layers.1.mlp_in": 3,
        "layers.1.mlp_out": 2,
      },
    )


@pytest.mark.parametrize("name", list(TOYS))
def test_clean_taps_are_site_inputs(name):
  module, config, weights, x = _toy(name)
  fns = module.target_fns(config, 2)
  wanted = tuple(s.name for s in fns.sites)
  y, taps = jax.jit(fns.clean_forward, static_argnums=2)(weights, x, wanted)
  reference = _reference_site_inputs(module, weights, x)
  # jit returns dicts with sorted keys; order carries no meaning.
  assert sorted(taps) == sorted(wanted) == sorted(reference)
  for key in wanted:
    np.testing.assert_allclose(factored.dense(taps[key]), reference[key],
                               rtol=1e-5, atol=1e-6)
  y_plain, no_taps = fns.clean_forward(weights, x, ())
  assert no_taps == {}
  np.testing.assert_allclose(y, y_plain, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(y, module.forward(weights, x), atol=1e-6)


@pytest.mark.parametrize("name", ["tms_id", "resid2"])
def test_clean_forward_rejects_unknown_tap(name):
  module, config, weights, x = _toy(name)
  fns = module.target_fns(config, 2)
  with pytest.raises(ValueError, match="unknown tap"):
    fns.clean_forward(weights, x, ("linear3",))


@pytest.mark.parametrize("name", list(TOYS))
def test_masked_with_no_live_site_is_clean_bitwise(name):
  """SPEC I2: an empty live set runs the identical frozen ops."""
  module, config, weights, x = _toy(name)
  fns = module.target_fns(config, 3)
  components = sites.init_components(jax.random.key(5), fns.sites)
  clean, _ = jax.jit(fns.clean_forward, static_argnums=2)(weights, x, ())
  masked = jax.jit(fns.masked_forward)(weights, components, x, {})
  assert jnp.array_equal(masked, clean)


@pytest.mark.parametrize("name", list(TOYS))
def test_I3_all_live_mask_one_delta_one_is_clean(name):
  """SPEC I3: m ≡ 1, δ ≡ 1, route ≡ true reproduce x·W for any factors."""
  module, config, weights, x = _toy(name)
  fns = module.target_fns(config, 3)
  components = sites.init_components(jax.random.key(5), fns.sites)
  masks = _all_live(fns.sites, fns.batch_lead_shape(x), delta=1.0)
  clean, _ = fns.clean_forward(weights, x, ())
  masked = jax.jit(fns.masked_forward)(weights, components, x, masks)
  np.testing.assert_allclose(masked, clean, rtol=1e-5, atol=1e-5)
  assert fns.divergence(masked, clean) < 1e-10


@pytest.mark.parametrize("name", list(TOYS))
def test_I3_exact_factors_with_delta_is_clean(name):
  """SPEC I3 with an exact decomposition (V·U = W), mask 1, delta 1."""
  module, config, weights, x = _toy(name)
  fns = module.target_fns(config, _exact_c(module, config))
  components = _exact_components(fns.frozen_stacks(weights))
  masks = _all_live(fns.sites, fns.batch_lead_shape(x), delta=1.0)
  clean, _ = fns.clean_forward(weights, x, ())
  masked = jax.jit(fns.masked_forward)(weights, components, x, masks)
  np.testing.assert_allclose(masked, clean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(TOYS))
def test_exact_factors_all_ones_mask_without_delta_is_clean(name):
  module, config, weights, x = _toy(name)
  fns = module.target_fns(config, _exact_c(module, config))
  components = _exact_components(fns.frozen_stacks(weights))
  masks = _all_live(fns.sites, fns.batch_lead_shape(x))
  clean, _ = fns.clean_forward(weights, x, ())
  masked = jax.jit(fns.masked_forward)(weights, components, x, masks)
  np.testing.assert_allclose(masked, clean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(TOYS))
def test_route_false_everywhere_is_clean(name):
  module, config, weights, x = _toy(name)
  fns = module.target_fns(config, 3)
  components = sites.init_components(jax.random.key(5), fns.sites)
  masks = _all_live(
    fns.sites, fns.batch_lead_shape(x), mask=0.3, delta=0.7, route=False
  )
  clean, _ = fns.clean_forward(weights, x, ())
  masked = fns.masked_forward(weights, components, x, masks)
  assert jnp.array_equal(masked, clean)


@pytest.mark.parametrize("name", ["tms_id", "resid2", "simple"])
def test_zero_mask_on_one_site_changes_output(name):
  module, config, weights, x = _toy(name)
  fns = module.target_fns(config, _exact_c(module, config))
  components = _exact_components(fns.frozen_stacks(weights))
  first = fns.sites[0]
  masks = {first.name: SiteMask(mask=jnp.zeros((x.shape[0], first.c)))}
  clean, _ = fns.clean_forward(weights, x, ())
  masked = fns.masked_forward(weights, components, x, masks)
  assert fns.divergence(masked, clean) > 1e-4


def test_masked_forward_rejects_unknown_live_site():
  module, config, weights, x = _toy("tms")
  fns = module.target_fns(config, 2)
  components = sites.init_components(jax.random.key(5), fns.sites)
  with pytest.raises(ValueError, match="unknown live sites"):
    fns.masked_forward(
      weights, components, x, {"linear9": SiteMask(mask=jnp.ones((4, 2)))}
    )


@pytest.mark.parametrize("name", list(TOYS))
def test_table_helpers(name):
  module, config, weights, x = _toy(name)
  fns = module.target_fns(config, 2)
  assert fns.batch_lead_shape(x) == (4,)
  assert fns.batch_lead_shape(x[None]) == (1, 4)
  assert jnp.array_equal(fns.feature_probe(), 0.75 * jnp.eye(config.n_features))
  a, b = x, 2 * x
  np.testing.assert_allclose(fns.divergence(a, b), jnp.mean(x**2), rtol=1e-6)


def test_masked_forward_gradient_reaches_live_factors_only():
  module, config, weights, x = _toy("resid2")
  fns = module.target_fns(config, 3)
  components = sites.init_components(jax.random.key(5), fns.sites)
  masks = {"layers.1.mlp_in": SiteMask(mask=jnp.full((4, 3), 0.5))}

  def loss(c):
    return jnp.sum(fns.masked_forward(weights, c, x, masks) ** 2)

  grads = jax.grad(loss)(components)
  assert jnp.any(grads["mlp_in"].v[1] != 0)
  assert not jnp.any(grads["mlp_in"].v[0])
  assert not jnp.any(grads["mlp_out"].v)


@pytest.mark.parametrize("out_bias", [False, True])
def test_resid_feature_space_forward_matches_forward(out_bias):
  config = resid_mlp.ResidMlpConfig(3, 6, 3, d_embed=9, out_bias=out_bias)
  weights = jax.jit(resid_mlp.init, static_argnums=1)(jax.random.key(4), config)
  x = jax.random.uniform(jax.random.key(2), (5, 6), minval=-1)
  np.testing.assert_allclose(
    jax.jit(resid_mlp.feature_space_forward)(weights, x),
    jax.jit(resid_mlp.forward)(weights, x),
    rtol=1e-5,
    atol=1e-6,
  )
