"""SIGKILL a real `bin/train` again and again, then resume it to the end.

Kills land mid-save (one item written), right after a save is committed
(before the prune), mid-prune (an old step hidden, not yet deleted) and at
random moments of the loop. Each relaunch is the same command. The final
checkpoint must be bitwise the uninterrupted run's, and `metrics.jsonl`
must hold each logged step once, with the same losses. The slow soak kills
a 400-step run 10 times, in step order; the fast variant kills a short run
at the two points the resume tests do not reach.
"""

import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from decompax.io import checkpoint, run_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMMON = ("--batch_size=16", "--log_every=2", "--keep_last=2",
          "--eval_every=0", "--slow_eval_every=0", "--figures_every=0",
          "--faithfulness_warmup_steps=3")


def _launch(args, fault: str = "") -> subprocess.Popen:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "DECOMPAX_FAULT": fault}
  return subprocess.Popen(
    [sys.executable, "-P", str(ROOT / "bin" / "train"), *args], cwd=ROOT,
    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _kill_past(process: subprocess.Popen, step: int, delay: float,
               output_lines) -> str:
  """SIGKILL `process` `delay` seconds after it logs a step >= `step`."""
  seen = []
  for line in output_lines(process):
    seen.append(line)
    words = line.split()
    if words[:1] == ["step"] and int(words[1].split("/")[0]) >= step:
      time.sleep(delay)
      process.send_signal(signal.SIGKILL)
      break
  process.wait(timeout=300)
  return "".join(seen)


def _run(args, kill, output_lines) -> int:
  """Run one attempt; `kill` is a DECOMPAX_FAULT or `(step, delay)`: a
  SIGKILL `delay` seconds after the run logs step `step`."""
  if isinstance(kill, str):
    process = _launch(args, kill)
    output = process.communicate(timeout=600)[0]
  else:
    process = _launch(args)
    output = _kill_past(process, *kill, output_lines)
  assert "Traceback" not in output, output
  return process.returncode


def _final_arrays(out: pathlib.Path, steps: int) -> dict:
  path = checkpoint.step_path(out / checkpoint.CHECKPOINT_DIR, steps)
  return {item: checkpoint.read_item(path, item)[0]
          for item in (checkpoint.DECOMPOSITION, checkpoint.TRAINING)}


def _losses(out: pathlib.Path) -> list[tuple]:
  return [(r["step"], tuple(sorted((k, v) for k, v in r.items()
                                   if k.startswith("loss/"))))
          for r in run_dir.read_metrics(out / run_dir.METRICS_FILE)]


def _soak(tmp_path, output_lines, target, steps: int, save_every: int,
          kills: list) -> None:
  """Run uninterrupted, then killed at each of `kills` and resumed, on
  the cached `target` (an untrained TMS 5-2: the runs are compared with
  each other, whatever the weights)."""
  shared = (*COMMON, f"--num_steps={steps}", f"--save_every={save_every}",
            f"--target_path={target}")
  straight = tmp_path / "straight"
  assert _run((*shared, f"--output_dir={straight}"), "", output_lines) == 0
  soaked = tmp_path / "soaked"
  args = (*shared, f"--output_dir={soaked}")
  for kill in kills:
    assert _run(args, kill, output_lines) == -signal.SIGKILL, kill
  assert _run(args, "", output_lines) == 0
  want, got = _final_arrays(straight, steps), _final_arrays(soaked, steps)
  for item in want:
    assert sorted(want[item]) == sorted(got[item])
    for key, array in want[item].items():
      assert array.tobytes() == np.asarray(got[item][key]).tobytes(), key
  soaked_losses = _losses(soaked)
  logged = [step for step, _ in soaked_losses]
  assert len(logged) == len(set(logged)), logged
  assert soaked_losses == _losses(straight)


def test_kills_after_a_save_and_mid_prune_resume_bitwise(tmp_path,
                                                        output_lines,
                                                        tms_target):
  _soak(tmp_path, output_lines, tms_target, steps=12, save_every=4,
        kills=["kill_after_save=8", "kill_mid_prune=12"])


@pytest.mark.slow
def test_ten_kills_of_a_400_step_run_resume_bitwise(tmp_path, output_lines,
                                                   tms_target):
  rng = random.Random(0)
  labels = range(80, 400, 40)  # saves that also prune (keep_last=2)
  faults = ["kill_mid_save", "kill_after_save", "kill_mid_prune"] * 2
  rng.shuffle(faults)
  at = [(label, f"{fault}={label}") for fault, label in zip(
    faults, sorted(rng.sample(labels, len(faults))))]
  # Four kills at random moments: past a random step, after up to 20 ms;
  # away from the saves, so that they cannot reach a save-time kill's label.
  between = [s for s in range(2, 400, 2) if 6 <= s % 40 <= 34]
  at += [(step, (step, rng.uniform(0.0, 0.02)))
         for step in rng.sample(between, 4)]
  # In step order, so that every kill is reached by the attempt before it.
  _soak(tmp_path, output_lines, tms_target, steps=400, save_every=40,
        kills=[kill for _, kill in sorted(at, key=lambda a: a[0])])
