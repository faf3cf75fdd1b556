"""--stop_after_step trains part of a schedule, saves and exits 0; the rerun
without it continues to the same numbers as one uninterrupted launch.

The launches run `bin/train`'s setup and loop in this process (what `main`
calls once the flags are parsed; its exit status and one-line errors are
tests/bin/test_bad_inputs.py's), on an untrained TMS 5-2 (the runs are
compared with each other, whatever the weights): a child process would
pay the start-up of JAX and a toy's training for each launch.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from decompax.io import checkpoint, run_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARGS = ("--target=tms_5-2", "--c=6", "--batch_size=16", "--num_steps=8",
        "--log_every=2", "--eval_every=4", "--slow_eval_every=0",
        "--save_every=4", "--keep_all", "--eval_batches=1")


def _in_process(launch, parse, capsys, target, output_dir, *extra) -> str:
  """Run `ARGS` into `output_dir` as one launch in this process, on the
  cached `target`; return what it printed."""
  capsys.readouterr()
  launch(parse(*ARGS, f"--output_dir={output_dir}",
               f"--target_path={target}", *extra))
  return capsys.readouterr().out


def _train(output_dir, *extra):
  """Launch `ARGS` into `output_dir` as a child process; the trained target
  is cached beside it in the test's directory, so only the test's first
  launch trains it."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  target = output_dir.parent / "target.npz"
  done = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "train"), *ARGS,
     f"--output_dir={output_dir}", f"--target_path={target}", *extra],
    cwd=ROOT, capture_output=True, text=True, env=env)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  return done.stdout


def _losses(output_dir):
  records = [json.loads(line) for line in
             open(os.path.join(output_dir, "metrics.jsonl"))]
  return {r["step"]: {k: v for k, v in r.items() if k.startswith(
    ("loss/", "eval/loss/"))} for r in records}


def test_stop_then_continue_matches_one_launch(parse, capsys, tms_target,
                                               tmp_path, launch_in_process):
  split, straight = tmp_path / "split", tmp_path / "straight"
  launch = lambda out, *extra: _in_process(launch_in_process, parse, capsys,
                                           tms_target, out, *extra)
  out = launch(split, "--stop_after_step=4")
  assert "stopped after step 4 of 8" in out
  assert not (split / "decomposition.npz").exists()
  assert checkpoint.committed_steps(str(split / "checkpoints"))[-1] == 4
  assert max(_losses(split)) == 4 and "eval/loss/total" in _losses(split)[4]
  assert "resumed from step 4" in launch(split)
  launch(straight)
  assert (split / "decomposition.npz").exists()
  assert _losses(split) == _losses(straight)


@pytest.mark.slow
def test_a_cpu_run_continues_on_more_devices_where_it_left_off(tmp_path):
  # The device count is a launch flag, not a run flag: a run stopped on one
  # CPU device continues data-parallel over two (both cores busy) and ends
  # where the one-device launch ends. The checkpoint reads into the new
  # shardings; the masks do not depend on the mesh (design §8).
  moved, straight = tmp_path / "moved", tmp_path / "straight"
  _train(moved, "--stop_after_step=4")
  assert "resumed from step 4" in _train(moved, "--local_device_count=2")
  _train(straight)
  ends = [run_dir.load_arrays(run / "decomposition.npz")[0]
          for run in (moved, straight)]
  assert ends[0].keys() == ends[1].keys()
  for key in ends[1]:
    np.testing.assert_allclose(ends[0][key], ends[1][key], rtol=1e-4,
                               atol=1e-6, err_msg=key)


@pytest.mark.parametrize("args, message", [
  (("--stop_after_step=8",), "must lie in"),
  (("--stop_after_step=3",), "multiple of --save_every"),
  (("--stop_after_step=4", "--checkpointing=none"), "multiple of --save_every"),
  (("--stop_after_step=4", "--save_every=2", "--eval_every=8",
    "--log_every=2"), "multiple of --eval_every"),
])
def test_a_stop_that_would_not_be_saved_or_evaluated_is_refused(
    parse, args, message):
  with pytest.raises(ValueError, match=message):
    parse(*ARGS, *args)
