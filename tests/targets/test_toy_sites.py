"""The toys' shared site helpers: `C` per site, tap and live-site checks
that name what is unknown, the frozen matmul for activations and token
ids, and weights to arrays and back."""

import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import sites as sites_lib
from decompax.core.masks import SiteMask
from decompax.targets import toy_sites


def test_c_per_site_takes_one_int_or_exactly_every_site():
  assert toy_sites.c_per_site(3, ("a", "b")) == {"a": 3, "b": 3}
  assert toy_sites.c_per_site({"b": 2, "a": 1}, ("a", "b")) == {
    "a": 1, "b": 2}
  with pytest.raises(ValueError, match=r"missing \['b'\], unknown \['c'\]"):
    toy_sites.c_per_site({"a": 1, "c": 2}, ("a", "b"))


def test_unknown_taps_and_live_sites_are_named():
  with pytest.raises(ValueError, match=r"unknown tap keys \['z'\]"):
    toy_sites.check_tap_keys(("a", "z"), ("a", "b"))
  spec = sites_lib.SiteSpec("a", "a", 0, 2, 2, 1)
  assert toy_sites.site_specs_by_name((spec,), {}) == {"a": spec}
  with pytest.raises(ValueError, match=r"unknown live sites \['q'\]"):
    toy_sites.site_specs_by_name((spec,), {"q": SiteMask(jnp.ones(1))})


def test_the_frozen_matmul_reads_rows_for_token_ids():
  w = jnp.arange(12.0).reshape(4, 3)
  x = jnp.asarray([[1.0, 0.0, 0.0, 2.0]])
  np.testing.assert_array_equal(toy_sites.frozen_matmul("s", x, w), x @ w)
  ids = jnp.asarray([3, 0])
  np.testing.assert_array_equal(toy_sites.frozen_matmul("s", ids, w),
                                np.asarray(w)[[3, 0]])
  assert float(toy_sites.mse(jnp.ones(4), jnp.zeros(4))) == 1.0


def test_fields_round_trip_and_other_shapes_are_refused():
  record = sites_lib.Factors(jnp.ones((1, 2, 3)), jnp.zeros((1, 3, 2)))
  arrays = toy_sites.fields_to_arrays(record)
  shapes = {"v": (1, 2, 3), "u": (1, 3, 2)}
  back = toy_sites.arrays_to_fields(arrays, shapes)
  np.testing.assert_array_equal(back["v"], record.v)
  with pytest.raises(ValueError, match="expected"):
    toy_sites.arrays_to_fields(arrays, {"v": (1, 2, 2), "u": (1, 3, 2)})
  with pytest.raises(ValueError, match="do not match fields"):
    toy_sites.arrays_to_fields(arrays, {"v": (1, 2, 3)})
