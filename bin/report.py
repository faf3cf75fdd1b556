"""Rebuild a run's report: `bin/report --run_dir=runs/tms_5-2`.

Writes `<run_dir>/report/index.html` (and its curve PNGs) from the files of
a finished or a running run; open it in any browser.
"""

import sys

from absl import flags, logging

from decompax.analysis import tag_summary
from decompax.bin import cli, run_records
from decompax.io import run_dir
from decompax.render import run_report as report

_RUN_DIR = flags.DEFINE_string(
  "run_dir", None, "Run directory (the --output_dir of bin/train).",
  required=True)


def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  cli.fail("report", message)


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; use --run_dir=DIR")
  why = "pass a directory bin/train wrote (its --output_dir)"
  try:
    # A --restarts run reports on its chosen candidate.
    chosen = run_dir.chosen_run(_RUN_DIR.value)
  except ValueError as e:
    fail(f"--run_dir: {e}; {why}")
  try:
    unknown = run_records.check_flags_file(chosen)
  except (OSError, ValueError) as e:
    fail(f"--run_dir: {chosen}/{run_dir.FLAGS_FILE} is damaged: {e}; "
         "restore it from the run's launch command")
  if unknown:
    print(f"report: warning: {chosen}/{run_dir.FLAGS_FILE} sets "
          f"{', '.join('--' + n for n in unknown)}, which bin/train has no "
          "flag for (removed since, or a damaged line)", file=sys.stderr)
  # A harvest with tag statistics adds its comparison with the neurons.
  try:
    with cli.thread_map() as map_fn:
      written = tag_summary.rebuild_report(chosen, map_fn=map_fn)
  except report.NotARun as e:
    fail(f"--run_dir: {e}; {why}")
  except ValueError as e:
    fail(f"--run_dir: {e}")
  if written.comparison:
    print("[report] compared components with neurons by part of speech")
  path = written.page
  print(f"[report] wrote {path}")


def entry() -> None:
  """Launch the absl app (used by the `bin/report` launcher)."""
  cli.launch("report", main)


if __name__ == "__main__":
  entry()
