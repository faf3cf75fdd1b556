"""What two runs of one recipe share when their components do not pair.

`matching` pairs components one to one; a site whose pairs all fall short
of the threshold has stability 0, which says nothing of *why*. Three
coarser measures, each against its chance level, tell the cases apart
(`docs/brown.md`, "Identifiability"):

- the alive sets' spans: the mean squared cosine of the principal angles
  between the spans of the two runs' read directions (the columns of `V`
  of the alive components) and of their write directions (the rows of
  `U`), beside what two random spans of the same ranks score (the larger
  rank over the dimension). Equal to chance: nothing of the subspace is
  shared; near 1 while chance is low: the same subspace, split
  differently;
- the same inputs, other weights: each alive component of the first run
  takes the second run's component whose CI is most alike (its largest CI
  cosine, no one-to-one constraint), and the weight cosine of that
  partner;
- co-firing groups: a component's group is every alive component of its
  run whose CI cosine with it is at least `tau` (itself included); the
  group's summed weight `Σ v uᵀ` is compared with the summed weight of
  the other run's components at CI cosine `tau` or more with it. Rank-1
  pieces that always fire together are free to rotate among themselves
  at no cost to any loss term, so their sum can be stable where the
  pieces are not.

Per site each measure is a median over the first run's alive components.
Beside them, the first run's heaviest component: its share of the site's
CI mass and of the input positions where it is on. One component both on
almost everywhere and holding most of the mass is a dense direction the
site keeps whole, not a sparse mechanism.
"""

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
from jaxtyping import Float, Shaped

from decompax.analysis import matching
from decompax.measures import probe

TAU = 0.5
# Singular values under this share of the largest span no direction.
_RANK_RTOL = 1e-3


class SiteIdentifiability(NamedTuple):
  """One site's shared structure between two runs (module docstring)."""

  alive_a: int
  alive_b: int
  read_overlap: float
  read_chance: float
  write_overlap: float
  write_chance: float
  best_ci_cosine: float
  partner_weight_cosine: float
  cofiring_share: float
  group_weight_cosine: float
  top_mass_share: float
  top_on_share: float


def heaviest_component(ci: Float[np.ndarray, "n c"], threshold: float
                       ) -> tuple[int, float, float]:
  """Return the component holding the largest share of the CI mass of
  `ci` (one row per input position), that share, and the share of
  positions where its CI exceeds `threshold` (NaN shares without mass)."""
  ci = np.asarray(ci, np.float64)
  mass = ci.sum(axis=0)
  total = float(mass.sum())
  if total <= 0:
    return 0, float("nan"), float("nan")
  top = int(np.argmax(mass))
  return top, float(mass[top]) / total, float(np.mean(ci[:, top] > threshold))


def span_basis(x: Float[np.ndarray, "d k"]) -> Float[np.ndarray, "d r"]:
  """Return an orthonormal basis of the span of `x`'s columns, dropping
  directions under `_RANK_RTOL` of the largest singular value."""
  x = np.asarray(x, np.float64)
  if x.shape[1] == 0:
    return x
  q, s, _ = np.linalg.svd(x, full_matrices=False)
  return q[:, s > _RANK_RTOL * s[0]] if s[0] > 0 else q[:, :0]


def subspace_overlap(a: Float[np.ndarray, "d ka"],
                     b: Float[np.ndarray, "d kb"]) -> tuple[float, float]:
  """Return the mean squared cosine of the principal angles between the
  spans of `a`'s and `b`'s columns, and its chance level: what random
  spans of the same ranks score on average (the larger rank over `d`).
  NaN for an empty span."""
  qa, qb = span_basis(a), span_basis(b)
  ra, rb = qa.shape[1], qb.shape[1]
  if min(ra, rb) == 0:
    return float("nan"), float("nan")
  overlap = float(np.sum((qa.T @ qb) ** 2)) / min(ra, rb)
  return overlap, max(ra, rb) / a.shape[0]


def group_weight_cosines(
  v_a: Float[np.ndarray, "i ca"], u_a: Float[np.ndarray, "ca o"],
  v_b: Float[np.ndarray, "i cb"], u_b: Float[np.ndarray, "cb o"],
  groups_a: Shaped[np.ndarray, "n ca"], groups_b: Shaped[np.ndarray, "n cb"],
) -> Float[np.ndarray, " n"]:
  """Return, for each row `g`, the cosine of the summed weights
  `Σ_c groups_a[g, c] v_c u_cᵀ` of the first run and likewise of the
  second, from inner products of the factors alone (0 for an empty sum)."""
  v_a, u_a, v_b, u_b = (np.asarray(x, np.float64)
                        for x in (v_a, u_a, v_b, u_b))

  def gram(v, u, v2, u2):
    return (v.T @ v2) * (u @ u2.T)

  ga, gb = np.asarray(groups_a, np.float64), np.asarray(groups_b, np.float64)
  inner = np.einsum("ga,ab,gb->g", ga, gram(v_a, u_a, v_b, u_b), gb)
  norm_a = np.einsum("ga,ab,gb->g", ga, gram(v_a, u_a, v_a, u_a), ga)
  norm_b = np.einsum("ga,ab,gb->g", gb, gram(v_b, u_b, v_b, u_b), gb)
  norms = np.sqrt(np.maximum(norm_a, 0) * np.maximum(norm_b, 0))
  return np.where(norms > 0, inner / np.maximum(norms, 1e-300), 0.0)


def _median(values: np.ndarray) -> float:
  return float(np.median(values)) if len(values) else float("nan")


def site_identifiability(a: matching.SiteArrays, b: matching.SiteArrays,
                         tau: float = TAU) -> SiteIdentifiability:
  """Return one site's measures of what `a` and `b` share (module
  docstring), over the alive components of each."""
  alive_a, alive_b = (np.asarray(probe.alive_components(x.ci,
                                                          x.alive_threshold),
                                  np.int64) for x in (a, b))
  va, ua = a.v[:, alive_a], a.u[alive_a]
  vb, ub = b.v[:, alive_b], b.u[alive_b]
  read, read_chance = subspace_overlap(va, vb)
  write, write_chance = subspace_overlap(ua.T, ub.T)
  across = matching.ci_cosines(a.ci[:, alive_a], b.ci[:, alive_b])
  within = matching.ci_cosines(a.ci[:, alive_a], a.ci[:, alive_a])
  if len(alive_b):
    partner = np.argmax(across, axis=1)
    rows = np.arange(len(alive_a))
    best_ci = across[rows, partner]
    weight = matching.weight_cosines(va, ua, vb, ub)[rows, partner]
  else:
    best_ci = weight = np.zeros(0)
  others = (within >= tau) & ~np.eye(len(alive_a), dtype=bool)
  groups = group_weight_cosines(va, ua, vb, ub, within >= tau, across >= tau)
  _, mass_share, on_share = heaviest_component(a.ci, a.alive_threshold)
  return SiteIdentifiability(
    len(alive_a), len(alive_b), read, read_chance, write, write_chance,
    _median(best_ci), _median(weight),
    float(np.mean(np.any(others, axis=1))) if len(alive_a) else float("nan"),
    _median(groups), mass_share, on_share)


def identifiability(a: Mapping[str, matching.SiteArrays],
                    b: Mapping[str, matching.SiteArrays], tau: float = TAU
                    ) -> dict[str, SiteIdentifiability]:
  """Return every site's measures, in `a`'s site order."""
  if list(a) != list(b):
    raise ValueError(f"the runs decompose different sites: {list(a)} and "
                     f"{list(b)}; compare runs of the same target and sites")
  return {site: site_identifiability(a[site], b[site], tau) for site in a}


def markdown_table(sites: Mapping[str, SiteIdentifiability], tau: float
                   ) -> str:
  """Return one markdown row per site of `identifiability`'s measures."""
  lines = [f"| site | alive A / B | read span (chance) | write span (chance) "
           f"| best CI cos | its weight cos | co-firing at {tau:g} "
           f"| group weight cos | A's heaviest: mass / on |",
           "|---|---|---|---|---|---|---|---|---|"]
  for site, m in sites.items():
    lines.append(
      f"| {site} | {m.alive_a} / {m.alive_b} | {m.read_overlap:.2f} "
      f"({m.read_chance:.2f}) | {m.write_overlap:.2f} ({m.write_chance:.2f})"
      f" | {m.best_ci_cosine:.2f} | {m.partner_weight_cosine:.2f} | "
      f"{m.cofiring_share:.2f} | {m.group_weight_cosine:.2f} | "
      f"{m.top_mass_share:.2f} / {m.top_on_share:.2f} |")
  return "\n".join(lines) + "\n"
