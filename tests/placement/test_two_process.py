"""A real two-process `bin/train` run on localhost (SPEC §8, I34).

Two processes with two simulated CPU devices each join through
`jax.distributed` (CPU collectives) on a free port and train on one
4-device mesh; process 0's metrics must match the one-process reference
trajectory, and process 1 must write nothing.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from decompax.io import run_dir

pytestmark = pytest.mark.multidevice

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 400


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(args, process_id, log):
  return subprocess.Popen(
    [sys.executable, "-P", str(ROOT / "bin" / "train"), *args,
     f"--process_id={process_id}"],
    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_two_processes_match_the_one_process_trajectory(
    tmp_path, helpers, tms_vpd, tms_reference):
  p = tms_vpd
  target_path = tmp_path / "target.npz"
  run_dir.save_arrays(str(target_path), p.toy.weights_to_arrays(p.weights),
                      {"target": p.config.target,
                       "target_seed": p.toy.default_seed})
  out = tmp_path / "run"
  args = [
    f"--flagfile={helpers.FLAGS_DIR / 'tms_5-2_vpd.flags'}",
    f"--batch_size={p.config.batch_size}", "--num_steps=5", "--log_every=1",
    "--faithfulness_warmup_steps=0", "--eval_every=0", "--slow_eval_every=0",
    "--checkpointing=none", f"--target_path={target_path}",
    f"--output_dir={out}", "--placement=zero1", "--local_device_count=2",
    f"--coordinator_address=localhost:{_free_port()}", "--num_processes=2",
  ]
  logs = [open(tmp_path / f"process{i}.log", "w") for i in range(2)]
  procs = [_launch(args, i, logs[i]) for i in range(2)]
  try:
    codes = [proc.wait(timeout=TIMEOUT_S) for proc in procs]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
    for log in logs:
      log.close()
  texts = [(tmp_path / f"process{i}.log").read_text() for i in range(2)]
  assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
  records = [json.loads(line)
             for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r.pop("step") for r in records] == [1, 2, 3, 4, 5]
  for record in records:
    record.pop("step_time_s")
  helpers.assert_same_trajectory(tms_reference.metrics, records)
  # Only process 0 wrote: one record per step, and its progress lines.
  assert "step 5/5" in texts[0] and "step 5/5" not in texts[1]
