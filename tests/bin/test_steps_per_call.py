"""bin/train's calls of many steps (`--steps_per_call`): a run taking up to
three steps per compiled call logs, saves and resumes bitwise as the run
taking one, its calls ending wherever the loop looks at the state.

The runs are tiny TMS 5-2 runs on an untrained target, in-process, over 11
steps with logs every 4 and saves every 5: calls of 3, 2 and 1 steps.
"""

import dataclasses
import pathlib

import pytest

from decompax.bin import checkpointing, train, train_flags
from decompax.io import checkpoint, run_dir

STEPS = 11
ARGS = (f"--num_steps={STEPS}", "--batch_size=16", "--c=6", "--ci_hidden=4",
        "--log_every=4", "--save_every=5", "--keep_all", "--eval_every=0",
        "--slow_eval_every=0", "--figures_every=0",
        "--faithfulness_warmup_steps=0", "--restarts=1", "--select_at=0")


def _config(tms_target, output_dir, *args):
  return train_flags.parse_config(*ARGS, f"--target_path={tms_target}",
                                  f"--output_dir={output_dir}", *args)


def _records(output_dir) -> list[dict]:
  """Return metrics.jsonl without its wall-clock times."""
  return [{k: v for k, v in r.items() if k != "step_time_s"}
          for r in run_dir.read_metrics(
            pathlib.Path(output_dir) / run_dir.METRICS_FILE)]


def _checkpoints(output_dir) -> dict:
  """Return every saved label's items, `{label: (decomposition, training)}`
  as arrays by path."""
  directory = checkpointing.checkpoint_dir(str(output_dir))
  return {step: tuple(checkpoint.read_item(
    checkpoint.step_path(directory, step), item)[0]
    for item in (checkpoint.DECOMPOSITION, checkpoint.TRAINING))
    for step in checkpoint.committed_steps(directory)}


@pytest.fixture(scope="module")
def one_per_call(tms_target, tmp_path_factory, launch_in_process):
  """The run of one step per call: its records and checkpoints."""
  out = tmp_path_factory.mktemp("one") / "run"
  launch_in_process(_config(tms_target, out, "--steps_per_call=1"))
  return _records(out), _checkpoints(out)


def test_calls_end_at_every_step_the_loop_looks_at():
  config = train_flags.parse_config(*ARGS, "--profile_steps=1:2")

  def ends(first, per_call, config=config):
    s, out = first, []
    while s < train.last_step(config):
      s += train.call_length(config, s, per_call)
      out.append(s)
    return out

  # Logs at 4 and 8, saves at 5 and 10, the profile window's edges 1 and 2,
  # the end at 11.
  assert ends(0, 3) == [1, 2, 4, 5, 8, 10, 11]
  assert ends(0, 1) == list(range(1, STEPS + 1))
  assert ends(5, 64) == [8, 10, 11]
  assert ends(0, 64, dataclasses.replace(
    config, profile_steps="", checkpointing="none")) == [4, 8, 11]
  assert ends(0, 64, dataclasses.replace(config, stop_after_step=5)) == [
    1, 2, 4, 5]


def test_three_steps_per_call_log_and_save_bitwise_as_one(
    one_per_call, tms_target, tmp_path, assert_bitwise_equal,
    launch_in_process):
  records, saved = one_per_call
  out = tmp_path / "run"
  launch_in_process(_config(tms_target, out, "--steps_per_call=3"))
  assert [r["step"] for r in records] == [4, 8, 11]
  assert _records(out) == records
  assert sorted(saved) == [0, 5, 10, 11]
  assert_bitwise_equal(_checkpoints(out), saved)


def test_a_run_stopped_mid_call_resumes_bitwise(
    one_per_call, tms_target, tmp_path, monkeypatch, assert_bitwise_equal,
    launch_in_process):
  """A signal during the call of steps 6 to 8 is serviced after step 8,
  which is saved; the rerun, at another --steps_per_call (a relaunch
  flag), ends where the run of one step per call ends."""
  records, saved = one_per_call
  out = tmp_path / "run"
  monkeypatch.setenv(checkpointing.FAULT_ENV, "sigterm_after_step=6")
  with pytest.raises(SystemExit) as stopped:
    launch_in_process(_config(tms_target, out, "--steps_per_call=3"))
  assert stopped.value.code == checkpointing.REQUEUE_EXIT_CODE
  assert checkpoint.committed_steps(
    checkpointing.checkpoint_dir(str(out))) == [0, 5, 8]
  monkeypatch.delenv(checkpointing.FAULT_ENV)
  launch_in_process(_config(tms_target, out, "--steps_per_call=2"))
  assert _records(out) == records
  resumed = _checkpoints(out)
  assert sorted(resumed) == [0, 5, 8, 10, 11]
  del resumed[8]
  assert_bitwise_equal(resumed, saved)
