"""The residual MLP's factored forwards against a dense reference (SPEC §3)."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import factored, site_forward, sites
from decompax.core.masks import SiteMask
from decompax.targets import resid_mlp

# Distinct sizes, so a [batch, d_embed] array is recognisable by its shape.
_BATCH, _D_EMBED, _C = 5, 11, 4


def _config(n_layers, out_bias):
  return resid_mlp.ResidMlpConfig(
    n_layers, 6, 3, d_embed=_D_EMBED, in_bias=not out_bias, out_bias=out_bias
  )


@functools.cache
def _setup(n_layers, out_bias):
  """Return `(fns, weights, components, x)`; cached, as every use is pure."""
  config = _config(n_layers, out_bias)
  weights = resid_mlp.init(jax.random.key(n_layers), config)
  fns = resid_mlp.target_fns(config, _C)
  components = sites.init_components(jax.random.key(7), fns.sites)
  x = jax.random.uniform(jax.random.key(3), (_BATCH, 6), minval=-1)
  return fns, weights, components, x


def _dense_masked_forward(weights, components, x, site_masks, specs):
  """Return the masked output with the residual formed, per the definition."""
  by_name = sites.site_by_name(specs)

  def matmul(name, a, w):
    v, u = sites.site_factors(components, by_name[name])
    return site_forward.site_matmul(a, w, v, u, site_masks.get(name))

  r = x @ weights.w_e
  for i in range(weights.w_in.shape[0]):
    pre = matmul(f"layers.{i}.mlp_in", r, weights.w_in[i])
    if weights.b_in is not None:
      pre = pre + weights.b_in[i]
    out = matmul(f"layers.{i}.mlp_out", jax.nn.relu(pre), weights.w_out[i])
    if weights.b_out is not None:
      out = out + weights.b_out[i]
    r = r + out
  return r @ weights.w_e.T


def _random_masks(key, specs, live, delta, route):
  out = {}
  for i, s in enumerate(specs):
    if s.name not in live:
      continue
    m_key, d_key, r_key = jax.random.split(jax.random.fold_in(key, i), 3)
    out[s.name] = SiteMask(
      mask=jax.random.uniform(m_key, (_BATCH, s.c)),
      delta=jax.random.uniform(d_key, (_BATCH,)) if delta else None,
      route=jax.random.bernoulli(r_key, 0.6, (_BATCH,)) if route else None,
    )
  return out


def _live_sets(specs):
  names = tuple(s.name for s in specs)
  return {"all": names, "ins": names[0::2], "outs": names[1::2],
          "last": names[-1:], "first_out": names[1:2]}


def _assert_close_relative(actual, expected, rtol=1e-5):
  scale = max(float(jnp.max(jnp.abs(expected))), 1e-6)
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


_CASES = pytest.mark.parametrize(
  "n_layers,out_bias,delta,route",
  [(n, b, d, r) for n in (1, 2, 3) for b in (False, True)
   for d in (False, True) for r in (False, True)],
)


@_CASES
@pytest.mark.parametrize("live", ["all", "ins", "outs", "last", "first_out"])
def test_factored_masked_forward_matches_dense(
  n_layers, out_bias, delta, route, live
):
  fns, weights, components, x = _setup(n_layers, out_bias)
  names = _live_sets(fns.sites)[live]
  masks = _random_masks(jax.random.key(11), fns.sites, names, delta, route)
  got = fns.masked_forward(weights, components, x, masks)
  want = _dense_masked_forward(weights, components, x, masks, fns.sites)
  _assert_close_relative(got, want)


@_CASES
def test_factored_gradients_match_dense(n_layers, out_bias, delta, route):
  """V, U, mask and delta gradients of the recon MSE agree with the dense."""
  fns, weights, components, x = _setup(n_layers, out_bias)
  masks = _random_masks(
    jax.random.key(12), fns.sites, _live_sets(fns.sites)["all"], delta, route
  )
  clean = resid_mlp.forward(weights, x)

  values = {k: (m.mask, m.delta) for k, m in masks.items()}

  def loss(forward, c, vals):
    m = {k: masks[k]._replace(mask=v[0], delta=v[1]) for k, v in vals.items()}
    return fns.divergence(forward(weights, c, x, m), clean)

  dense = functools.partial(_dense_masked_forward, specs=fns.sites)
  got = jax.grad(functools.partial(loss, fns.masked_forward), (0, 1))(
    components, values)
  want = jax.grad(functools.partial(loss, dense), (0, 1))(components, values)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    _assert_close_relative(g, w, rtol=1e-4)


@pytest.mark.parametrize("n_layers", [1, 2, 3])
@pytest.mark.parametrize("out_bias", [False, True])
def test_no_live_site_and_unrouted_sites_are_clean_bitwise(n_layers, out_bias):
  """SPEC I2, jitted; every site live with route ≡ false is clean too."""
  fns, weights, components, x = _setup(n_layers, out_bias)
  names = _live_sets(fns.sites)["all"]
  masks = _random_masks(jax.random.key(13), fns.sites, names, True, True)
  unrouted = {k: m._replace(route=jnp.zeros_like(m.route))
              for k, m in masks.items()}
  clean, _ = jax.jit(fns.clean_forward, static_argnums=2)(weights, x, ())
  masked = jax.jit(fns.masked_forward)
  assert jnp.array_equal(masked(weights, components, x, {}), clean)
  assert jnp.array_equal(masked(weights, components, x, unrouted), clean)
  eager, _ = fns.clean_forward(weights, x, ())
  assert jnp.array_equal(
    fns.masked_forward(weights, components, x, unrouted), eager)


def _shapes(jaxpr):
  """Return the shapes of every value a (nested) jaxpr computes."""
  out = set()
  for eqn in jaxpr.eqns:
    out.update(tuple(v.aval.shape) for v in eqn.outvars)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      out |= _shapes(sub)
  return out


@pytest.mark.parametrize("n_layers", [1, 3])
def test_residual_is_formed_only_for_mlp_in_taps(n_layers):
  fns, weights, components, x = _setup(n_layers, True)
  resid_shape = (_BATCH, _D_EMBED)
  masks = _random_masks(
    jax.random.key(14), fns.sites, _live_sets(fns.sites)["all"], True, True
  )

  def masked_loss(c):
    return jnp.sum(fns.masked_forward(weights, c, x, masks) ** 2)

  grad_jaxpr = jax.make_jaxpr(jax.grad(masked_loss))(components).jaxpr
  assert resid_shape not in _shapes(grad_jaxpr)
  outs = tuple(s.name for s in fns.sites if s.kind == "mlp_out")
  clean = jax.make_jaxpr(fns.clean_forward, static_argnums=2)
  assert resid_shape not in _shapes(clean(weights, x, outs).jaxpr)
  # The mlp_in tap is the residual handed over factored: not formed either,
  # and its values are the dense forward's.
  ins = tuple(s.name for s in fns.sites if s.kind == "mlp_in")
  assert resid_shape not in _shapes(clean(weights, x, ins).jaxpr)
  _, taps = fns.clean_forward(weights, x, ins)
  assert all(isinstance(taps[n], factored.Factored) for n in ins)
  np.testing.assert_allclose(factored.dense(taps["layers.0.mlp_in"]),
                             x @ weights.w_e, rtol=1e-6, atol=1e-6)


def _two_layer_weights(w_in, w_out, b_in=None):
  """Return a two-layer target on an identity embedding of four features."""
  n = 4
  return resid_mlp.ResidMlpWeights(
    w_e=jnp.eye(n), w_in=jnp.stack([w_in, jnp.zeros_like(w_in)]),
    w_out=jnp.stack([w_out, w_out]), kappa=jnp.ones(n),
    b_in=None if b_in is None else jnp.stack([b_in, b_in]), b_out=None)


def test_neurons_per_feature_counts_private_and_shared_neurons():
  # Layer 0 gives each feature a private neuron; layer 1 reads nothing.
  private = _two_layer_weights(jnp.eye(4), jnp.eye(4))
  np.testing.assert_array_equal(resid_mlp.neurons_per_feature(private), 1)
  # Every feature drives all four neurons alike: 90% needs all of them,
  # 70% three.
  shared = _two_layer_weights(jnp.ones((4, 4)), jnp.eye(4))
  np.testing.assert_array_equal(resid_mlp.neurons_per_feature(shared), 4)
  np.testing.assert_array_equal(
    resid_mlp.neurons_per_feature(shared, share=0.7), 3)


def test_neurons_per_feature_ignores_what_the_zero_input_writes():
  # A bias keeps neuron 3 on for every input; only the private neuron
  # moves, and feature 3, which no neuron reads, has none.
  b_in = jnp.array([0.0, 0.0, 0.0, 5.0])
  weights = _two_layer_weights(jnp.eye(4).at[3].set(0.0), jnp.eye(4), b_in)
  np.testing.assert_array_equal(
    resid_mlp.neurons_per_feature(weights), [1, 1, 1, 0])
