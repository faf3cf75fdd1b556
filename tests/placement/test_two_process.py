"""Real two-process `bin/train` runs on localhost (SPEC §8, §11, §12, I34).

Two processes with two simulated CPU devices each join through
`jax.distributed` (CPU collectives) on a free port and train on one
4-device mesh; process 0's metrics must match the one-process reference
trajectory, both processes write their shards of each checkpoint, and only
process 0 prints or writes run files. The run is stopped by a signal to
process 0 alone after step 4 (both save and exit); a shard of that newest
checkpoint which process 1 alone reads is then damaged, and the relaunch
(both skip it together and resume from step 2) spans a two-process resume.
One stopped launch and one relaunch serve every default test. The slow checks
stop and resume a tiny Llama run on a token file the same way, which must
end bitwise where an uninterrupted two-process launch ends, and add both
eval tiers across such a resume, comparing the whole log with one
uninterrupted process's.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
from typing import NamedTuple

import numpy as np
import pytest

from decompax.io import checkpoint, run_dir, tokens

pytestmark = pytest.mark.multidevice

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 400
TIMINGS = ("step_time_s", "eval/time_s")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _start(tmp_path, name: str, args, n_processes: int = 2, env0=None):
  """Launch `bin/train` in `n_processes` processes (extra environment
  `env0` for process 0 only); return them with their log paths."""
  if n_processes > 1:
    args = [*args, "--local_device_count=2", f"--num_processes={n_processes}",
            f"--coordinator_address=localhost:{_free_port()}"]
  started = []
  for i in range(n_processes):
    path = tmp_path / f"{name}{i}.log"
    with open(path, "w") as log:
      proc = subprocess.Popen(
        [sys.executable, "-P", str(ROOT / "bin" / "train"), *args,
         *([f"--process_id={i}"] if n_processes > 1 else [])],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "JAX_PLATFORMS": "cpu",
             **((env0 or {}) if i == 0 else {})})
    started.append((proc, path))
  return started


def _finish(started) -> tuple[list[int], list[str]]:
  """Return the exit codes and outputs of `_start`ed processes."""
  try:
    codes = [proc.wait(timeout=TIMEOUT_S) for proc, _ in started]
  finally:
    for proc, _ in started:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return codes, [path.read_text() for _, path in started]


def _records(out: pathlib.Path) -> list[dict]:
  records = [json.loads(line)
             for line in (out / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


def _cached_target(tmp_path, p) -> pathlib.Path:
  target_path = tmp_path / "target.npz"
  run_dir.save_arrays(str(target_path), p.toy.weights_to_arrays(p.weights),
                      {"target": p.config.target,
                       "target_seed": p.toy.default_seed})
  return target_path


class StoppedRun(NamedTuple):
  """A two-process run stopped after step 4, its newest checkpoint then
  damaged where process 1 alone reads it, and resumed to its end."""

  out: pathlib.Path
  stopped: tuple[list[int], list[str]]  # exit codes, outputs per process
  labels_when_stopped: list[int]
  # The shard files of a CI weight in the stop's checkpoint, undamaged.
  shards_when_stopped: list[str]
  damaged: pathlib.Path  # the stop's checkpoint
  resumed: tuple[list[int], list[str]]


def _chunks(step_dir: pathlib.Path) -> pathlib.Path:
  """Return the folder of a CI weight's chunks, one file per device: under
  zero1 on fsdp = 4 the weight [20, 16] splits 4 ways, chunks 2 and 3 on
  process 1's devices."""
  return (step_dir / checkpoint.DECOMPOSITION / "arrays" / "ci_params" /
          "linear1" / "w_in" / "c")


def _truncate_files(folder: pathlib.Path) -> None:
  for path in [p for p in folder.rglob("*") if p.is_file()]:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, helpers, tms_vpd) -> StoppedRun:
  """Five steps of `tms_vpd` under zero1 on two processes with two devices
  each, evals off, saved every 2 steps. A SIGTERM to process 0 alone after
  step 4 stops both; chunk 3 of a CI weight in label 4 (device 3's,
  process 1's) is then truncated, and the same command, relaunched,
  resumes and ends the run. The relaunch loads the first launch's
  compiled step from a shared cache."""
  p = tms_vpd
  root = tmp_path_factory.mktemp("two_process")
  out = root / "run"
  args = [
    f"--flagfile={helpers.FLAGS_DIR / 'tms_5-2_vpd.flags'}",
    f"--batch_size={p.config.batch_size}", "--num_steps=5", "--log_every=1",
    "--faithfulness_warmup_steps=0", "--eval_every=0", "--slow_eval_every=0",
    "--save_every=2", f"--target_path={_cached_target(root, p)}",
    f"--output_dir={out}", "--placement=zero1",
    f"--compilation_cache_dir={root / 'cache'}",
  ]
  stopped = _finish(_start(root, "stopped", args,
                           env0={"DECOMPAX_FAULT": "sigterm_after_step=4"}))
  ckpts = out / checkpoint.CHECKPOINT_DIR
  labels = checkpoint.committed_steps(ckpts)
  damaged = ckpts / checkpoint.step_name(4)
  shards = sorted(os.listdir(_chunks(damaged))) if damaged.is_dir() else []
  if shards:
    _truncate_files(_chunks(damaged) / "3")
  resumed = _finish(_start(root, "resumed", args))
  return StoppedRun(out, stopped, labels, shards, damaged, resumed)


def test_two_processes_match_the_one_process_trajectory(
    helpers, stopped_run, tms_reference):
  """I34 (and I36 across the resume): the run's five records equal the
  one-process reference trajectory."""
  codes, texts = stopped_run.resumed
  assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
  out = stopped_run.out
  records = _records(out)
  assert [r.pop("step") for r in records] == [1, 2, 3, 4, 5]
  helpers.assert_same_trajectory(tms_reference.metrics, records)
  # Checkpoints hold both processes' shards, a file per device, half of
  # them process 1's; the relaunch wrote label 4 afresh (keep_last = 3).
  ckpts = out / checkpoint.CHECKPOINT_DIR
  assert checkpoint.committed_steps(ckpts) == [2, 4, 5]
  assert stopped_run.shards_when_stopped == ["0", "1", "2", "3"]
  for label in (2, 4, 5):
    chunks = _chunks(ckpts / checkpoint.step_name(label))
    assert sorted(os.listdir(chunks)) == ["0", "1", "2", "3"]
  # Only process 0 wrote: one record per step, and its progress lines.
  assert "step 5/5" in texts[0] and "step 5/5" not in texts[1]
  assert "[checkpoint] saved step 5" in texts[0]
  assert "[checkpoint]" not in texts[1]


def test_a_signal_to_process_0_stops_both_and_both_resume(stopped_run):
  """Fast variant of the slow check below (SPEC §12): a stop signal to
  process 0 alone is agreed across processes, both save label 4 and exit
  75; relaunched, both restore a checkpoint (process 1 its own shards) and
  finish. Evals stay off here; the slow check adds both tiers across the
  resume and a one-process run beside it."""
  codes, texts = stopped_run.stopped
  assert codes == [75, 75], "\n".join(t[-3000:] for t in texts)
  assert stopped_run.labels_when_stopped == [0, 2, 4]
  assert "stop signal: step 4 saved" in texts[0]
  assert "step 5/5" not in texts[0]
  codes, resumed = stopped_run.resumed
  assert codes == [0, 0], "\n".join(t[-3000:] for t in resumed)
  assert "resumed from step 2" in resumed[0]
  assert "step 3/5" in resumed[0] and "step 2/5" not in resumed[0]
  for text in (texts[1], resumed[1]):
    assert "[checkpoint]" not in text and "step 1/5" not in text


def test_both_processes_skip_a_checkpoint_one_of_them_finds_damaged(
    stopped_run):
  """SPEC §12: a shard of the newest checkpoint (label 4) that process 1
  alone reads is damaged. Relaunched, process 0 reads its own shards of
  label 4 without fault, yet both skip it together and resume from label
  2 (alone, process 0 would restore label 4 and wait for process 1 in the
  next collective forever) and end on the same trajectory (the test
  above)."""
  codes, texts = stopped_run.resumed
  assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
  assert ("checkpoint 000000004 is damaged and is skipped: checkpoint "
          f"{stopped_run.damaged}: another process found its shards "
          "damaged") in texts[0]
  assert "resumed from step 2" in texts[0]
  assert "step 3/5" in texts[0] and "step 5/5" in texts[0]


def _token_llama_args(root: pathlib.Path, out: pathlib.Path) -> list[str]:
  """A 4-step tiny Llama run on a token file of random documents, saved
  every 2 steps (as `tests/bin/test_token_resume.py`'s one-process run)."""
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, 127, rng.integers(5, 60)) for _ in range(200)]
  data = root / "tokens.bin"
  if not data.exists():
    tokens.write_tokens(str(data), docs, 128, 127, "test")
  return [
    f"--flagfile={ROOT / 'flags' / 'tiny_llama.flags'}",
    f"--model_dir={ROOT / 'tests' / 'fixtures' / 'tiny_llama'}",
    "--batch_size=4", "--seq_len=8", "--c=8", "--ci_fn=vector_mlp",
    "--ci_hidden=8", f"--data_path={data}", "--num_steps=4", "--log_every=1",
    "--eval_every=0", "--slow_eval_every=0", "--save_every=2",
    "--faithfulness_warmup_steps=0", "--figures_every=0",
    f"--output_dir={out}", f"--compilation_cache_dir={root / 'cache'}"]


@pytest.mark.slow
def test_two_processes_resume_a_token_file_run_onto_the_right_batches(
    tmp_path, assert_bitwise_equal):
  """I36 on the LM path: each process reads its own rows of step s's batch
  from the token file on the host. A two-process run stopped after step 2
  and relaunched must read steps 3 and 4's batches, not the launch's first
  ones, and end bitwise where an uninterrupted two-process launch ends.

  Slow (six launches of `bin/train`, four of them side by side). Its fast
  variants in the default suite: the one-process resume onto the right
  batches (`tests/bin/test_token_resume.py`), the process slices of a
  step's batch concatenating to its global batch
  (`tests/io/test_tokens.py`) and the two-process stop and resume above."""
  straight, split = tmp_path / "straight", tmp_path / "split"
  # The uninterrupted launch and the first half of the split one run side
  # by side.
  straight_run = _start(tmp_path, "straight",
                        _token_llama_args(tmp_path, straight))
  stopped_run = _start(tmp_path, "stopped", [
    *_token_llama_args(tmp_path, split), "--stop_after_step=2"])
  for started in (straight_run, stopped_run):
    codes, texts = _finish(started)
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
  assert "stopped after step 2 of 4" in texts[0]  # the stopped launch's
  assert checkpoint.committed_steps(split / "checkpoints") == [0, 2]
  codes, texts = _finish(_start(tmp_path, "resumed",
                                _token_llama_args(tmp_path, split)))
  assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
  assert "resumed from step 2" in texts[0] and "step 3/4" in texts[0]
  want, got = _records(straight), _records(split)
  assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
  assert got == want
  ends = [run_dir.load_arrays(str(run / "decomposition.npz"))[0]
          for run in (straight, split)]
  assert_bitwise_equal(ends[1], ends[0])


@pytest.mark.slow
def test_two_processes_evaluate_save_and_resume_like_one(
    tmp_path, helpers, tms_vpd, tms_reference):
  """Both eval tiers, a signal-stopped save and a two-process resume log
  what one uninterrupted process logs (SPEC D4, I36); ~3-4 min on 2 cores."""
  p = tms_vpd
  target_path = _cached_target(tmp_path, p)
  args = [
    f"--flagfile={helpers.FLAGS_DIR / 'tms_5-2_vpd.flags'}",
    f"--batch_size={p.config.batch_size}", "--num_steps=5", "--log_every=1",
    "--faithfulness_warmup_steps=0", "--eval_every=2", "--slow_eval_every=2",
    "--eval_batches=1", "--save_every=5", f"--target_path={target_path}",
    "--placement=zero1",
  ]
  out = tmp_path / "run"
  # replicate x tp = 2 x 2: zero1 splits each V's C over both processes.
  # The relaunch reads its programs from the first launch's cache.
  two = [*args, f"--output_dir={out}", "--replicate=2", "--tp=2",
         f"--compilation_cache_dir={tmp_path / 'cache'}"]
  # One uninterrupted process runs alongside.
  single = _start(tmp_path, "single",
                  [*args, f"--output_dir={tmp_path / 'one'}"], n_processes=1)
  # Process 0 alone is signalled after step 2; both save it and stop.
  codes, stopped = _finish(_start(
    tmp_path, "stopped", two, env0={"DECOMPAX_FAULT": "sigterm_after_step=2"}))
  assert codes == [75, 75], "\n".join(t[-3000:] for t in stopped)
  ckpts = out / checkpoint.CHECKPOINT_DIR
  assert checkpoint.committed_steps(ckpts) == [0, 2]
  assert not [n for n in os.listdir(ckpts) if n.startswith(".")]
  step_dir = ckpts / checkpoint.step_name(2)
  assert checkpoint.read_index(step_dir)["items"] == [
    checkpoint.DECOMPOSITION, checkpoint.TRAINING]
  # V [1, 5, 20]: C over tp x replicate, one shard file per device, half
  # of them process 1's to write.
  v_dir = (step_dir / checkpoint.DECOMPOSITION / "arrays" / "components" /
           "linear1" / "v" / "c" / "0" / "0")
  assert sorted(os.listdir(v_dir)) == ["0", "1", "2", "3"]
  codes, resumed = _finish(_start(tmp_path, "resumed", two))
  assert codes == [0, 0], "\n".join(t[-3000:] for t in resumed)
  assert "resumed from step 2" in resumed[0]
  codes, alone = _finish(single)
  assert codes == [0], alone[0][-3000:]

  records, reference = _records(out), _records(tmp_path / "one")
  assert [r.pop("step") for r in records] == [0, 1, 2, 3, 4, 5]
  assert [r.pop("step") for r in reference] == [0, 1, 2, 3, 4, 5]
  assert any(k.startswith("eval/") for k in records[2])
  helpers.assert_same_trajectory(reference, records)  # D4, I36
  steps = [{k: v for k, v in r.items() if not k.startswith("eval/")}
           for r in records[1:]]
  helpers.assert_same_trajectory(tms_reference.metrics, steps)  # I34
  # Process 0 alone prints, renders and writes the report.
  for name in ("ci_histograms.png", "components.png"):
    assert (out / "figures" / name).exists()
  assert (out / "report" / "index.html").exists()
  assert "[report] wrote" in resumed[0] and "[eval] step 5" in resumed[0]
  for text in (stopped[1], resumed[1]):
    for mark in ("[eval]", "[report]", "[checkpoint]", "step 5/5", "[result]"):
      assert mark not in text
