"""A diverging `bin/train` stops, saves nothing from the bad step and keeps
its good checkpoints; `--on_nonfinite=skip` drops the bad updates instead."""

import os
import pathlib
import subprocess
import sys

import pytest

from decompax.io import checkpoint, run_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]
DIVERGED = 3
SMALL = ("--num_steps=20", "--save_every=5", "--log_every=5",
         "--batch_size=64", "--eval_every=0", "--slow_eval_every=0",
         "--figures_every=0", "--faithfulness_warmup_steps=10")


def _train(*args: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "train"), *SMALL, *args],
    cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def target_path(tmp_path_factory) -> str:
  return str(tmp_path_factory.mktemp("target") / "target.npz")


def _error_line(result) -> str:
  assert "Traceback" not in result.stderr, result.stderr
  lines = [l for l in result.stderr.splitlines() if l.startswith("train:")]
  assert len(lines) == 1, result.stderr
  return lines[0]


def test_divergence_stops_and_keeps_the_good_checkpoint(tmp_path,
                                                        target_path):
  out = tmp_path / "run"
  args = ("--lr=1e6", f"--output_dir={out}", f"--target_path={target_path}")
  result = _train(*args)
  assert result.returncode == DIVERGED, result.stderr
  line = _error_line(result)
  # Found at the step-5 log, named by the first bad step.
  assert "diverged at step 2 (first non-finite value: loss/" in line
  assert f"newest good checkpoint: {out / 'checkpoints' / '000000000'}" in line
  ckpts = out / checkpoint.CHECKPOINT_DIR
  assert checkpoint.committed_steps(ckpts) == [0]
  assert not (out / "decomposition.npz").exists()
  assert [r["step"] for r in run_dir.read_metrics(
    out / run_dir.METRICS_FILE)] == []  # nothing logged from the bad window
  # The same command resumes from the good checkpoint, and stops again.
  again = _train(*args)
  assert again.returncode == DIVERGED
  assert "resumed from step 0" in again.stdout
  assert checkpoint.committed_steps(ckpts) == [0]


def test_skip_drops_bad_updates_until_too_many_come_in_a_row(
    tmp_path, target_path):
  out = tmp_path / "run"
  # No share limit: the streak is what stops this run.
  result = _train("--lr=1e6", "--on_nonfinite=skip",
                  "--max_skipped_in_a_row=8", "--max_skipped_share=1",
                  f"--output_dir={out}",
                  f"--target_path={target_path}")
  assert result.returncode == DIVERGED, result.stderr
  assert "non-finite update(s)" in result.stdout
  line = _error_line(result)
  assert "updates in a row were not finite" in line
  assert "raise --max_skipped_in_a_row" in line
  records = run_dir.read_metrics(out / run_dir.METRICS_FILE)
  assert records and all(r["nonfinite/steps"] > 0 for r in records)
