"""CI on feature probes and the toy recovery metrics (SPEC §10, §11).

A probe is a batch of single-feature inputs; its CI is a `[n_features, C]`
matrix per site. Metrics here run on host numpy arrays after the probe.
"""

from typing import NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
import scipy.optimize
from jaxtyping import Array, Float

from decompax.core import squash
from decompax.core.ci_fns import CIFn
from decompax.core.sites import Components
from decompax.core.target import Batch, Expected, TargetFns, Weights

IDENTITY_TOL = 0.1
# A contribution under this share of a feature's norm is no candidate for
# its match: its direction is rounding and training residue, not the
# feature's mechanism. Trained TMS runs leave dead components at ~1e-8 of a
# column whose cosine with it, in a 2-dim hidden space, can beat the live
# component's (SPEC §10's argmax would then report ML2R ~0 for that feature).
MATCH_MIN_NORM_RATIO = 1e-3


def _probe_inputs(target: TargetFns) -> Batch:
  if target.feature_probe is None:
    raise ValueError("this target has no feature probe")
  return target.feature_probe()


def probe_ci(
  target: TargetFns, ci_fn: CIFn, weights: Weights, components: Components,
  ci_params: object,
) -> dict[str, Float[Array, "n c"]]:
  """Return each site's lower CI on the target's one-feature probe inputs."""
  inputs = _probe_inputs(target)
  _, taps = target.clean_forward(weights, inputs, ci_fn.input_taps)
  return squash.squash(ci_fn.apply(ci_params, taps, components)).lower


def probe_read_vectors(target: TargetFns, weights: Weights
                       ) -> dict[str, Float[Array, "n d"]]:
  """Return, per site, how each one-feature probe moves the site's output
  from its output on a zero input: the part of the feature the site's
  target weight carries, as a vector. Token ids have no zero input: their
  reads are taken from a zero output, what the zero one-hot gives at an
  embedding site (SPEC §3.7)."""
  inputs = _probe_inputs(target)
  outs = tuple(f"{s.name}.out" for s in target.sites)
  _, taps = target.clean_forward(weights, inputs, outs)
  if jnp.issubdtype(inputs.dtype, jnp.integer):
    zero_taps = {k: jnp.zeros_like(v) for k, v in taps.items()}
  else:
    _, zero_taps = target.clean_forward(weights, inputs * 0, outs)
  return {s.name: taps[f"{s.name}.out"] - zero_taps[f"{s.name}.out"]
          for s in target.sites}


def probe_reads(target: TargetFns, weights: Weights
                ) -> dict[str, Float[Array, " n"]]:
  """Return, per site, how far each one-feature probe moves the site's
  output (the norms of `probe_read_vectors`)."""
  return {name: jnp.linalg.norm(moved, axis=-1)
          for name, moved in probe_read_vectors(target, weights).items()}


def weak_read_ratio(ci: np.ndarray, reads: np.ndarray,
                    tol: float = IDENTITY_TOL) -> float:
  """Return the weak features' mean read over the other features' (NaN
  unless both kinds exist).

  A weak feature, one whose largest CI stays below `1 − tol`, that the
  site barely reads costs little reconstruction when only partly kept, so
  the importance penalty holds its CI down: a ratio well under 1 says the
  weak features are the site's faint ones, not lost ones.
  """
  weak = weak_features(ci, tol)
  reads = np.asarray(reads)
  if weak.all() or not weak.any():
    return float("nan")
  return float(reads[weak].mean() / reads[~weak].mean())


class SharedReads(NamedTuple):
  """How parallel the reads of the features that shared components serve
  are, next to every pair of the site's features: `cosine`, the lowest
  cosine between the reads of two features one component serves;
  `as_parallel`, how many of the site's `pairs` of features have reads at
  that cosine or above. A component serving a pair among the site's most
  parallel (`as_parallel` small) has found a pair that one rank-1 piece
  can almost write alone; one serving a group at a low cosine has not."""

  cosine: float
  as_parallel: int
  pairs: int


def shared_reads(ci: np.ndarray, vectors: np.ndarray,
                 tol: float = IDENTITY_TOL) -> Optional[SharedReads]:
  """Return how parallel the reads (`vectors`, `[n_features, d]`) of the
  features that `ci`'s shared components serve are, or None when no
  component serves several features or some read is zero."""
  groups = [f for f in active_features(ci, tol).values() if len(f) > 1]
  vectors = np.asarray(vectors, np.float64)
  norms = np.linalg.norm(vectors, axis=1, keepdims=True)
  if not groups or not norms.all():
    return None
  unit = vectors / norms
  cosines = unit @ unit.T
  lowest = min(cosines[np.ix_(f, f)].min() for f in groups)
  upper = cosines[np.triu_indices(len(cosines), 1)]
  return SharedReads(cosine=float(lowest),
                     as_parallel=int((upper >= lowest).sum()),
                     pairs=len(upper))


def identity_permutation(ci: np.ndarray) -> list[int]:
  """Return column order matching rows to columns (Hungarian on −CI).

  Matched columns come first in row order; unassigned columns follow by
  descending column mass.
  """
  ci = np.asarray(ci)
  rows, cols = scipy.optimize.linear_sum_assignment(-ci)
  matched = [int(c) for _, c in sorted(zip(rows, cols))]
  rest = [c for c in np.argsort(-ci.sum(0), kind="stable") if c not in matched]
  return matched + [int(c) for c in rest]


def dense_permutation(ci: np.ndarray) -> list[int]:
  """Return the column order of a dense CI pattern: descending column mass
  (SPEC §11), ties in index order."""
  return [int(c) for c in np.argsort(-np.asarray(ci).sum(0), kind="stable")]


def pattern_permutation(ci: np.ndarray, expected: Optional[Expected]
                        ) -> list[int]:
  """Return the column order of `expected`'s pattern (identity when None)."""
  if expected is not None and expected.pattern == "dense":
    return dense_permutation(ci)
  return identity_permutation(ci)


def identity_ci_error(ci: np.ndarray, tol: float = IDENTITY_TOL) -> int:
  """Return the count of entries breaking an identity CI pattern.

  After the identity permutation: entries `> tol` off the square block's
  diagonal (overcomplete columns included) plus diagonal entries `< 1 − tol`.
  """
  ci = np.asarray(ci)
  permuted = ci[:, identity_permutation(ci)]
  n = min(permuted.shape)
  diagonal = np.zeros_like(permuted, dtype=bool)
  diagonal[np.arange(n), np.arange(n)] = True
  off = int(np.sum((permuted > tol) & ~diagonal))
  weak = int(np.sum(np.diag(permuted[:, :n]) < 1.0 - tol))
  return off + weak


def dense_ci_error(ci: np.ndarray, k: int, tol: float = IDENTITY_TOL) -> int:
  """Return the count of entries breaking a `k`-column dense CI pattern.

  Columns sorted by mass: first-`k` columns with no entry `≥ 1 − tol`, plus
  every entry `> tol` in the remaining columns.
  """
  block, rest = _dense_block_and_rest(ci, k)
  return _missing_block_columns(block, tol) + int(np.sum(rest > tol))


def _dense_block_and_rest(ci: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
  """Return the first `k` columns by mass and the columns after them."""
  ci = np.asarray(ci)
  order = dense_permutation(ci)
  return ci[:, order[:k]], ci[:, order[k:]]


def _missing_block_columns(block: np.ndarray, tol: float) -> int:
  return int(np.sum(~np.any(block >= 1.0 - tol, axis=0)))


def alive_components(ci: np.ndarray, threshold: float = IDENTITY_TOL) -> list[int]:
  """Return the components whose CI exceeds `threshold` on some probe input."""
  return [int(c) for c in np.flatnonzero(np.asarray(ci).max(0) > threshold)]


def active_features(ci: np.ndarray, threshold: float = IDENTITY_TOL) -> dict[int, list[int]]:
  """Return, per alive component, the features on which it is active."""
  ci = np.asarray(ci)
  return {c: [int(f) for f in np.flatnonzero(ci[:, c] > threshold)]
          for c in alive_components(ci, threshold)}


class IdentityBreaks(NamedTuple):
  """How an identity CI pattern breaks, in the forms the toys' failures take.

  `shared`: components active on several features, one rank-1 piece serving
  them all; `shared_features`: the features those components touch; `split`:
  features with several active components; `weak`: features whose largest CI
  stays below `1 − tol`, so no component is fully kept for them;
  `lowest_peak`: the smallest feature's largest CI, which tells a feature
  kept at 0.5 from one that misses the threshold in the third decimal.
  """

  shared: int
  shared_features: int
  split: int
  weak: int
  lowest_peak: float


def weak_features(ci: np.ndarray, tol: float = IDENTITY_TOL) -> np.ndarray:
  """Return which features (rows of `ci`) no component keeps at `1 − tol`."""
  return np.asarray(ci).max(1) < 1.0 - tol


def identity_breaks(ci: np.ndarray, tol: float = IDENTITY_TOL) -> IdentityBreaks:
  """Return the ways `ci` (`[n_features, C]`) departs from an identity."""
  ci = np.asarray(ci)
  active = ci > tol
  shared = active.sum(0) > 1
  return IdentityBreaks(
    shared=int(shared.sum()),
    shared_features=int(active[:, shared].any(1).sum()),
    split=int((active.sum(1) > 1).sum()),
    weak=int(weak_features(ci, tol).sum()),
    lowest_peak=float(ci.max(1).min()))


class DenseBreaks(NamedTuple):
  """How a `k`-column dense CI pattern breaks: `extra` components past the
  first `k` by mass that are active on some probe, the `extra_features`
  they serve, `missing` block columns that never reach `1 − tol`, and
  `lowest_peak`, the smallest largest CI of a block column: a column that
  peaks at 0.3 is a faint piece, one that peaks at 0.899 a kept piece that
  misses the threshold in the third decimal."""

  extra: int
  extra_features: int
  missing: int
  lowest_peak: float


def dense_breaks(ci: np.ndarray, k: int, tol: float = IDENTITY_TOL) -> DenseBreaks:
  """Return the ways `ci` departs from a `k`-column dense pattern."""
  block, rest = _dense_block_and_rest(ci, k)
  active = rest > tol
  return DenseBreaks(
    extra=int(active.any(0).sum()), extra_features=int(active.any(1).sum()),
    missing=_missing_block_columns(block, tol),
    lowest_peak=float(block.max(0).min()))


def pattern_error(ci: np.ndarray, expected: Expected) -> int:
  """Return the CI error against `expected`'s pattern (identity or dense)."""
  if expected.pattern == "dense":
    return dense_ci_error(ci, expected.k)
  return identity_ci_error(ci)


def pattern_breaks(ci: np.ndarray, expected: Expected
                   ) -> IdentityBreaks | DenseBreaks:
  """Return how `ci` departs from `expected`'s pattern (identity or dense)."""
  if expected.pattern == "dense":
    return dense_breaks(ci, expected.k)
  return identity_breaks(ci)


class FeatureMatch(NamedTuple):
  """The SPD paper's Table 1 match of one site's subcomponents to its
  target weight (SPEC §10): MMCS and ML2R averaged over features, and per
  feature the best-matching component."""

  mmcs: float
  ml2r: float
  best: np.ndarray


def feature_match(
  weight: Float[np.ndarray, "d_in d_out"], v: Float[np.ndarray, "d_in c"],
  u: Float[np.ndarray, "c d_out"], feature_axis: int,
) -> FeatureMatch:
  """Match each feature's weight vector to the subcomponents' parts for it.

  With `feature_axis` 0, feature `f` writes `W[f]` and component `c`
  contributes `V[f, c]·U[c]` to it; with 1, `W[:, f]` and `V[:, c]·U[c, f]`.
  MMCS is the mean over features of the largest cosine similarity between
  the two; ML2R the mean norm ratio of that best component's contribution
  to the feature's vector (1 for an exact rank-1 split). Only contributions
  of at least `MATCH_MIN_NORM_RATIO` of the feature's norm compete; a
  feature with none scores 0 on both.
  """
  weight, v, u = (np.asarray(a, np.float64) for a in (weight, v, u))
  if feature_axis == 1:
    weight, v, u = weight.T, u.T, v.T
  contribution = v[:, :, None] * u[None, :, :]        # [n, C, d]
  target_norm = np.maximum(np.linalg.norm(weight, axis=-1), 1e-30)  # [n]
  norms = np.linalg.norm(contribution, axis=-1)        # [n, C]
  ratio = norms / target_norm[:, None]
  dots = np.einsum("ncd,nd->nc", contribution, weight)
  cosine = dots / np.maximum(norms * target_norm[:, None], 1e-30)
  candidate = ratio >= MATCH_MIN_NORM_RATIO
  best = np.argmax(np.where(candidate, cosine, -np.inf), axis=1)
  rows = np.arange(len(best))
  matched = candidate[rows, best]
  return FeatureMatch(
    mmcs=float(np.mean(np.where(matched, cosine[rows, best], 0.0))),
    ml2r=float(np.mean(np.where(matched, ratio[rows, best], 0.0))),
    best=best)
