"""--stop_after_step trains part of a schedule, saves and exits 0; the rerun
without it continues to the same numbers as one uninterrupted launch."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from decompax.io import checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARGS = ("--target=tms_5-2", "--c=6", "--batch_size=16", "--num_steps=8",
        "--log_every=2", "--eval_every=4", "--slow_eval_every=0",
        "--save_every=4", "--keep_all", "--eval_batches=1")


def _train(output_dir, *extra):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "train"), *ARGS,
     f"--output_dir={output_dir}", f"--target_path={output_dir}.target.npz",
     *extra], cwd=ROOT, capture_output=True, text=True, env=env)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  return done.stdout


def _losses(output_dir):
  records = [json.loads(line) for line in
             open(os.path.join(output_dir, "metrics.jsonl"))]
  return {r["step"]: {k: v for k, v in r.items() if k.startswith(
    ("loss/", "eval/loss/"))} for r in records}


def test_stop_then_continue_matches_one_launch(tmp_path):
  split, straight = tmp_path / "split", tmp_path / "straight"
  out = _train(split, "--stop_after_step=4")
  assert "stopped after step 4 of 8" in out
  assert not (split / "decomposition.npz").exists()
  assert checkpoint.committed_steps(str(split / "checkpoints"))[-1] == 4
  assert max(_losses(split)) == 4 and "eval/loss/total" in _losses(split)[4]
  _train(split)
  _train(straight)
  assert (split / "decomposition.npz").exists()
  assert _losses(split) == _losses(straight)


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
