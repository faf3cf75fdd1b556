"""What clustering components costs: `./dev bench cluster_time` (named
apart from `analysis/clustering.py`: no two modules share a name).

Times `analysis/clustering.cluster_site` (docs/design.md §15.1) on
synthetic firing of `--cluster_components` components over
`--cluster_positions` positions, and on every site of a harvested run's
co-firing counts (`--cluster_run_dir`, read only: nothing is written
there). The synthetic firing has a known grouping: components belong to
latent groups of 1 to 8, a group fires at a log-uniform rate in
[1e-4, 3e-2] (the spread of a language model's component densities), each
member fires on 90% of its group's positions, and every component also
fires alone at a tenth of its group's rate. The bench reports the seconds
to count co-firing (one matrix product) and to cluster, the clusters
found, and their purity (the share of found clusters inside one latent
group) and recall (the share of latent groups of two or more found whole
as one cluster).
"""

import os
import time

import numpy as np
from absl import app, flags

from decompax.analysis import clustering

from bench import ROOT

_COMPONENTS = flags.DEFINE_integer("cluster_components", 1000,
                                   "Synthetic components.", lower_bound=1)
_POSITIONS = flags.DEFINE_integer("cluster_positions", 100_000,
                                  "Synthetic positions.", lower_bound=1)
_SEED = flags.DEFINE_integer("cluster_seed", 0, "Seed of the synthetic "
                             "firing.")
_RUN_DIR = flags.DEFINE_string(
  "cluster_run_dir", str(ROOT / "runs" / "brown_s"), "A harvested run "
  "whose sites are clustered too (skipped where it has no harvest).")


def synthetic_firing(seed: int, components: int, positions: int
                     ) -> tuple[np.ndarray, np.ndarray]:
  """Return a boolean `[positions, components]` firing matrix and each
  component's latent group."""
  rng = np.random.default_rng(seed)
  sizes = []
  while sum(sizes) < components:
    sizes.append(int(rng.integers(1, 9)))
  group = np.repeat(np.arange(len(sizes)), sizes)[:components]
  rate = np.exp(rng.uniform(np.log(1e-4), np.log(3e-2), len(sizes)))
  fires = rng.random((positions, len(sizes)), np.float32) < rate
  member = rng.random((positions, components), np.float32) < 0.9
  alone = (rng.random((positions, components), np.float32)
           < rate[group] / 10)
  return (fires[:, group] & member) | alone, group


def scores(found: clustering.SiteClusters, group: np.ndarray
           ) -> tuple[float, float]:
  """Return the purity and recall of `found` against the latent groups."""
  pure = [len(set(group[list(c)])) == 1 for c in found.clusters]
  whole = {tuple(c) for c in found.clusters}
  latent = [tuple(np.flatnonzero(group == g)) for g in np.unique(group)]
  multi = [g for g in latent if len(g) > 1]
  return (float(np.mean(pure)),
          float(np.mean([g in whole for g in multi])) if multi else 1.0)


def bench_synthetic() -> None:
  fired, group = synthetic_firing(_SEED.value, _COMPONENTS.value,
                                  _POSITIONS.value)
  start = time.perf_counter()
  counts = clustering.counts_from_firing(fired)
  counted = time.perf_counter()
  found = clustering.cluster_site(counts)
  done = time.perf_counter()
  purity, recall = scores(found, group)
  print(f"synthetic: {_COMPONENTS.value} components x {_POSITIONS.value} "
        f"positions, density {fired.mean():.4f}, "
        f"{len(np.unique(group))} latent groups")
  print(f"  co-firing counts {counted - start:.2f} s, clustering "
        f"{done - counted:.2f} s")
  print(f"  {len(found.clusters)} clusters ({len(found.never_fired)} never "
        f"fire), purity {purity:.3f}, recall {recall:.3f}; "
        f"{found.bits:.0f} bits against {found.singleton_bits:.0f}")


def bench_run(path: str) -> None:
  if not os.path.isfile(os.path.join(path, "harvest", "manifest.json")):
    print(f"{path}: no finished harvest, skipped")
    return
  start = time.perf_counter()
  manifest, counts = clustering.harvest_counts(path)
  read = time.perf_counter()
  found = clustering.cluster_harvest(counts)
  done = time.perf_counter()
  total = sum(sum(map(len, c.clusters)) + len(c.never_fired)
              for c in found.values())
  multi = sum(len(m) > 1 for c in found.values() for m in c.clusters)
  print(f"{path}: {total} components in {len(found)} sites over "
        f"{manifest['positions']} positions")
  print(f"  reading counts {read - start:.2f} s, clustering "
        f"{done - read:.2f} s")
  for site, c in found.items():
    sizes = sorted((len(m) for m in c.clusters), reverse=True)
    print(f"  {site}: {len(c.clusters)} clusters ({sum(s > 1 for s in sizes)}"
          f" of two or more, largest {sizes[:3] if sizes else []}), "
          f"{len(c.never_fired)} never fire")
  print(f"  {multi} clusters of two or more in all")


def main(argv: list[str]) -> None:
  del argv
  bench_synthetic()
  bench_run(_RUN_DIR.value)


if __name__ == "__main__":
  app.run(main)
