"""analysis/matching: two runs' components paired by the cosines of their
rank-1 weights and CI patterns, against cases whose answer is known."""

import dataclasses

import numpy as np
import pytest

from decompax.analysis import explore, matching

D_IN, D_OUT, C, N = 7, 5, 6, 40


def _site(seed: int = 0, c: int = C) -> matching.SiteArrays:
  """Return a site of `c` random components, each switched on by its own
  inputs (component k by inputs k, k + c, ...), all alive."""
  rng = np.random.default_rng(seed)
  ci = np.zeros((N, c))
  ci[np.arange(N), np.arange(N) % c] = rng.uniform(0.5, 1.0, N)
  return matching.SiteArrays(rng.normal(size=(D_IN, c)),
                             rng.normal(size=(c, D_OUT)), ci, 0.1)


def _permuted(site: matching.SiteArrays, order: np.ndarray,
              flip: np.ndarray) -> matching.SiteArrays:
  """Return `site` with component `order[j]` at column j, `flip` (±1)
  multiplying both of its factors."""
  return site._replace(v=site.v[:, order] * flip,
                       u=site.u[order] * flip[:, None], ci=site.ci[:, order])


def test_weight_cosines_equal_those_of_the_materialised_products():
  a, b = _site(0), _site(1, c=4)
  got = matching.weight_cosines(a.v, a.u, b.v, b.u)
  flat_a = np.stack([np.outer(a.v[:, i], a.u[i]).ravel() for i in range(C)])
  flat_b = np.stack([np.outer(b.v[:, j], b.u[j]).ravel() for j in range(4)])
  expected = (flat_a @ flat_b.T) / np.outer(np.linalg.norm(flat_a, axis=1),
                                            np.linalg.norm(flat_b, axis=1))
  np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_a_site_against_itself_is_stable_with_cosine_one():
  site = _site()
  m = matching.match_site(site, site)
  np.testing.assert_array_equal(m.a, np.arange(C))
  np.testing.assert_array_equal(m.b, np.arange(C))
  np.testing.assert_allclose(m.weight_cosine, 1.0, atol=1e-12)
  np.testing.assert_allclose(m.ci_cosine, 1.0, atol=1e-12)
  assert m.stability == 1.0


def test_permuted_and_sign_flipped_components_are_found_again():
  site = _site()
  order = np.asarray([3, 0, 5, 1, 4, 2])
  # Both factors negated: the same weight V_c U_c.
  flip = np.asarray([1.0, -1.0, 1.0, -1.0, -1.0, 1.0])
  m = matching.match_site(site, _permuted(site, order, flip))
  # Component i of the first run sits at column j where order[j] = i.
  np.testing.assert_array_equal(m.b, np.argsort(order))
  np.testing.assert_allclose(m.similarity, 1.0, atol=1e-12)
  assert m.stability == 1.0


def test_one_factor_negated_is_the_opposite_weight():
  site = _site()
  flipped = site._replace(v=site.v * np.asarray([1, 1, -1, 1, 1, 1.0]))
  m = matching.match_site(site, flipped)
  assert m.weight_cosine[2] == pytest.approx(-1.0)
  assert m.similarity[2] < 0.9
  assert m.stability == pytest.approx(5 / 6)


@pytest.mark.parametrize("factor", ["u", "ci"])
def test_a_perturbed_component_alone_falls_below_the_threshold(factor):
  site = _site()
  rng = np.random.default_rng(7)
  if factor == "u":
    changed = site._replace(u=site.u.copy())
    changed.u[4] = rng.normal(size=D_OUT)
  else:
    # Component 4 now switched on by component 1's inputs instead.
    changed = site._replace(ci=site.ci.copy())
    changed.ci[:, 4] = site.ci[:, 1]
  m = matching.match_site(site, changed)
  below = m.a[m.similarity < matching.THRESHOLD]
  np.testing.assert_array_equal(below, [4])
  assert m.stability == pytest.approx(5 / 6)


def test_only_alive_components_are_matched():
  site = _site()
  dead = site._replace(ci=site.ci * np.asarray([1, 1, 0.05, 1, 1, 1.0]))
  m = matching.match_site(dead, site)
  np.testing.assert_array_equal(m.alive_a, [0, 1, 3, 4, 5])
  np.testing.assert_array_equal(m.alive_b, np.arange(C))
  assert 2 not in m.a and m.stability == 1.0
  # No component alive in the first run: no stability to speak of.
  none = matching.match_site(site._replace(ci=site.ci * 0), site)
  assert len(none.a) == 0 and np.isnan(none.stability)


def test_sites_must_agree():
  with pytest.raises(ValueError, match="different sites"):
    matching.match_arrays({"linear1": _site()}, {"linear2": _site()})


def test_a_run_against_itself(tms):
  inputs = matching.shared_inputs(tms, batch_size=64)
  # The five one-feature probe rows come first.
  np.testing.assert_array_equal(inputs[:5], tms.target.feature_probe())
  matches = matching.match_runs(tms, tms, inputs)
  assert list(matches) == ["linear1", "linear2"]
  for m in matches.values():
    assert len(m.alive_a) > 0
    np.testing.assert_array_equal(m.a, m.b)
    np.testing.assert_allclose(m.weight_cosine, 1.0, atol=1e-6)
    np.testing.assert_allclose(m.ci_cosine, 1.0, atol=1e-6)
    assert m.stability == 1.0
  table = matching.markdown_table(matches)
  assert table.count("\n") == 4 and table.splitlines()[2].endswith("| 1.00 |")


def test_runs_of_different_sites_are_refused(tms):
  sites = tms.decomposition.sites
  other = tms._replace(decomposition=tms.decomposition._replace(
    sites=sites[:1]))
  with pytest.raises(ValueError, match="different sites"):
    matching.check_comparable(tms, other)
  other_target = tms._replace(
    config=dataclasses.replace(tms.config, target="tms_40-10"))
  with pytest.raises(ValueError, match="different targets"):
    matching.check_comparable(tms, other_target)


def test_a_token_model_against_itself_over_token_windows(finished_run):
  run = explore.load_run(finished_run("induction"))
  inputs = matching.shared_inputs(run, batch_size=4)
  assert inputs.ndim == 2 and inputs.shape[0] == 4
  matches = matching.match_runs(run, run, inputs)
  assert list(matches) == [s.name for s in run.decomposition.sites]
  alive = [m for m in matches.values() if len(m.alive_a)]
  assert alive
  for m in alive:
    np.testing.assert_array_equal(m.a, m.b)
    np.testing.assert_allclose(m.similarity, 1.0, atol=1e-6)
    assert m.stability == 1.0
