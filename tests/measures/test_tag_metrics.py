"""Purity, lift, coverage and the document bootstrap on cases whose answers
are worked out by hand or by direct loops."""

import numpy as np
import pytest

from decompax.measures import tag_metrics, tag_profile

# Five units over three classes; unit 2 is dead.
COUNTS = np.asarray([[8, 2, 0], [0, 3, 1], [0, 0, 0], [1, 1, 2], [0, 0, 10]],
                    np.float64)
BASE = np.asarray([50, 30, 20])  # base rates .5, .3, .2


def test_purity_and_lift_by_hand():
  share, top = tag_metrics.purity(COUNTS)
  np.testing.assert_allclose(share, [.8, .75, np.nan, .5, 1.0])
  np.testing.assert_array_equal(top, [0, 1, -1, 2, 2])
  np.testing.assert_allclose(tag_metrics.lift(COUNTS, BASE),
                             [1.6, 2.5, np.nan, 2.5, 5.0])


def test_unweighted_summary_by_hand():
  s = tag_metrics.summarize(COUNTS, BASE, weighted=False)
  assert s.units == 4
  assert s.median_purity == pytest.approx(.775)  # (.75 + .8) / 2
  assert s.share_pure == pytest.approx(.5)
  assert s.share_mostly_pure == pytest.approx(1.0)
  assert s.mean_lift == pytest.approx(2.9)
  np.testing.assert_array_equal(s.coverage, [2, 3, 2])


def test_weighted_summary_by_hand():
  # Masses 10, 4, 4, 10: the heavy units (.8 and 1.0 pure) dominate.
  s = tag_metrics.summarize(COUNTS, BASE, weighted=True)
  assert s.median_purity == pytest.approx(.8)
  assert s.share_pure == pytest.approx(20 / 28)
  assert s.share_mostly_pure == pytest.approx(1.0)
  assert s.mean_lift == pytest.approx(86 / 28)


def test_weighted_median_is_the_median_for_equal_weights():
  rng = np.random.default_rng(0)
  for n in (1, 2, 5, 6):
    v = rng.uniform(size=n)
    assert tag_metrics.weighted_median(v, np.ones(n)) == pytest.approx(
      np.median(v))
  # Zero weights do not count; a heavy value wins.
  assert tag_metrics.weighted_median(np.asarray([1., 2., 3.]),
                                     np.asarray([1., 0., 1.])) == 2.0
  assert tag_metrics.weighted_median(np.asarray([1., 2., 3.]),
                                     np.asarray([1., 1., 5.])) == 3.0


def test_coverage_is_the_fewest_units_holding_the_share():
  rng = np.random.default_rng(1)
  counts = rng.exponential(size=(9, 4)) * (rng.uniform(size=(9, 4)) > .3)
  got = tag_metrics.coverage(counts, .9)
  for c in range(4):
    column = counts[:, c]
    # Direct: the smallest n such that some n units reach 90%.
    want = next(n for n in range(1, 10)
                if np.sort(column)[::-1][:n].sum() >= .9 * column.sum())
    assert got[c] == want
  assert tag_metrics.coverage(np.zeros((3, 2)))[0] == 0


def test_top_shares_and_bigrams():
  bigram = np.zeros((2, 3, 3))
  bigram[0, 1, 2], bigram[0, 0, 0] = 3.0, 1.0
  bigram[1, 2, 1] = 5.0
  prev, cur, share = tag_metrics.top_bigrams(bigram, 2)
  np.testing.assert_array_equal(prev[:, 0], [1, 2])
  np.testing.assert_array_equal(cur[:, 0], [2, 1])
  np.testing.assert_allclose(share, [[.75, .25], [1.0, 0.0]])


def test_profiles_label_each_unit():
  fine = np.asarray([[6., 2., 2., 0.], [0., 0., 1., 3.]])
  coarse_of = np.asarray([0, 0, 1, 1])
  coarse = np.stack([fine[:, coarse_of == c].sum(1) for c in range(2)], 1)
  stats = tag_profile.TagStats(
    fine=fine, coarse=coarse[None], bigram=np.zeros((2, 2, 2)),
    base_fine=np.asarray([10, 10, 10, 70]),
    base_coarse=np.asarray([[20, 80]]))
  p = tag_metrics.profiles(stats)
  np.testing.assert_allclose(p.mass, [10, 4])
  np.testing.assert_array_equal(p.top_class, [0, 1])
  np.testing.assert_allclose(p.purity, [.8, 1.0])
  np.testing.assert_allclose(p.lift, [.8 / .2, 1.0 / .8])
  np.testing.assert_array_equal(p.top_tag, [0, 3])
  np.testing.assert_allclose(p.tag_purity, [.6, .75])
  np.testing.assert_allclose(p.tag_lift, [6.0, .75 / .7])


def _groups(seed, g=6, u=5, k=3):
  rng = np.random.default_rng(seed)
  counts = rng.exponential(size=(g, u, k)) ** 3
  base = rng.integers(1, 50, size=(g, k))
  return counts, base


@pytest.mark.parametrize("weighted", [False, True])
def test_bootstrap_matches_a_direct_loop(weighted):
  a, base = _groups(2)
  b, _ = _groups(3)
  got = tag_metrics.bootstrap_difference(a, b, base, seed=7,
                                         weighted=weighted, n_boot=50)
  diffs = []
  for w in tag_metrics.group_resamples(7, 50, len(base)):
    pick = np.repeat(np.arange(len(base)), w)
    ra, rb, rbase = a[pick].sum(0), b[pick].sum(0), base[pick].sum(0)
    sa = tag_metrics.summarize(ra, rbase, weighted)
    sb = tag_metrics.summarize(rb, rbase, weighted)
    diffs.append([getattr(sa, n) - getattr(sb, n)
                  for n in tag_metrics.SCALARS])
  low, high = np.quantile(np.asarray(diffs), [.025, .975], axis=0)
  full_a = tag_metrics.summarize(a.sum(0), base.sum(0), weighted)
  full_b = tag_metrics.summarize(b.sum(0), base.sum(0), weighted)
  for i, name in enumerate(tag_metrics.SCALARS):
    assert got[name].estimate == pytest.approx(
      getattr(full_a, name) - getattr(full_b, name))
    assert got[name].low == pytest.approx(low[i])
    assert got[name].high == pytest.approx(high[i])
    assert got[name].low <= got[name].high


def test_bootstrap_of_identical_documents_has_no_width():
  # Components pure, neurons split 70/30 in every document alike.
  a = np.tile(np.asarray([[4., 0.], [0., 2.]]), (5, 1, 1))
  b = np.tile(np.asarray([[7., 3.], [3., 7.], [1., 1.]]), (5, 1, 1))
  base = np.tile(np.asarray([10, 10]), (5, 1))
  got = tag_metrics.bootstrap_difference(a, b, base, seed=0, weighted=False,
                                         n_boot=20)
  assert got["median_purity"] == (pytest.approx(.3),) * 3
  assert got["share_pure"] == (pytest.approx(1.0),) * 3
  assert got["share_mostly_pure"] == (pytest.approx(0.0),) * 3


def test_bootstrap_skips_groups_without_positions():
  a, base = _groups(4, g=3)
  b, _ = _groups(5, g=3)
  padded = lambda x: np.concatenate([x, np.zeros((2,) + x.shape[1:])])
  got = tag_metrics.bootstrap_difference(padded(a), padded(b), padded(base),
                                         seed=1, weighted=True, n_boot=30)
  want = tag_metrics.bootstrap_difference(a, b, base, seed=1, weighted=True,
                                          n_boot=30)
  assert got == want


def test_compare_summarizes_both_sets_and_bootstraps_their_difference():
  a, base = _groups(6)
  b, _ = _groups(7, u=3)
  stats = lambda c: tag_profile.TagStats(
    np.zeros((c.shape[1], 1)), c, np.zeros((c.shape[1], 3, 3)),
    np.zeros(1, np.int64), base)
  got = tag_metrics.compare(stats(a), stats(b), seed=3, n_boot=20)
  for kind, weighted in (("weighted", True), ("unweighted", False)):
    want_a = tag_metrics.summarize(a.sum(0), base.sum(0), weighted)
    assert got.a[kind].median_purity == want_a.median_purity
    assert got.b[kind].units == 3
    assert got.difference[kind] == tag_metrics.bootstrap_difference(
      a, b, base, 3, weighted, n_boot=20)
  moved = stats(b)._replace(base_coarse=base + 1)
  with pytest.raises(ValueError, match="different positions"):
    tag_metrics.compare(stats(a), moved, seed=0)


def _one_set_scalars(counts, base, weighted):
  """The summary scalars of one unit set, over its alive units only."""
  share, _ = tag_metrics.purity(counts)
  alive = ~np.isnan(share)
  if not alive.any():
    return np.full(len(tag_metrics.SCALARS), np.nan)
  p, lifted = share[alive], tag_metrics.lift(counts, base)[alive]
  w = counts.sum(axis=1)[alive] if weighted else np.ones(len(p))
  w = w / w.sum()
  return np.asarray([tag_metrics.weighted_median(p, w),
                     w @ (p >= tag_metrics.PURE),
                     w @ (p >= tag_metrics.MOSTLY_PURE), w @ lifted])


@pytest.mark.parametrize("weighted", [False, True])
def test_draws_at_once_match_one_draw_at_a_time(weighted):
  # Units alive in one group only die in the draws that skip it, and equal
  # weights (unweighted) put the median between two units.
  a, base = _groups(4, g=5, u=6, k=3)
  a[1:, :2] = 0
  a[:, 5] = 0  # dead in every draw
  draws = tag_metrics.group_resamples(3, 40, len(base)).astype(float)
  draws[0] = 0  # no unit alive
  draws[1, 0] = 0  # the one-group units dead
  counts = np.einsum("dg,guk->duk", draws, a)
  folded = draws @ base
  got = tag_metrics._scalars(counts, folded, weighted)
  want = np.stack([_one_set_scalars(c, f, weighted)
                   for c, f in zip(counts, folded)])
  np.testing.assert_allclose(got, want, rtol=1e-12, equal_nan=True)
  assert np.isnan(got[0]).all() and np.isfinite(got[1:]).all()


def test_weighted_medians_leave_out_zero_weights_wherever_they_sort():
  rng = np.random.default_rng(5)
  values = rng.random((30, 7))
  weights = rng.integers(0, 3, size=(30, 7)).astype(float)
  want = [tag_metrics.weighted_median(v[w > 0], w[w > 0])
          for v, w in zip(values, weights)]
  np.testing.assert_allclose(tag_metrics._weighted_medians(values, weights),
                             want, rtol=1e-12, equal_nan=True)


def _direct_median(values, weights):
  """The weighted median by its definition: the smallest sorted value
  whose cumulative weight reaches half (no exact ties in these draws)."""
  order = np.argsort(values)
  c = np.cumsum(np.asarray(weights, np.float64)[order])
  return values[order][np.searchsorted(c, c[-1] / 2)]


def test_robust_summary_sets_an_always_on_unit_apart_and_bootstraps():
  counts, base = _groups(4, g=6, u=5, k=3)
  positions = int(base.sum())
  on = np.asarray([positions, 10, 20, 30, 40])  # unit 0 always on
  got = tag_metrics.robust_summary(counts, base, on, seed=3, n_boot=40)
  np.testing.assert_array_equal(got.always_on, [0])
  mass = counts.sum(axis=(0, 2))
  assert got.always_on_share == pytest.approx(mass[0] / mass.sum())
  assert got.units == 4
  kept = counts[:, 1:].sum(axis=0)
  purity = kept.max(axis=1) / kept.sum(axis=1)
  robust = got.intervals
  assert robust["median_purity"].estimate == pytest.approx(np.median(purity))
  assert robust["weighted_median_purity"].estimate == pytest.approx(
    _direct_median(purity, kept.sum(axis=1)))
  assert robust["activity_share_mostly_pure"].estimate == pytest.approx(
    kept.sum(axis=1)[purity >= 0.5].sum() / kept.sum())
  draws = []
  for w in tag_metrics.group_resamples(3, 40, len(base)):
    pick = np.repeat(np.arange(len(base)), w)
    r = counts[pick][:, 1:].sum(0)
    share = r.max(axis=1) / r.sum(axis=1)
    draws.append(np.median(share))
  low, high = np.quantile(draws, [.025, .975])
  assert robust["median_purity"].low == pytest.approx(low)
  assert robust["median_purity"].high == pytest.approx(high)


def test_a_set_of_always_on_units_alone_has_no_robust_summary():
  counts, base = _groups(5, g=4, u=2, k=3)
  got = tag_metrics.robust_summary(counts, base, np.full(2, base.sum()),
                                   seed=0, n_boot=10)
  assert got.units == 0 and got.always_on_share == pytest.approx(1.0)
  assert all(np.isnan(i.estimate) for i in got.intervals.values())
