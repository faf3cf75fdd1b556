"""Rebuild a run's report: `bin/report --run_dir=runs/tms_5-2`.

Writes `<run_dir>/report/index.html` (and its curve PNGs) from the files of
a finished or a running run; open it in any browser.
"""

import sys

from absl import app, flags, logging

from decompax.io import report

_RUN_DIR = flags.DEFINE_string(
  "run_dir", None, "Run directory (the --output_dir of bin/train).",
  required=True)


def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  print(f"report: error: {message}", file=sys.stderr)
  sys.exit(2)


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; use --run_dir=DIR")
  try:
    path = report.write_report(_RUN_DIR.value)
  except ValueError as e:
    fail(str(e))
  print(f"[report] wrote {path}")


def parse_flags(argv: list[str]) -> list[str]:
  """Parse flags, turning absl's parse errors into one-line errors."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(f"{e}; see --helpfull")


def entry() -> None:
  """Launch the absl app (used by the `bin/report` launcher)."""
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  entry()
