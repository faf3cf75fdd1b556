"""Pad slots: a kind's stacks padded to the placement's multiples with
zeros, and cut back to their real shapes exactly."""

import jax
import jax.numpy as jnp
import numpy as np

from decompax.core import sites as sites_lib, slots

SITES = (sites_lib.SiteSpec("a0", "a", 0, 4, 3, 3),
         sites_lib.SiteSpec("a1", "a", 1, 4, 3, 3),
         sites_lib.SiteSpec("a2", "a", 2, 4, 3, 3))
PADS = slots.SlotPads(layer=2, c=4)


def test_padded_shapes_round_the_layer_and_component_axes_up():
  kind = sites_lib.kind_specs(SITES)["a"]
  assert slots.real_shape(kind, "v") == (3, 4, 3)
  assert slots.padded_shape(kind, "v", PADS) == (4, 4, 4)
  assert slots.padded_shape(kind, "u", PADS) == (4, 4, 3)
  assert slots.padded_shape(kind, "u", slots.NO_PADS) == (3, 3, 3)


def test_padding_adds_zeros_and_cutting_gives_the_real_components_back():
  real = {"a": sites_lib.Factors(
    jnp.arange(36.0).reshape(3, 4, 3), jnp.arange(27.0).reshape(3, 3, 3))}
  padded = slots.pad_components(real, SITES, PADS)
  assert padded["a"].v.shape == (4, 4, 4) and padded["a"].u.shape == (4, 4, 3)
  assert slots.has_pads(padded, SITES) and not slots.has_pads(real, SITES)
  np.testing.assert_array_equal(padded["a"].v[3], 0)
  np.testing.assert_array_equal(padded["a"].v[:, :, 3], 0)
  back = slots.real_components(padded, SITES)
  jax.tree.map(np.testing.assert_array_equal, back, real)
  assert slots.real_components(real, SITES)["a"].v is real["a"].v
