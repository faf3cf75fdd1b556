"""What two runs share beyond one-to-one pairs (analysis/identifiability)."""

import numpy as np
import pytest

from decompax.analysis import identifiability
from decompax.analysis import matching


def test_identical_spans_overlap_fully_and_orthogonal_ones_not_at_all():
  eye = np.eye(6)
  same, chance = identifiability.subspace_overlap(eye[:, :2],
                                                  eye[:, :2] @ [[1, 1],
                                                                [1, -1]])
  assert same == pytest.approx(1.0)
  assert chance == pytest.approx(2 / 6)
  apart, _ = identifiability.subspace_overlap(eye[:, :2], eye[:, 2:5])
  assert apart == pytest.approx(0.0)


def test_a_half_shared_span_scores_one_half():
  eye = np.eye(4)
  overlap, chance = identifiability.subspace_overlap(
    eye[:, [0, 1]], eye[:, [0, 2]])
  assert overlap == pytest.approx(0.5)
  assert chance == pytest.approx(0.5)


def test_span_drops_directions_of_negligible_size():
  x = np.array([[1.0, 0.0], [0.0, 1e-9], [0.0, 0.0]])
  assert identifiability.span_basis(x).shape == (3, 1)


def _rotated_pair(angle: float):
  """Two rank-1 pieces of one rank-2 weight, and the same weight split
  into pieces rotated by `angle`."""
  rng = np.random.default_rng(0)
  v = np.linalg.qr(rng.normal(size=(5, 2)))[0]
  u = np.linalg.qr(rng.normal(size=(4, 2)))[0].T
  c, s = np.cos(angle), np.sin(angle)
  rotation = np.array([[c, -s], [s, c]])
  return v, u, v @ rotation, rotation.T @ u


def test_a_group_split_differently_has_the_same_summed_weight():
  v_a, u_a, v_b, u_b = _rotated_pair(0.7)
  assert np.allclose(v_a @ u_a, v_b @ u_b)
  one_each = identifiability.group_weight_cosines(
    v_a, u_a, v_b, u_b, np.eye(2), np.eye(2))
  both = identifiability.group_weight_cosines(
    v_a, u_a, v_b, u_b, np.ones((1, 2)), np.ones((1, 2)))
  assert np.all(one_each < 0.9)
  assert both == pytest.approx([1.0])


def test_an_empty_group_scores_zero():
  v_a, u_a, v_b, u_b = _rotated_pair(0.3)
  empty = identifiability.group_weight_cosines(
    v_a, u_a, v_b, u_b, np.ones((1, 2)), np.zeros((1, 2)))
  assert empty == pytest.approx([0.0])


def test_a_site_whose_co_firing_pair_rotates_is_stable_as_a_group_only():
  v_a, u_a, v_b, u_b = _rotated_pair(0.7)
  # Both components of each run fire on the same inputs.
  ci = np.repeat(np.array([[0.0], [1.0], [0.5], [1.0]]), 2, axis=1)
  a = matching.SiteArrays(v_a, u_a, ci, 0.1)
  b = matching.SiteArrays(v_b, u_b, ci, 0.1)
  site = identifiability.site_identifiability(a, b, tau=0.9)
  assert matching.match_site(a, b).stability == 0.0
  assert site.best_ci_cosine == pytest.approx(1.0)
  assert abs(site.partner_weight_cosine) < 0.9
  assert site.cofiring_share == 1.0
  assert site.group_weight_cosine == pytest.approx(1.0)
  assert site.read_overlap == pytest.approx(1.0)
  assert site.write_overlap == pytest.approx(1.0)


def test_components_firing_apart_form_groups_of_one():
  v_a, u_a, v_b, u_b = _rotated_pair(0.7)
  ci = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
  a = matching.SiteArrays(v_a, u_a, ci, 0.1)
  b = matching.SiteArrays(v_b, u_b, ci, 0.1)
  site = identifiability.site_identifiability(a, b, tau=0.9)
  assert site.cofiring_share == 0.0
  assert site.group_weight_cosine < 0.9


def test_sites_must_agree():
  v_a, u_a, _, _ = _rotated_pair(0.1)
  arrays = matching.SiteArrays(v_a, u_a, np.ones((2, 2)), 0.1)
  with pytest.raises(ValueError, match="different sites"):
    identifiability.identifiability({"x": arrays}, {"y": arrays})


def test_the_heaviest_component_is_named_with_its_mass_and_reach():
  ci = np.array([[0.9, 0.05, 0.0], [0.8, 0.0, 0.2], [0.0, 0.05, 0.0],
                 [0.3, 0.0, 0.0]])
  top, mass, on = identifiability.heaviest_component(ci, 0.1)
  assert top == 0
  assert mass == pytest.approx(2.0 / 2.3)
  assert on == pytest.approx(3 / 4)


def test_a_site_without_mass_has_no_heaviest_share():
  _, mass, on = identifiability.heaviest_component(np.zeros((3, 2)), 0.1)
  assert np.isnan(mass) and np.isnan(on)
