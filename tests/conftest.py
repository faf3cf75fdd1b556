"""Test-wide setup: CPU with eight simulated devices, absl flags parsed."""

import os

# Must precede the first JAX backend initialisation.
os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402
from absl import flags  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
flags.FLAGS.mark_as_parsed()


import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from decompax.core import site_forward, sites as sites_lib, target  # noqa: E402


def make_chain_target(d: int = 4, d_out: int = 3, c: int = 5):
  """Return a tiny three-site ReLU chain: two same-kind sites and a head.

  Built only from `decompax.core`, so core and loss tests need no toy target.
  """
  sites = (
    sites_lib.SiteSpec("l0", "sq", 0, d, d, c),
    sites_lib.SiteSpec("l1", "sq", 1, d, d, c),
    sites_lib.SiteSpec("head", "head", 0, d, d_out, c),
  )
  acts = (jax.nn.relu, jax.nn.relu, lambda h: h)

  def weight(weights, site):
    return weights[site.kind][site.row]

  def clean_forward(weights, x, wanted):
    taps, h = {}, x
    for site, act in zip(sites, acts):
      taps[site.name] = h
      h = act(h @ weight(weights, site))
    unknown = set(wanted) - set(taps)
    if unknown:
      raise ValueError(f"unknown taps {sorted(unknown)}")
    return h, {k: taps[k] for k in wanted}

  def masked_forward(weights, components, x, site_masks):
    h = x
    for site, act in zip(sites, acts):
      v, u = sites_lib.site_factors(components, site)
      h = act(site_forward.site_matmul(
        h, weight(weights, site), v, u, site_masks.get(site.name)))
    return h

  def mse(a, b):
    return jnp.mean(jnp.square(a - b))

  fns = target.TargetFns(
    sites=sites,
    clean_forward=clean_forward,
    masked_forward=masked_forward,
    frozen_stacks=lambda weights: dict(weights),
    divergence=mse,
    batch_lead_shape=lambda x: x.shape[:-1],
    feature_probe=lambda: 0.75 * jnp.eye(d),
  )
  key0, key1 = jax.random.split(jax.random.key(42))
  weights = {
    "sq": jax.random.normal(key0, (2, d, d)) / jnp.sqrt(d),
    "head": jax.random.normal(key1, (1, d, d_out)) / jnp.sqrt(d),
  }
  return fns, weights


@pytest.fixture(scope="session")
def chain():
  """A tiny three-site target and its frozen weights."""
  return make_chain_target()
