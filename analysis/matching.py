"""Components of two runs paired site by site, and how stable a site is.

    a, b = explore.load_run("runs/s0"), explore.load_run("runs/s1")
    inputs = matching.shared_inputs(a)
    sites = matching.match_runs(a, b, inputs)          # {site: SiteMatch}
    print(matching.markdown_table(sites, threshold=0.9))

Two components of one site are compared by two cosines:

- weight: the cosine of their flattened rank-1 weights `V_c U_c`, from
  `⟨v uᵀ, v' u'ᵀ⟩ = (v·v')(u·u')` without forming a `d_in × d_out` product.
  It is signed: `(−v, −u)` writes the same weight and scores +1, but one
  factor negated writes the opposite weight and scores −1, a component
  that undoes what the other writes, not the same one.
- CI: the cosine of their CI over the same inputs (every input position
  a coordinate), so two components count alike only when the same inputs
  switch them on.

A pair's similarity is the smaller of the two: a match needs both the
same weight and the same inputs. Each site's alive components (CI above
the run's own `--ci_alive_threshold` on some input) are paired one to one
by the assignment of largest total similarity (Hungarian); the delta
component is no component and never matched. A site's stability is the
share of the first run's alive components whose pair reaches
`threshold` (NaN where the first run has none alive).
"""

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
from jaxtyping import Float

from decompax.analysis import explore
from decompax.core import sites as sites_lib
from decompax.measures import probe
from decompax.recipe import assembly

THRESHOLD = 0.9
BATCH_SIZE = 1024
SEED = 0
# Norms under this count as zero: a zero column's cosine is 0, not NaN.
_TINY = 1e-30


class SiteArrays(NamedTuple):
  """One site of one run: its factors and its CI on the shared inputs, one
  row per input position, and the CI above which a component is alive."""

  v: Float[np.ndarray, "d_in c"]
  u: Float[np.ndarray, "c d_out"]
  ci: Float[np.ndarray, "n c"]
  alive_threshold: float


class SiteMatch(NamedTuple):
  """One site's pairing: the alive components of each run, the matched
  pairs (`a[i]` of the first run with `b[i]` of the second, by their
  indices in the runs) with their cosines and similarity, and the share
  of the first run's alive components matched at `threshold` or above."""

  alive_a: np.ndarray
  alive_b: np.ndarray
  a: np.ndarray
  b: np.ndarray
  weight_cosine: np.ndarray
  ci_cosine: np.ndarray
  similarity: np.ndarray
  threshold: float
  stability: float


def weight_cosines(v_a: Float[np.ndarray, "i ca"],
                   u_a: Float[np.ndarray, "ca o"],
                   v_b: Float[np.ndarray, "i cb"],
                   u_b: Float[np.ndarray, "cb o"]
                   ) -> Float[np.ndarray, "ca cb"]:
  """Return the cosine of every pair's flattened `V_c U_c`, signed."""
  v_a, u_a, v_b, u_b = (np.asarray(x, np.float64)
                        for x in (v_a, u_a, v_b, u_b))
  inner = (v_a.T @ v_b) * (u_a @ u_b.T)
  norm_a = np.linalg.norm(v_a, axis=0) * np.linalg.norm(u_a, axis=1)
  norm_b = np.linalg.norm(v_b, axis=0) * np.linalg.norm(u_b, axis=1)
  return inner / np.maximum(np.outer(norm_a, norm_b), _TINY)


def ci_cosines(ci_a: Float[np.ndarray, "n ca"], ci_b: Float[np.ndarray, "n cb"]
               ) -> Float[np.ndarray, "ca cb"]:
  """Return the cosine of every pair's CI over the same `n` inputs."""
  ci_a, ci_b = np.asarray(ci_a, np.float64), np.asarray(ci_b, np.float64)
  norms = np.outer(np.linalg.norm(ci_a, axis=0), np.linalg.norm(ci_b, axis=0))
  return (ci_a.T @ ci_b) / np.maximum(norms, _TINY)


def assign(similarity: Float[np.ndarray, "ra rb"]
           ) -> tuple[np.ndarray, np.ndarray]:
  """Return the one-to-one pairing `(rows, cols)` of largest total
  similarity (Hungarian), rows ascending; min(ra, rb) pairs."""
  rows, cols = scipy.optimize.linear_sum_assignment(
    np.asarray(similarity, np.float64), maximize=True)
  return rows, cols


def match_site(a: SiteArrays, b: SiteArrays, threshold: float = THRESHOLD
               ) -> SiteMatch:
  """Return the pairing of `a`'s and `b`'s alive components (see the
  module docstring for the similarity and the stability)."""
  alive_a, alive_b = (np.asarray(probe.alive_components(x.ci,
                                                          x.alive_threshold),
                                  np.int64) for x in (a, b))
  weight = weight_cosines(a.v[:, alive_a], a.u[alive_a],
                          b.v[:, alive_b], b.u[alive_b])
  ci = ci_cosines(a.ci[:, alive_a], b.ci[:, alive_b])
  similarity = np.minimum(weight, ci)
  rows, cols = assign(similarity)
  pair_similarity = similarity[rows, cols]
  stability = (float(np.sum(pair_similarity >= threshold)) / len(alive_a)
               if len(alive_a) else float("nan"))
  return SiteMatch(alive_a, alive_b, alive_a[rows], alive_b[cols],
                   weight[rows, cols], ci[rows, cols], pair_similarity,
                   threshold, stability)


def match_arrays(a: Mapping[str, SiteArrays], b: Mapping[str, SiteArrays],
                 threshold: float = THRESHOLD) -> dict[str, SiteMatch]:
  """Return every site's pairing, in `a`'s site order."""
  if list(a) != list(b):
    raise ValueError(f"the runs decompose different sites: {list(a)} and "
                     f"{list(b)}; match runs of the same target and sites")
  return {site: match_site(a[site], b[site], threshold) for site in a}


def check_comparable(run_a: explore.LoadedRun, run_b: explore.LoadedRun
                     ) -> None:
  """Raise ValueError unless both runs decompose the same target's same
  sites (names and shapes; their component counts may differ)."""
  if run_a.config.target != run_b.config.target:
    raise ValueError(f"the runs decompose different targets "
                     f"({run_a.config.target} and {run_b.config.target}); "
                     "match runs of the same target")
  shapes = [[(s.name, s.d_in, s.d_out) for s in run.decomposition.sites]
            for run in (run_a, run_b)]
  if shapes[0] != shapes[1]:
    raise ValueError(f"the runs decompose different sites ({shapes[0]} and "
                     f"{shapes[1]}, as name, d_in, d_out); match runs of "
                     "the same target and sites")


def shared_inputs(run: explore.LoadedRun, batch_size: int = BATCH_SIZE,
                  seed: int = SEED) -> Any:
  """Return a batch of the run's own inputs (a toy's samples, token
  windows of a language model's data), drawn from `seed`; for a toy with
  one-feature probe inputs, the probe's rows come first."""
  record = assembly.resolve_target(run.config).record
  batch = record.sample_inputs(jax.random.key(seed), batch_size)
  probe = run.target.feature_probe
  if probe is None:
    return batch
  rows = probe()
  if rows.shape[1:] != batch.shape[1:]:
    return batch
  return jnp.concatenate([rows.astype(batch.dtype), batch])


def site_arrays(run: explore.LoadedRun, inputs: Any
                ) -> dict[str, SiteArrays]:
  """Return every site's factors and its CI on `inputs` as host arrays,
  CI flattened to one row per input position."""
  ci = explore.component_ci(run, inputs)
  out = {}
  for site in run.decomposition.sites:
    v, u = sites_lib.site_factors(run.decomposition.components, site)
    values = np.asarray(ci[site.name], np.float64)
    out[site.name] = SiteArrays(
      np.asarray(v), np.asarray(u), values.reshape(-1, values.shape[-1]),
      float(run.config.ci_alive_threshold))
  return out


def match_runs(run_a: explore.LoadedRun, run_b: explore.LoadedRun,
               inputs: Any, threshold: float = THRESHOLD
               ) -> dict[str, SiteMatch]:
  """Return every site's pairing of `run_a`'s components with `run_b`'s
  on `inputs` (see `shared_inputs`)."""
  check_comparable(run_a, run_b)
  return match_arrays(site_arrays(run_a, inputs), site_arrays(run_b, inputs),
                      threshold)


def _mean(values: np.ndarray) -> str:
  return f"{float(np.mean(values)):.3f}" if len(values) else "–"


def markdown_table(matches: Mapping[str, SiteMatch]) -> str:
  """Return one markdown row per site: alive components of each run,
  pairs matched, pairs at the threshold or above, the mean similarity and
  cosines of the pairs, and the stability."""
  lines = ["| site | alive A | alive B | pairs | ≥ threshold | similarity "
           "| weight cos | CI cos | stability |",
           "|---|---|---|---|---|---|---|---|---|"]
  for site, m in matches.items():
    above = int(np.sum(m.similarity >= m.threshold))
    stability = "–" if np.isnan(m.stability) else f"{m.stability:.2f}"
    lines.append(
      f"| {site} | {len(m.alive_a)} | {len(m.alive_b)} | {len(m.a)} | "
      f"{above} | {_mean(m.similarity)} | {_mean(m.weight_cosine)} | "
      f"{_mean(m.ci_cosine)} | {stability} |")
  return "\n".join(lines) + "\n"


def pair_lines(matches: Mapping[str, SiteMatch]) -> str:
  """Return every matched pair, one markdown row each."""
  lines = ["| site | A | B | similarity | weight cos | CI cos |",
           "|---|---|---|---|---|---|"]
  for site, m in matches.items():
    for i in range(len(m.a)):
      lines.append(f"| {site} | {m.a[i]} | {m.b[i]} | {m.similarity[i]:.3f} "
                   f"| {m.weight_cosine[i]:.3f} | {m.ci_cosine[i]:.3f} |")
  return "\n".join(lines) + "\n"
