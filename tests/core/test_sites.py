"""Site specs and their stacked factors: kinds stack sites of one shape,
draw paths key each site's draws (SPEC §3.6), and a site's init does not
move when another site is added (SPEC §6.1)."""

import jax
import numpy as np
import pytest

from decompax.core import sites as sites_lib

A0 = sites_lib.SiteSpec("a0", "a", 0, 4, 3, 2)
A1 = sites_lib.SiteSpec("a1", "a", 1, 4, 3, 2)
B0 = sites_lib.SiteSpec("b0", "b", 0, 3, 5, 4)


def test_kinds_stack_their_sites_in_first_appearance_order():
  specs = sites_lib.kind_specs((B0, A1, A0))
  assert list(specs) == ["b", "a"]
  assert specs["a"] == sites_lib.KindSpec("a", 2, 4, 3, 2)
  assert sites_lib.site_by_name((A0, B0))["b0"] is B0


@pytest.mark.parametrize("sites, message", [
  ((A0, A0), "duplicate site names"),
  ((A0, sites_lib.SiteSpec("a1", "a", 1, 4, 3, 3)), "must share them"),
  ((A1,), "rows \\[1\\] must be 0..0"),
  ((sites_lib.SiteSpec("z", "z", 0, 2, 2, 0),), "C must be positive"),
  ((sites_lib.SiteSpec("p", "p", 0, 2, 2, 1, (0, 1)), B0),
   "every site has a draw_path or none"),
])
def test_sites_that_do_not_stack_are_refused(sites, message):
  with pytest.raises(ValueError, match=message):
    sites_lib.validate_sites(sites)


def test_draw_paths_default_to_the_canonical_index():
  with_path = sites_lib.SiteSpec("p", "p", 0, 2, 2, 1, (6, 2))
  assert sites_lib.draw_paths((A0, A1, B0)) == {
    "a0": (0,), "a1": (1,), "b0": (2,)}
  assert sites_lib.draw_paths((with_path,)) == {"p": (6, 2)}
  key = jax.random.key(3)
  folded = jax.random.fold_in(jax.random.fold_in(key, 6), 2)
  np.testing.assert_array_equal(
    jax.random.key_data(sites_lib.fold_path(key, (6, 2))),
    jax.random.key_data(folded))


def test_a_sites_init_is_its_own_whatever_follows_it():
  init = jax.jit(sites_lib.init_components, static_argnums=1)
  alone = init(jax.random.key(0), (A0, A1))
  more = init(jax.random.key(0), (A0, A1, B0))
  np.testing.assert_array_equal(alone["a"].v, more["a"].v)
  assert more["b"].v.shape == (1, 3, 4) and more["b"].u.shape == (1, 4, 5)
  v, u = sites_lib.site_factors(more, A1)
  np.testing.assert_array_equal(v, more["a"].v[1])
  np.testing.assert_array_equal(u, more["a"].u[1])
