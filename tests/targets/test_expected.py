"""Every probed toy declares the CI pattern each of its sites should reach
(SPEC §10), and the TMS feature axes index the features."""

import pytest

from decompax.targets import registry

PROBED = [n for n in registry.toy_names()
          if n != "induction" and registry.get(n).fns(4).feature_probe]


@pytest.mark.parametrize("name", PROBED)
def test_every_probed_site_has_an_expected_pattern(name):
  fns = registry.get(name).fns(4)
  if name == "simple_mlp":
    assert fns.expected is None
    return
  assert set(fns.expected) == {s.name for s in fns.sites}


@pytest.mark.parametrize("name", ["tms_5-2", "tms_40-10-id"])
def test_tms_feature_axes_have_the_feature_count(name):
  toy = registry.get(name)
  fns = toy.fns(4)
  for site in fns.sites:
    expected = fns.expected[site.name]
    if expected.feature_axis is None:
      assert expected.pattern == "dense"
      assert expected.k == toy.config.n_hidden
      continue
    shape = (site.d_in, site.d_out)
    assert shape[expected.feature_axis] == toy.config.n_features


def test_resid_mlp_out_is_dense_over_its_neurons():
  toy = registry.get("resid_mlp2")
  for name, expected in toy.fns(4).expected.items():
    if name.endswith("mlp_out"):
      assert (expected.pattern, expected.k) == ("dense", toy.config.d_mlp)
    else:
      assert expected.pattern == "identity"
