"""Convert a run's metrics to TensorBoard: `bin/tensorboard --run_dir=DIR`.

Writes `<run_dir>/tensorboard/` (needs the `decompax[tensorboard]` extra;
a `--restarts` run's chosen candidate's); view it with `tensorboard
--logdir <run_dir>/tensorboard`. Rerun it at any time, also while the run
trains, to refresh the conversion.
"""

from absl import flags, logging

from decompax.bin import cli
from decompax.io import run_dir
from decompax.io import tensorboard_events as tensorboard

_RUN_DIR = flags.DEFINE_string(
  "run_dir", None, "Run directory (the --output_dir of bin/train).",
  required=True)


def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  cli.fail("tensorboard", message)


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; use --run_dir=DIR")
  try:
    # A --restarts run's metrics are its chosen candidate's.
    path, count = tensorboard.write_events(
      run_dir.chosen_run(_RUN_DIR.value))
  except ValueError as e:
    fail(f"--run_dir: {e}")
  except ImportError as e:
    fail(str(e))
  print(f"[tensorboard] wrote {count} scalars to {path}")


def entry() -> None:
  """Launch the absl app (used by the `bin/tensorboard` launcher)."""
  cli.launch("tensorboard", main)


if __name__ == "__main__":
  entry()
