"""Pair two runs' components site by site: `bin/match --run_a=A --run_b=B`.

Prints a markdown table, one row per site: each run's alive components,
the pairs the assignment makes, how many reach `--threshold`, their mean
similarity and cosines, and the site's stability (the rule is
`analysis/matching.py`'s). A second table says what the runs share where
components do not pair one to one: the alive sets' spans, the weights of
components that fire on the same inputs, and co-firing groups
(`analysis/identifiability.py`). `--pairs` also prints every pair.
"""

import math

import jax
from absl import flags, logging

from decompax.analysis import explore
from decompax.analysis import identifiability
from decompax.analysis import matching
from decompax.bin import cli, device_memory

_RUN_A = flags.DEFINE_string(
  "run_a", None, "The first run's directory (a finished bin/train run); "
  "stability is the share of its alive components matched.", required=True)
_RUN_B = flags.DEFINE_string(
  "run_b", None, "The second run's directory, of the same target and "
  "sites.", required=True)
_THRESHOLD = cli.define_float(
  "threshold", matching.THRESHOLD, "Similarity at which a pair counts as "
  "the same component (in [-1, 1]).", __name__)
_BATCH_SIZE = flags.DEFINE_integer(
  "batch_size", matching.BATCH_SIZE, "Inputs the CI patterns are taken "
  "over (the first run's own samples; token windows for a language "
  "model; at most 2**31 - 1, and what memory holds).", lower_bound=1,
  upper_bound=2**31 - 1)
_SEED = cli.define_seed("seed", matching.SEED, "Seed of the shared inputs.",
                       __name__)
_TAU = flags.DEFINE_float(
  "tau", identifiability.TAU, "CI cosine at which two components count as"
  " firing together, for the co-firing groups.")
_PAIRS = flags.DEFINE_bool("pairs", False, "Also print every matched pair.")


def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  cli.fail("match", message)


def _load(flag: str, path: str) -> explore.LoadedRun:
  try:
    return explore.load_run(path)
  except (OSError, ValueError) as e:
    fail(f"--{flag}: {e}")


def _bytes(tree) -> int:
  return sum(math.prod(x.shape) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def check_batch_fits(runs: list[explore.LoadedRun], batch_size: int,
                     seed: int) -> None:
  """Raise `device_memory.DoesNotFit` when the runs' CI over `batch_size`
  shared inputs needs more memory than is free: on the device, each
  run's CI program beside the inputs; on the host, both runs' CI kept in
  float64 for the cosines."""
  inputs = jax.eval_shape(
    lambda: matching.shared_inputs(runs[0], batch_size, seed))
  what = f"the CI of --batch_size={batch_size} inputs"
  fix = "lower --batch_size"
  host = 0
  for run in runs:
    d = run.decomposition
    program = run.jitted.lower_ci.lower(run.weights, d.components,
                                        d.ci_params, inputs).compile()
    device_memory.check_fits(program, what, fix, held=_bytes(inputs))
    host += 2 * _bytes(program.out_info)
  free = device_memory.host_free_bytes()
  if free is not None and host > free:
    raise device_memory.DoesNotFit(
      f"{what} takes {host / device_memory.GIB:.1f} GiB of host memory in "
      f"float64, and the host has {free / device_memory.GIB:.1f} GiB free; "
      f"{fix}")


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; use --run_a=DIR --run_b=DIR")
  if not 0.0 < _TAU.value <= 1.0:
    fail(f"--tau={_TAU.value} is no CI cosine to group at; give one in"
         " (0, 1]")
  if not -1.0 <= _THRESHOLD.value <= 1.0:
    fail(f"--threshold={_THRESHOLD.value} is no similarity; give one in "
         "[-1, 1]")
  run_a = _load("run_a", _RUN_A.value)
  run_b = _load("run_b", _RUN_B.value)
  try:
    matching.check_comparable(run_a, run_b)
    check_batch_fits([run_a, run_b], _BATCH_SIZE.value, _SEED.value)
    inputs = matching.shared_inputs(run_a, _BATCH_SIZE.value, _SEED.value)
    arrays_a = matching.site_arrays(run_a, inputs)
    arrays_b = matching.site_arrays(run_b, inputs)
    matches = matching.match_arrays(arrays_a, arrays_b, _THRESHOLD.value)
    shared = identifiability.identifiability(arrays_a, arrays_b, _TAU.value)
  except (OSError, ValueError) as e:
    fail(str(e))
  print(f"A: {_RUN_A.value}\nB: {_RUN_B.value}\n"
        f"threshold {_THRESHOLD.value:g} on min(weight cos, CI cos) over "
        f"{_BATCH_SIZE.value} inputs (seed {_SEED.value})\n")
  print(matching.markdown_table(matches), end="")
  print(f"\nWhat the runs share beyond one-to-one pairs (medians over A's"
        f" alive components; docs/brown.md, Identifiability):\n")
  print(identifiability.markdown_table(shared, _TAU.value), end="")
  if _PAIRS.value:
    print()
    print(matching.pair_lines(matches), end="")


def entry() -> None:
  """Launch the absl app (used by the `bin/match` launcher)."""
  cli.launch("match", main)


if __name__ == "__main__":
  entry()
