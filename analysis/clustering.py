"""Subcomponents grouped into components by the description length of
their firing (design §15.1, invariant I50).

    harvest = harvesting.load_harvest("runs/tms")
    site = clustering.site_counts(harvest, "linear1")
    found = clustering.cluster_site(site)              # SiteClusters
    effects = clustering.cluster_effects(run, inputs, {"linear1": found})

Clusters are per site: the harvest counts co-firing only within a site
(`measures/component_stats.coactivation_counts`), and a component's CI is
read at its own site, so a cross-site cluster would need statistics no
harvest keeps. The input is a site's co-firing count matrix over `n`
positions (diagonal: each component's own count, CI above the harvest's
threshold). A cluster *fires* at a position where any member fires; the
description length of the firing under a partition into clusters is

  L = Σ_K [ n·H(F_K/n) + Σ_{i∈K} F_K·H(f_i/F_K) + (1 + |K|)·½·log2 n ]
      + A·log2 G

(bits; `H` the binary entropy, `f_i` component i's firing count, `F_K`
cluster K's, `A` the components that fire at all, `G` the clusters): which
clusters fire at each position, which members fire where their cluster
does, each cluster's rate and each member's rate given its cluster, and
which cluster each component is in. Singletons are independent Bernoulli
coding, so clusters form only where co-firing says more than the rates.

Merging is greedy and agglomerative: from singletons, the pair of clusters
whose merge lowers L most merges, until no merge lowers it. Ties go to the
pair whose smallest members are lowest (row-major order of the cluster
slots, each slot holding the cluster of its smallest member), so the
result is a pure function of the counts: nothing here draws at random.

`F_K` of a merge of A and B is `F_A + F_B − F_AB`, exact for any pair of
components. Beyond pairs, the merged cluster's co-firing with a third
cluster G is `F_AG + F_BG − min(F_AB, F_AG, F_BG)`: the largest triple
overlap the pairwise counts allow, exact when the firing sets are
identical, nested or disjoint, an estimate otherwise.

Components that never fire are left out (nothing to describe) and listed
apart. The ablation effect of a cluster is the target's divergence
(`explore`'s: KL for language models, MSE for toys, mean over positions)
when all its members are ablated at once, beside the sum of the
divergences of ablating each alone; all these forwards run as one batch
of mask rows through `lax.map`.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from decompax.analysis import explore, harvest_batches, harvest_settings
from decompax.core import masks as masks_lib
from decompax.core.sites import SiteSpec
from decompax.core.target import TargetFns
from decompax.io import harvest_store
from decompax.recipe import lm

# Bits and counts: arrays, or numpy's float64 scalars (a `float`) that
# arithmetic on 0-d arrays gives; shapes that broadcast together.
Real = Float[np.ndarray, "*#s"] | float
# Forwards per `lax.map` batch of the ablation effects.
CHUNK = 16
# Inputs of the ablation effects by default: a toy's forwards cost little;
# a language model's cost a forward of every window per cluster and member
# (brown_s: about 0.4 s per forward of 8 x 64 tokens on two CPU cores).
TOY_EFFECT_BATCH, LM_EFFECT_BATCH = 1024, 8
# The clusters file's format.
VERSION = 1


class SiteCounts(NamedTuple):
  """One site's firing over `positions` positions: `coactive[i, j]`
  positions where i and j both fire, `coactive[i, i]` where i fires."""

  positions: int
  coactive: Int[np.ndarray, "c c"]


class SiteClusters(NamedTuple):
  """One site's partition: each cluster's members (ascending; clusters in
  order of their smallest member), its firing count `F_K`, the components
  that never fire, and L of the partition and of all singletons."""

  clusters: tuple[tuple[int, ...], ...]
  fired: tuple[float, ...]
  never_fired: tuple[int, ...]
  bits: float
  singleton_bits: float


def counts_from_firing(fired: Any) -> SiteCounts:
  """Return the co-firing counts of a boolean `[positions, c]` matrix."""
  f = np.asarray(fired, np.float32)
  # Exact in fp32 while a count stays under 2^24.
  together = np.rint(f.T @ f).astype(np.int64)
  return SiteCounts(int(f.shape[0]), together)


def _xlx(x: Real) -> Real:
  """Return x·log2 x, 0 at 0."""
  # Counts are whole numbers: the maximum only keeps log2 off 0.
  x = np.asarray(x, np.float64)
  return np.where(x > 0, x * np.log2(np.maximum(x, 1.0)), 0.0)


def fire_bits(n: int, big_f: Real) -> Real:
  """Return n·H(F/n): bits saying where a cluster that fires F of n
  positions fires."""
  return _xlx(np.float64(n)) - _xlx(big_f) - _xlx(n - big_f)


def member_bits(big_f: Real, f: Real) -> Real:
  """Return F·H(f/F): bits saying where a member firing f times fires,
  given the F positions its cluster fires."""
  return _xlx(big_f) - _xlx(f) - _xlx(big_f - f)


def param_bits(n: int, size: Int[np.ndarray, "*#s"] | int) -> Real:
  """Return the bits of a cluster of `size` members' rates: its own and
  each member's given it, ½·log2 n each."""
  return (1.0 + np.asarray(size, np.float64)) * 0.5 * np.log2(max(n, 2))


def partition_bits(alive: int, groups: int) -> float:
  """Return A·log2 G: bits naming each firing component's cluster."""
  return alive * float(np.log2(groups)) if groups > 0 else 0.0


class _State(NamedTuple):
  """The greedy merge's arrays over cluster slots (slot = smallest member,
  in alive-component indices): counts `big_f`, co-firing `together`,
  each slot's bits `cost`, the merge gains `delta` (+inf where no merge),
  each component's slot `owner`, `active` slots."""

  f: Float[np.ndarray, " a"]
  big_f: Float[np.ndarray, " a"]
  together: Float[np.ndarray, "a a"]
  cost: Float[np.ndarray, " a"]
  delta: Float[np.ndarray, "a a"]
  owner: Int[np.ndarray, " a"]
  active: np.ndarray


def _union_counts(big_f: Float[np.ndarray, " a"],
                  together: Float[np.ndarray, "a a"], a: int
                  ) -> Float[np.ndarray, " a"]:
  """Return F of slot a merged with each slot, within what the counts
  allow."""
  union = big_f[a] + big_f - together[a]
  return np.clip(union, np.maximum(big_f[a], big_f), big_f[a] + big_f)


def _initial(n: int, coactive: Float[np.ndarray, "a a"]) -> _State:
  """Return the singletons' state, every pair's merge gain computed."""
  f = np.diag(coactive).astype(np.float64)
  a = f.shape[0]
  cost = fire_bits(n, f) + param_bits(n, np.ones(a, np.int64))
  union = f[:, None] + f[None, :] - coactive
  union = np.clip(union, np.maximum(f[:, None], f[None, :]),
                  f[:, None] + f[None, :])
  pair = (fire_bits(n, union) + member_bits(union, f[:, None])
          + member_bits(union, f[None, :]) + param_bits(n, 2))
  delta = pair - cost[:, None] - cost[None, :]
  # Each unordered pair once, at (smaller, larger).
  delta[np.tril_indices(a)] = np.inf
  return _State(f, f.copy(), coactive.astype(np.float64), cost, delta,
                np.arange(a), np.ones(a, bool))


def _gains_of(state: _State, n: int, a: int
              ) -> tuple[Float[np.ndarray, " a"], Float[np.ndarray, " a"]]:
  """Return, per slot g, the bits of slot a merged with g and the gain of
  that merge (+inf for g = a and inactive slots)."""
  union = _union_counts(state.big_f, state.together, a)
  mine = np.flatnonzero(state.owner == a)
  # Members of a, under each candidate union's count.
  inside = member_bits(union[:, None], state.f[mine][None, :]).sum(axis=1)
  # Members of each g, under their own union's count.
  theirs = member_bits(union[state.owner], state.f)
  theirs = np.bincount(state.owner, theirs, minlength=len(state.f))
  sizes = np.bincount(state.owner, minlength=len(state.f))
  bits = (fire_bits(n, union) + inside + theirs
          + param_bits(n, sizes + len(mine)))
  gain = bits - state.cost[a] - state.cost
  gain[~state.active] = np.inf
  gain[a] = np.inf
  return bits, gain


def _merge(state: _State, n: int, a: int, b: int) -> None:
  """Merge slot b into slot a (a < b) in place: the state is `_greedy`'s
  own, and copying its `[a, a]` arrays at every merge would cost more than
  the merges themselves."""
  bits = _gains_of(state, n, a)[0][b]
  big_f, together = state.big_f, state.together
  union = _union_counts(big_f, together, a)[b]
  triple = np.minimum(together[a, b], np.minimum(together[a], together[b]))
  row = np.clip(together[a] + together[b] - triple,
                np.maximum(together[a], together[b]),
                np.minimum(union, big_f))
  big_f[a] = row[a] = union
  together[a], together[:, a] = row, row
  state.cost[a] = bits
  state.owner[state.owner == b] = a
  state.active[b] = False
  state.delta[b, :], state.delta[:, b] = np.inf, np.inf
  gain = _gains_of(state, n, a)[1]
  # Stored at (smaller, larger) slot, as `_initial` does.
  state.delta[a, a + 1:], state.delta[:a, a] = gain[a + 1:], gain[:a]


def _greedy(n: int, coactive: Float[np.ndarray, "a a"]) -> _State:
  """Return the state after every merge that lowers L (design §15.1)."""
  state = _initial(n, coactive)
  alive = groups = len(state.f)
  while groups > 1:
    # Row-major argmin: among equal gains, the lowest pair of slots.
    a, b = divmod(int(np.argmin(state.delta)), state.delta.shape[1])
    change = (state.delta[a, b] + partition_bits(alive, groups - 1)
              - partition_bits(alive, groups))
    if not change < 0:
      break
    _merge(state, n, a, b)
    groups -= 1
  return state


def cluster_site(counts: SiteCounts) -> SiteClusters:
  """Return the partition of one site's firing components that greedy
  merging finds for the description length of design §15.1 (I50)."""
  n = counts.positions
  fired = np.diag(counts.coactive)
  alive = np.flatnonzero(fired > 0)
  never = tuple(int(i) for i in np.flatnonzero(fired <= 0))
  if len(alive) == 0:
    return SiteClusters((), (), never, 0.0, 0.0)
  sub = np.asarray(counts.coactive, np.float64)[np.ix_(alive, alive)]
  start = _initial(n, sub)
  state = _greedy(n, sub)
  slots = np.flatnonzero(state.active)
  clusters = tuple(tuple(int(alive[i]) for i in np.flatnonzero(
    state.owner == s)) for s in slots)
  return SiteClusters(
    clusters, tuple(float(state.big_f[s]) for s in slots), never,
    float(state.cost[slots].sum() + partition_bits(len(alive), len(slots))),
    float(start.cost.sum() + partition_bits(len(alive), len(alive))))


def site_counts(stats: Mapping[str, Any], positions: int) -> SiteCounts:
  """Return one site's counts from its harvest statistics (`coactive`)."""
  return SiteCounts(int(positions), np.asarray(stats["coactive"], np.int64))


def harvest_counts(run_path: str) -> tuple[dict, dict[str, SiteCounts]]:
  """Return the manifest of the finished harvest of the run at `run_path`
  and each site's counts (its `coactive` alone is read); ValueError when
  the run has no finished harvest."""
  manifest = harvest_store.read_manifest(run_path)
  n = int(manifest["positions"])
  return manifest, {site: site_counts(harvest_store.read_arrays(
    run_path, site, ("coactive",)), n) for site in manifest["sites"]}


def cluster_harvest(counts: Mapping[str, SiteCounts]
                    ) -> dict[str, SiteClusters]:
  """Return every site's clusters (`cluster_site`)."""
  return {site: cluster_site(c) for site, c in counts.items()}


def default_effect_batch(run: explore.LoadedRun) -> int:
  """Return the inputs the ablation effects are measured on by default."""
  return LM_EFFECT_BATCH if lm.is_lm(run.config) else TOY_EFFECT_BATCH


def _effect_settings(manifest: Mapping[str, Any], seed: int,
                     batch_size: int) -> harvest_settings.Settings:
  return dataclasses.replace(
    harvest_settings.Settings(**manifest["settings"]), seed=seed,
    batch_size=batch_size)


def effect_inputs(run: explore.LoadedRun, manifest: Mapping[str, Any],
                  seed: int, batch_size: int) -> Any:
  """Return the batch the ablation effects are measured on: the first
  batch the harvest's own source (its token file, or the toy's inputs)
  draws with `seed` and `batch_size`."""
  return harvest_batches.batch_source(
    run, _effect_settings(manifest, seed, batch_size))(0)


def effect_bytes(run: explore.LoadedRun, manifest: Mapping[str, Any],
                 batch_size: int) -> int:
  """Return a floor on the bytes the ablation effects on `batch_size`
  inputs hold at once: the batch and `CHUNK` ablated forwards of it
  (`harvest_batches.batch_bytes`)."""
  return harvest_batches.batch_bytes(
    run, _effect_settings(manifest, 0, batch_size)) * (1 + CHUNK)


def _ablation_rows(sites: tuple[SiteSpec, ...],
                   chosen: Sequence[tuple[str, tuple[int, ...]]]
                   ) -> dict[str, Float[Array, "n c"]]:
  """Return each site's keep vectors, one row per (site, components) in
  `chosen`: those components at 0, every other at 1."""
  rows = {s.name: np.ones((len(chosen), s.c), np.float32) for s in sites}
  for r, (site, members) in enumerate(chosen):
    rows[site][r, list(members)] = 0.0
  return {k: jnp.asarray(v) for k, v in rows.items()}


def ablated_divergences(target: TargetFns, weights, components, inputs: Any,
                        clean: Float[Array, "..."],
                        rows: dict[str, Float[Array, "n c"]], chunk: int
                        ) -> Float[Array, " n"]:
  """Return the target's divergence from `clean` of the masked forward
  keeping `rows[site][r]` (delta path on), per row r, `chunk` forwards at
  a time."""
  lead = tuple(target.batch_lead_shape(inputs))

  def one(keep):
    masks = masks_lib.component_site_masks(target.sites, keep, lead)
    output = target.masked_forward(weights, components, inputs, masks)
    return target.divergence(output, clean)

  return jax.lax.map(one, rows, batch_size=chunk)


class ClusterEffect(NamedTuple):
  """A cluster's joint ablation divergence, the sum of its members' alone,
  and each member's."""

  joint: float
  summed: float
  members: tuple[float, ...]


def effect_jobs(found: Mapping[str, SiteClusters]
                 ) -> list[tuple[str, tuple[int, ...]]]:
  """Return the ablations the multi-member clusters need: per cluster,
  all members at once, then each alone."""
  jobs = []
  for site, clusters in found.items():
    for members in clusters.clusters:
      if len(members) > 1:
        jobs += [(site, members)] + [(site, (m,)) for m in members]
  return jobs


def cluster_effects(run: explore.LoadedRun, inputs: Any,
                    found: Mapping[str, SiteClusters], chunk: int = CHUNK
                    ) -> dict[str, list[ClusterEffect | None]]:
  """Return, per site and cluster (in `found`'s order), its joint and
  summed ablation effects on `inputs`; None for a singleton (joint and
  summed are one ablation there, not measured)."""
  jobs = effect_jobs(found)
  values = np.zeros(0)
  if jobs:
    rows = _ablation_rows(run.target.sites, jobs)
    target, d = run.target, run.decomposition
    clean = jax.jit(lambda w, x: target.clean_forward(w, x, ())[0])(
      run.weights, inputs)
    values = np.asarray(jax.jit(
      lambda w, c, x, y, r: ablated_divergences(target, w, c, x, y, r, chunk))(
        run.weights, d.components, inputs, clean, rows), np.float64)
  out, at = {}, 0
  for site, clusters in found.items():
    out[site] = []
    for members in clusters.clusters:
      if len(members) == 1:
        out[site].append(None)
        continue
      alone = tuple(float(v) for v in values[at + 1: at + 1 + len(members)])
      out[site].append(ClusterEffect(float(values[at]), sum(alone), alone))
      at += 1 + len(members)
  return out


def clusters_record(found: Mapping[str, SiteClusters],
                    effects: Mapping[str, list[ClusterEffect | None]],
                    meta: Mapping[str, Any]) -> dict:
  """Return the clusters file's JSON object: `meta` (seed, threshold, …)
  and per site its clusters, bits and never-firing components."""
  sites = {}
  for site, c in found.items():
    rows = []
    for members, fired, effect in zip(c.clusters, c.fired, effects[site]):
      row = {"members": list(members), "fired": fired}
      if effect is not None:
        row.update(joint=effect.joint, summed=effect.summed,
                   member_effects=list(effect.members))
      rows.append(row)
    sites[site] = {"clusters": rows, "never_fired": list(c.never_fired),
                   "bits": c.bits, "singleton_bits": c.singleton_bits}
  return {"version": VERSION, "objective": "mdl (docs/design.md §15.1)",
          **meta, "sites": sites}
