"""A diverging `bin/train` stops, saves nothing from the bad step and keeps
its good checkpoints; `--on_nonfinite=skip` drops the bad updates instead.

The launches run `bin/train`'s setup and loop in this process (what `main`
calls once the flags are parsed) on the suite's trained TMS 5-2 target: a
child process would pay JAX's start-up for each. That `main` turns the
`Diverged` they raise into one line and exit 3 is tests/bin/
test_bad_inputs.py's (rows `diverged` and `skipped_too_many`).
"""

import os
import shutil

import pytest

from decompax.bin import checkpointing
from decompax.io import checkpoint, run_dir

SMALL = ("--num_steps=20", "--save_every=5", "--log_every=5",
         "--batch_size=64", "--eval_every=0", "--slow_eval_every=0",
         "--figures_every=0", "--faithfulness_warmup_steps=10")
# The settings of tests/bin/test_bad_inputs.py's `diverged` row, launched
# on its one-device placement: the same programs, which whichever of the
# two runs second reads from the compilation cache.
DIVERGE = ("--num_steps=10", "--save_every=5", "--log_every=5",
           "--batch_size=32", "--eval_every=0", "--slow_eval_every=0",
           "--figures_every=0", "--faithfulness_warmup_steps=5")


@pytest.fixture(scope="module")
def target_path(tmp_path_factory, finished_run) -> str:
  """The trained TMS 5-2 (the suite's finished run's cache): lr=1e6 makes
  its first update non-finite, which an untrained toy need not."""
  path = tmp_path_factory.mktemp("target") / "target.npz"
  shutil.copy(os.path.join(finished_run("tms"), "target.npz"), path)
  return str(path)


def _diverged_launch(launch, parse, capsys, *args: str,
                     placement=None) -> tuple[str, str]:
  """Run one launch of `args` in this process, expecting it to diverge;
  return its one-line error and what it printed."""
  capsys.readouterr()
  config = parse(*args)
  with pytest.raises(checkpointing.Diverged) as info:
    launch(config, placement)
  message = str(info.value)
  assert "\n" not in message
  return message, capsys.readouterr().out


def test_divergence_stops_and_keeps_the_good_checkpoint(
    parse, capsys, tmp_path, target_path, one_device_placement,
    launch_in_process):
  out = tmp_path / "run"
  args = (*DIVERGE, "--lr=1e6", f"--output_dir={out}",
          f"--target_path={target_path}")
  launch = lambda: _diverged_launch(launch_in_process, parse, capsys, *args,
                                    placement=one_device_placement)
  line, _ = launch()
  # Found at the step-5 log, named by the first bad step.
  assert "diverged at step 2 (first non-finite value: loss/" in line
  assert f"newest good checkpoint: {out / 'checkpoints' / '000000000'}" in line
  ckpts = out / checkpoint.CHECKPOINT_DIR
  assert checkpoint.committed_steps(ckpts) == [0]
  assert not (out / "decomposition.npz").exists()
  assert [r["step"] for r in run_dir.read_metrics(
    out / run_dir.METRICS_FILE)] == []  # nothing logged from the bad window
  # The same command resumes from the good checkpoint, and stops again.
  line, printed = launch()
  assert "resumed from step 0" in printed
  assert "diverged at step 2 (first non-finite value: loss/" in line
  assert checkpoint.committed_steps(ckpts) == [0]


def test_skip_drops_bad_updates_until_too_many_come_in_a_row(
    parse, capsys, tmp_path, target_path, launch_in_process):
  out = tmp_path / "run"
  # No share limit: the streak is what stops this run.
  line, printed = _diverged_launch(
    launch_in_process, parse, capsys, *SMALL, "--lr=1e6", "--on_nonfinite=skip",
    "--max_skipped_in_a_row=8", "--max_skipped_share=1",
    f"--output_dir={out}", f"--target_path={target_path}")
  assert "non-finite update(s)" in printed
  assert "updates in a row were not finite" in line
  assert "raise --max_skipped_in_a_row" in line
  records = run_dir.read_metrics(out / run_dir.METRICS_FILE)
  assert records and all(r["nonfinite/steps"] > 0 for r in records)
