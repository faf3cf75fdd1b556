"""Cluster a harvested run's components: `bin/cluster --run_dir=D`.

Reads the co-firing counts of `D/harvest/` (`bin/harvest`), groups each
site's components by the description length of their firing
(`analysis/clustering.py`, docs/design.md §15.1), measures each cluster of
two or more members' joint ablation effect beside the sum of its
members' on one batch drawn with `--seed`, and writes
`D/harvest/clusters.json`, which `bin/browse` shows. Prints one line per
site.
"""

import json
import os
import time

from absl import flags, logging

from decompax.analysis import clustering, explore
from decompax.bin import cli, device_memory
from decompax.io import harvest_store, owned_dir, tensor_store

_RUN_DIR = flags.DEFINE_string(
  "run_dir", None, "A finished bin/train run with a finished bin/harvest.",
  required=True)
_SEED = cli.define_seed(
  "seed", 0, "Seed of the batch the ablation effects are measured on (the "
  "clustering itself draws nothing).", __name__)
_BATCH_SIZE = flags.DEFINE_integer(
  "batch_size", None, "Inputs of that batch (token windows of the "
  "harvest's length for a language model); default "
  f"{clustering.TOY_EFFECT_BATCH} for a toy, "
  f"{clustering.LM_EFFECT_BATCH} for a language model, whose every cluster "
  "and member costs a forward of the whole batch.", lower_bound=1)
_EFFECTS = flags.DEFINE_bool(
  "effects", True, "Measure the clusters' ablation effects (one forward "
  "per cluster and per member of a cluster of two or more).")


def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  cli.fail("cluster", message)


def _batch_size(run: explore.LoadedRun) -> int:
  if _BATCH_SIZE.value is not None:
    return _BATCH_SIZE.value
  return clustering.default_effect_batch(run)


def _effects(run_path: str, manifest: dict, found: dict
             ) -> tuple[dict, int | None]:
  """Return the clusters' ablation effects (None each without them) and
  the inputs they were measured on (None: not measured)."""
  none = {site: [None] * len(c.clusters) for site, c in found.items()}
  if not _EFFECTS.value or not clustering.effect_jobs(found):
    return none, None
  try:
    run = explore.load_run(run_path)
    device_memory.check_bytes(
      clustering.effect_bytes(run, manifest, _batch_size(run)),
      f"the ablation effects on --batch_size={_batch_size(run)} inputs "
      f"({clustering.CHUNK} forwards of them at a time)",
      "lower --batch_size, or pass --noeffects")
    inputs = clustering.effect_inputs(run, manifest, _SEED.value,
                                      _batch_size(run))
  except (OSError, ValueError) as e:
    fail(str(e))
  return (clustering.cluster_effects(run, inputs, found),
          _batch_size(run))


def _counts(run_path: str) -> tuple[dict, dict]:
  """Return the harvest's manifest and counts, or fail naming what is
  missing or damaged and how to harvest again."""
  out = os.path.join(run_path, harvest_store.HARVEST_DIR)
  again = (f"rerun bin/harvest --run_dir={run_path} --overwrite to harvest "
           "again")
  try:
    return clustering.harvest_counts(run_path)
  except tensor_store.StoreError as e:   # an array deleted or cut short
    fail(f"a harvest array in {out} cannot be read ({e}); {again}")
  except json.JSONDecodeError as e:
    fail(f"{out}/{harvest_store.MANIFEST} is not JSON ({e}); {again}")
  except (KeyError, TypeError) as e:
    fail(f"{out}/{harvest_store.MANIFEST} lacks {e}; {again}")
  except (OSError, ValueError) as e:
    fail(str(e))


def _enter_harvest(run_path: str) -> None:
  """Take the harvest's lock until the process ends (no harvest rewrites
  what this reads), listing the clusters among the harvest's entries."""
  out = os.path.join(owned_dir.named(run_path, "run_dir"),
                     harvest_store.HARVEST_DIR)
  if os.path.isdir(out):
    owned_dir.enter(out, "harvest", "harvest", harvest_store.CLUSTERS)


def _line(site: str, c: clustering.SiteClusters) -> str:
  multi = sum(len(m) > 1 for m in c.clusters)
  return (f"{site}: {len(c.clusters)} clusters ({multi} of two or more) of "
          f"{sum(map(len, c.clusters))} firing components, "
          f"{len(c.never_fired)} never fire; {c.bits:.0f} bits against "
          f"{c.singleton_bits:.0f} as singletons")


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; use --run_dir=DIR")
  run_path = _RUN_DIR.value
  try:
    _enter_harvest(run_path)
  except ValueError as e:
    fail(str(e))
  manifest, counts = _counts(run_path)
  start = time.perf_counter()
  found = clustering.cluster_harvest(counts)
  seconds = time.perf_counter() - start
  effects, batch_size = _effects(run_path, manifest, found)
  record = clustering.clusters_record(found, effects, {
    "seed": _SEED.value, "batch_size": batch_size,
    "threshold": manifest["settings"]["threshold"],
    "positions": manifest["positions"],
    "decomposition_step": manifest["settings"]["decomposition_step"]})
  try:
    path = harvest_store.write_clusters(run_path, record)
  except OSError as e:
    fail(owned_dir.refusal(e, harvest_store.clusters_path(run_path)))
  for site, c in found.items():
    print(_line(site, c))
  print(f"clustered in {seconds:.2f}s; wrote {path}")


def entry() -> None:
  """Launch the absl app (used by the `bin/cluster` launcher)."""
  cli.launch("cluster", main)


if __name__ == "__main__":
  entry()
