"""Pair two runs' components site by site: `bin/match --run_a=A --run_b=B`.

Prints a markdown table, one row per site: each run's alive components,
the pairs the assignment makes, how many reach `--threshold`, their mean
similarity and cosines, and the site's stability (the rule is
`analysis/matching.py`'s). A second table says what the runs share where
components do not pair one to one: the alive sets' spans, the weights of
components that fire on the same inputs, and co-firing groups
(`analysis/identifiability.py`). `--pairs` also prints every pair.
"""

from absl import flags, logging

from decompax.analysis import explore
from decompax.analysis import identifiability
from decompax.analysis import matching
from decompax.bin import cli

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
  "model).", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", matching.SEED,
                             "Seed of the shared inputs.")
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
