"""The target function table's records: an expected CI pattern takes only
the settings a pattern has (SPEC §10, §11), and a unit spec counts its
units once unless told otherwise (SPEC §5.10)."""

import pytest

from decompax.core import target


def test_expected_patterns_take_their_own_settings():
  assert target.Expected("identity", feature_axis=1).k == 0
  assert target.Expected("dense", k=2).feature_axis is None


@pytest.mark.parametrize("options, message", [
  ({"pattern": "sparse"}, "identity or dense"),
  ({"pattern": "dense"}, "needs its k > 0"),
  ({"pattern": "identity", "k": 3}, "needs its k > 0"),
  ({"pattern": "identity", "feature_axis": 2}, "feature_axis must be"),
])
def test_an_expected_pattern_no_site_can_reach_is_refused(options, message):
  with pytest.raises(ValueError, match=message):
    target.Expected(**options)


def test_a_unit_counts_once_by_default():
  assert target.UnitSpec("neuron", 8).multiplicity == 1.0
  assert target.UnitSpec("attention_head", 2, 2.0).multiplicity == 2.0
