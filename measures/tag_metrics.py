"""How monosemantic a set of units is, from its tag statistics
(`tag_profile`): purity, lift, coverage, and a bootstrap over documents
for the difference between two unit sets (components against neurons).

Host functions in float64 over a unit set's counts `[u, k]` (activity per
unit and class: coarse classes, or fine tags) and the base counts `[k]`
(positions per class). A unit whose activity is zero everywhere is dead:
its purity and lift are NaN and the summaries leave it out.

- **Purity** of a unit: the share of its activity in its top class.
- **Lift**: purity over the top class's base rate, the share of all
  positions in that class (1: no more selective than the stream itself).
- **Coverage** of a class: how many units, taken heaviest first in that
  class, hold a given share (0.9) of the class's activity over all units.
- A summary is **weighted** when each unit counts by its share of the
  set's activity, **unweighted** when each alive unit counts once. The
  median is the weighted median (`weighted_median`), which is the usual
  median for equal weights.
"""

import warnings
from typing import NamedTuple

import numpy as np
from jaxtyping import Float, Int, Real

from decompax.measures import tag_profile

PURE, MOSTLY_PURE = 0.8, 0.5
COVERED_SHARE = 0.9
# The scalar summaries a bootstrap compares, in `Summary` order.
SCALARS = ("median_purity", "share_pure", "share_mostly_pure", "mean_lift")


class Summary(NamedTuple):
  """A unit set's summary (NaN where it has no alive unit)."""

  units: int  # alive units
  median_purity: float
  share_pure: float  # share of units with purity ≥ PURE
  share_mostly_pure: float  # … ≥ MOSTLY_PURE
  mean_lift: float
  coverage: Int[np.ndarray, " k"]  # units holding COVERED_SHARE of a class


class Profiles(NamedTuple):
  """Every unit's label: its top class and top fine tag."""

  mass: Float[np.ndarray, " u"]
  top_class: Int[np.ndarray, " u"]  # −1: dead
  purity: Float[np.ndarray, " u"]
  lift: Float[np.ndarray, " u"]
  top_tag: Int[np.ndarray, " u"]
  tag_purity: Float[np.ndarray, " u"]
  tag_lift: Float[np.ndarray, " u"]


class Interval(NamedTuple):
  """A bootstrap's estimate on the full sample and its percentile
  interval."""

  estimate: float
  low: float
  high: float


def purity(counts: Float[np.ndarray, "u k"]
           ) -> tuple[Float[np.ndarray, " u"], Int[np.ndarray, " u"]]:
  """Return every unit's purity and top class (NaN and −1 when dead)."""
  counts = np.asarray(counts, np.float64)
  mass = counts.sum(axis=1)
  top = np.argmax(counts, axis=1)
  alive = mass > 0
  share = np.take_along_axis(counts, top[:, None], 1)[:, 0] / np.where(
    alive, mass, 1.0)
  return np.where(alive, share, np.nan), np.where(alive, top, -1)


def lift(counts: Float[np.ndarray, "u k"], base: Real[np.ndarray, " k"]
         ) -> Float[np.ndarray, " u"]:
  """Return every unit's purity over its top class's base rate."""
  share, top = purity(counts)
  base = np.asarray(base, np.float64)
  rate = base / base.sum()
  top_rate = rate[np.maximum(top, 0)]
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where((top >= 0) & (top_rate > 0), share / top_rate, np.nan)


def weighted_median(values: Float[np.ndarray, " n"],
                    weights: Float[np.ndarray, " n"]) -> float:
  """Return the value where the sorted values' cumulative weight reaches
  half the total (the mean of two values when it lands exactly between
  them); NaN for no weight."""
  return float(_weighted_medians(np.asarray(values, np.float64)[None],
                                 np.asarray(weights, np.float64)[None])[0])


def coverage(counts: Float[np.ndarray, "u k"], share: float = COVERED_SHARE
             ) -> Int[np.ndarray, " k"]:
  """Return, per class, how few units hold `share` of its activity (0 for
  a class no unit touches)."""
  ordered = -np.sort(-np.asarray(counts, np.float64), axis=0)
  cumulative = np.cumsum(ordered, axis=0)
  total = cumulative[-1] if len(ordered) else np.zeros(ordered.shape[1])
  reached = cumulative >= share * total * (1 - 1e-12)
  needed = np.argmax(reached, axis=0) + 1
  return np.where(total > 0, needed, 0).astype(np.int64)


def summarize(counts: Float[np.ndarray, "u k"],
              base: Real[np.ndarray, " k"], weighted: bool) -> Summary:
  """Return a unit set's summary (see the module docstring)."""
  counts = np.asarray(counts, np.float64)
  alive = int((counts.sum(axis=1) > 0).sum())
  scalars = _scalars(counts[None], np.asarray(base, np.float64)[None],
                     weighted)[0]
  return Summary(alive, *map(float, scalars), coverage(counts))


def profiles(stats: tag_profile.TagStats) -> Profiles:
  """Return every unit's label from its statistics: coarse class purity
  and lift, and the same for its top fine tag."""
  counts = tag_profile.class_counts(stats)
  base = np.asarray(stats.base_coarse).sum(axis=0)
  share, top = purity(counts)
  tag_share, top_tag = purity(np.asarray(stats.fine))
  return Profiles(tag_profile.unit_mass(stats), top, share,
                  lift(counts, base), top_tag, tag_share,
                  lift(np.asarray(stats.fine), stats.base_fine))


def top_shares(counts: Float[np.ndarray, "u m"], n: int
               ) -> tuple[Int[np.ndarray, "u n"], Float[np.ndarray, "u n"]]:
  """Return every unit's `n` heaviest entries (fine tags, or flattened
  bigrams) and their shares of its activity, heaviest first."""
  counts = np.asarray(counts, np.float64)
  index = np.argsort(-counts, axis=1, kind="stable")[:, :n]
  mass = counts.sum(axis=1, keepdims=True)
  share = np.take_along_axis(counts, index, 1) / np.where(mass > 0, mass, 1)
  return index, share


def top_bigrams(bigram: Float[np.ndarray, "u k k"], n: int
                ) -> tuple[Int[np.ndarray, "u n"], Int[np.ndarray, "u n"],
                           Float[np.ndarray, "u n"]]:
  """Return every unit's `n` heaviest (previous class, class) pairs and
  their shares of its activity."""
  k = bigram.shape[-1]
  index, share = top_shares(np.asarray(bigram).reshape(len(bigram), -1), n)
  return index // k, index % k, share


def group_resamples(seed: int, n_boot: int, n_groups: int
                    ) -> Int[np.ndarray, "b g"]:
  """Return how often each of `n_groups` groups is drawn in each of
  `n_boot` resamples of `n_groups` draws with replacement."""
  rng = np.random.default_rng(seed)
  return rng.multinomial(n_groups, np.full(n_groups, 1 / n_groups),
                         size=n_boot)


def _weighted_medians(values: Float[np.ndarray, "d u"],
                      weights: Float[np.ndarray, "d u"]
                      ) -> Float[np.ndarray, " d"]:
  """`weighted_median` of each row: units of weight ≤ 0 are left out."""
  if values.shape[1] == 0:
    return np.full(len(values), np.nan)
  # Left-out units sort last at +inf and add no weight, so the others keep
  # their stable order and cumulative weights.
  weights = np.where(weights > 0, weights, 0.0)
  n_in = (weights > 0).sum(axis=1)
  order = np.argsort(np.where(weights > 0, values, np.inf), axis=1,
                     kind="stable")
  v = np.take_along_axis(values, order, 1)
  c = np.cumsum(np.take_along_axis(weights, order, 1), axis=1)
  half = c[:, -1] / 2
  rows = np.arange(len(v))
  i = np.minimum((c < (half * (1 - 1e-12))[:, None]).sum(axis=1),
                 v.shape[1] - 1)
  between = np.isclose(c[rows, i], half, rtol=1e-12, atol=0) & (i + 1 < n_in)
  after = v[rows, np.minimum(i + 1, v.shape[1] - 1)]
  median = np.where(between, (v[rows, i] + after) / 2, v[rows, i])
  return np.where((n_in > 0) & (c[:, -1] > 0), median, np.nan)


def _scalars(counts: Float[np.ndarray, "d u k"], base: Float[np.ndarray, "d k"],
             weighted: bool) -> Float[np.ndarray, "d s"]:
  """Return the `SCALARS` of each of `d` unit sets (one, or a bootstrap's
  resamples), one row each; NaN for a set with no alive unit."""
  mass = counts.sum(axis=2)
  alive = mass > 0
  top = np.argmax(counts, axis=2)
  share = np.take_along_axis(counts, top[..., None], 2)[..., 0] / np.where(
    alive, mass, 1.0)
  with np.errstate(divide="ignore", invalid="ignore"):
    # A draw with no positions has no rates; its row is NaN below.
    rate = base / base.sum(axis=1, keepdims=True)
    top_rate = np.take_along_axis(rate, top, 1)
    lifted = np.where(top_rate > 0, share / top_rate, np.nan)
  w = np.where(alive, mass if weighted else 1.0, 0.0)
  total = w.sum(axis=1, keepdims=True)
  w = w / np.where(total > 0, total, 1.0)
  scalars = np.stack([
    _weighted_medians(share, w), (w * (share >= PURE)).sum(axis=1),
    (w * (share >= MOSTLY_PURE)).sum(axis=1),
    (w * np.where(alive, lifted, 0.0)).sum(axis=1)], axis=1)
  return np.where(alive.any(axis=1)[:, None], scalars, np.nan)


# Resampled `[u, k]` count sets held at once by the bootstrap.
_DRAW_BYTES = 64 << 20


def bootstrap_difference(
  a: Float[np.ndarray, "g ua k"], b: Float[np.ndarray, "g ub k"],
  base: Real[np.ndarray, "g k"], seed: int, weighted: bool,
  n_boot: int = 1000, level: float = 0.95, against_nothing: bool = False,
) -> dict[str, Interval]:
  """Return, per scalar of `SCALARS`, the difference `a − b` of two unit
  sets' summaries (their `coarse` statistics, per document group, over
  the same positions) with a percentile interval from resampling the
  groups that hold any position, both sets on the same draws;
  `against_nothing`: `a`'s own summaries (`b` unread)."""
  present = np.asarray(base).sum(axis=1) > 0
  a, b = np.asarray(a, np.float64)[present], np.asarray(b, np.float64)[present]
  base = np.asarray(base, np.float64)[present]
  flat = lambda x: x.reshape(len(x), -1)

  def difference(draws: np.ndarray) -> np.ndarray:
    # One product folds every draw's groups; the summaries then run over
    # the draws as rows, not in a Python loop.
    fold = lambda x: (draws @ flat(x)).reshape(len(draws), *x.shape[1:])
    folded_base = draws @ base
    mine = _scalars(fold(a), folded_base, weighted)
    if against_nothing:
      return mine
    return mine - _scalars(fold(b), folded_base, weighted)

  estimate = difference(np.ones((1, len(base))))[0]
  resamples = group_resamples(seed, n_boot, len(base)).astype(np.float64)
  # A set with no unit (every unit always on) holds no bytes per draw.
  per_chunk = max(1, _DRAW_BYTES // (8 * max(1, a[0].size + b[0].size)))
  draws = np.concatenate([
    difference(resamples[i:i + per_chunk])
    for i in range(0, n_boot, per_chunk)])
  tail = (1 - level) / 2
  with warnings.catch_warnings():
    # A set with no alive unit has only NaN draws, and no interval.
    warnings.simplefilter("ignore", RuntimeWarning)
    low, high = np.nanquantile(draws, [tail, 1 - tail], axis=0)
  return {name: Interval(float(e), float(lo), float(hi))
          for name, e, lo, hi in zip(SCALARS, estimate, low, high)}


class Comparison(NamedTuple):
  """Two unit sets over the same positions (components `a`, a baseline
  `b`): their summaries and the bootstrap of each difference `a − b`,
  weighted and unweighted."""

  a: dict[str, Summary]  # "weighted", "unweighted"
  b: dict[str, Summary]
  difference: dict[str, dict[str, Interval]]


def compare(a: tag_profile.TagStats, b: tag_profile.TagStats, seed: int,
            n_boot: int = 1000, level: float = 0.95) -> Comparison:
  """Return the comparison of two unit sets' coarse-class profiles (one
  site's components against its neurons, or every site's); ValueError if
  they were not measured over the same positions."""
  if not np.array_equal(a.base_coarse, b.base_coarse):
    raise ValueError("unit sets saw different positions; compare sets from"
                     " one harvest")
  base = np.asarray(a.base_coarse)
  summaries = lambda s: {
    kind: summarize(tag_profile.class_counts(s), base.sum(axis=0),
                    kind == "weighted") for kind in ("weighted", "unweighted")}
  return Comparison(summaries(a), summaries(b), {
    kind: bootstrap_difference(a.coarse, b.coarse, base, seed,
                               kind == "weighted", n_boot, level)
    for kind in ("weighted", "unweighted")})


# A unit on at more than this share of positions is always on: reported
# apart from a set's robust summaries (`robust_summary`), whose medians
# one such unit, heavy with activity at the base rate, would otherwise set.
ALWAYS_ON = 0.9
# The robust summaries: (name, weighted, index into `SCALARS`).
ROBUST = (("median_purity", False, 0),
          ("weighted_median_purity", True, 0),
          ("activity_share_mostly_pure", True, 2))


class Robust(NamedTuple):
  """A unit set's robust summaries, each an `Interval` over resampled
  document groups, with its always-on units set apart."""

  units: int  # alive units, always-on ones excluded
  intervals: dict[str, Interval]  # by `ROBUST` name
  always_on: Int[np.ndarray, " n"]  # indices of the always-on units
  always_on_share: float  # their share of the set's activity


def always_on(on: Int[np.ndarray, " u"], positions: int
              ) -> np.ndarray:
  """Return whether each unit is on (activity above 0) at more than
  `ALWAYS_ON` of `positions`."""
  return np.asarray(on, np.float64) > ALWAYS_ON * positions


def bootstrap_values(
  coarse: Float[np.ndarray, "g u k"], base: Real[np.ndarray, "g k"],
  seed: int, weighted: bool, n_boot: int = 1000, level: float = 0.95,
) -> dict[str, Interval]:
  """Return, per scalar of `SCALARS`, one unit set's summary with a
  percentile interval from resampling the groups that hold any position
  (`bootstrap_difference` without a second set)."""
  empty = np.zeros((coarse.shape[0], 0, coarse.shape[2]))
  return bootstrap_difference(coarse, empty, base, seed, weighted, n_boot,
                              level, against_nothing=True)


def robust_summary(coarse: Float[np.ndarray, "g u k"],
                   base: Real[np.ndarray, "g k"],
                   on: Int[np.ndarray, " u"], seed: int,
                   n_boot: int = 1000, level: float = 0.95) -> Robust:
  """Return a unit set's `ROBUST` summaries over its units that are not
  always on (`always_on`), each with its bootstrap interval, and the
  always-on units apart."""
  coarse = np.asarray(coarse, np.float64)
  apart = always_on(on, int(np.asarray(base).sum()))
  mass = coarse.sum(axis=(0, 2))
  kept = coarse[:, ~apart]
  by_weighting = {w: bootstrap_values(kept, base, seed, w, n_boot, level)
                  for w in (False, True)}
  intervals = {name: by_weighting[w][SCALARS[i]] for name, w, i in ROBUST}
  return Robust(int((kept.sum(axis=(0, 2)) > 0).sum()), intervals,
                np.flatnonzero(apart),
                float(mass[apart].sum() / max(mass.sum(), 1e-300)))
