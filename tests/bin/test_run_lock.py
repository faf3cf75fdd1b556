"""bin/train holds its run directory: a second trainer there is refused."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest

from decompax.bin import train
from decompax.io import run_dir
from decompax.targets import registry

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A run that outlasts the test, without evals or checkpoints to wait for.
LONG_RUN = ("--num_steps=1000000", "--batch_size=8", "--c=4", "--ci_hidden=4",
            "--log_every=1000", "--eval_every=0", "--slow_eval_every=0",
            "--checkpointing=none")


def _bin_train(*args, **kwargs):
  return subprocess.Popen(
    [sys.executable, "-P", str(ROOT / "bin" / "train"), *args], cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu"}, text=True, **kwargs)


def _untrained_target(path: pathlib.Path) -> str:
  # Loaded from this cache, the toy is not trained before the lock is taken.
  toy = registry.get("tms_5-2")
  run_dir.save_arrays(path, toy.weights_to_arrays(toy.init(jax.random.key(0))),
                      {"target": toy.name, "target_seed": toy.default_seed})
  return f"--target_path={path}"


def _wait_for_run(out: pathlib.Path, holder: str, process) -> None:
  """Wait until `holder` has locked `out` and written its flags."""
  lock, flags_path = out / run_dir.LOCK_FILE, out / run_dir.FLAGS_FILE
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline and process.poll() is None:
    # flags.txt follows the lock file.
    if flags_path.exists() and lock.read_text() == holder + "\n":
      return
    time.sleep(0.05)
  raise AssertionError(f"{holder} never started a run in {out}")


def test_a_second_trainer_is_refused_while_the_first_runs(parse, tmp_path):
  out = tmp_path / "run"
  args = (*LONG_RUN, _untrained_target(tmp_path / "target.npz"),
          f"--output_dir={out}")
  with open(tmp_path / "first.log", "w") as log:
    first = _bin_train(*args, stdout=log, stderr=subprocess.STDOUT)
  started = [first]
  try:
    holder = f"pid {first.pid} on {socket.gethostname()}"
    _wait_for_run(out, holder, first)
    # Stopped, it keeps its lock and leaves the CPUs to the second trainer.
    first.send_signal(signal.SIGSTOP)
    flags_text = (out / run_dir.FLAGS_FILE).read_text()
    refusal = (f"--output_dir: output dir {out} is in use by {holder}; wait "
               "for that run to end or choose another directory")
    # --overwrite must not take a live run's directory either.
    second = _bin_train(*args, "--overwrite", stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE)
    started.append(second)
    with pytest.raises(ValueError) as info:
      train.setup(parse(*args))  # the same command: a resume
    assert str(info.value) == refusal
    _, err = second.communicate(timeout=120)
    assert second.returncode == 2, err
    assert err.splitlines() == [f"train: error: {refusal}"]
    assert first.poll() is None
    assert (out / run_dir.FLAGS_FILE).read_text() == flags_text
  finally:
    for process in started:
      process.kill()
      process.wait()
  # The kernel dropped the killed run's lock; its file is left behind.
  os.close(run_dir.lock_run_dir(out))
