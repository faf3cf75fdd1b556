"""A run that reads token files resumes onto the batches it would have read
(SPEC §12, I36).

Toy and task runs sample their data inside the step from `state.step`, so
a loop that handed the step the wrong step's inputs would resume them
unharmed. A language-model run reads step `s`'s batch from its token file
on the host (`io/tokens`: a pure function of seed and step), and the loop
must ask for the batch of the absolute step, not of the step counted from
the launch. A tiny Llama run stopped after step 2 (`--stop_after_step`)
and continued must end bitwise where one uninterrupted launch ends. The
two-process variant is a slow check in
`tests/placement/test_two_process.py`.
"""

import json
import os
import pathlib

import numpy as np
import pytest

from decompax.bin import train
from decompax.io import checkpoint, owned_dir, run_dir, tokens

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS, STOP = 4, 2
TIMINGS = ("step_time_s", "eval/time_s")


def write_token_file(path: pathlib.Path) -> pathlib.Path:
  """Write 200 random documents over the tiny Llama's 128-token vocabulary:
  distinct windows every step, so a batch read for the wrong step shows."""
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, 127, rng.integers(5, 60)) for _ in range(200)]
  tokens.write_tokens(str(path), docs, 128, 127, "test")
  return path


def tiny_llama_args(data_path, out) -> tuple[str, ...]:
  """`bin/train`'s flags for a 4-step tiny Llama run on a token file, saved
  every 2 steps, logged every step, no evals or warmup."""
  return (
    f"--flagfile={ROOT / 'flags' / 'tiny_llama.flags'}",
    f"--model_dir={ROOT / 'tests' / 'fixtures' / 'tiny_llama'}",
    "--batch_size=4", "--seq_len=8", "--c=8", "--ci_fn=vector_mlp",
    "--ci_hidden=8", f"--data_path={data_path}", f"--num_steps={STEPS}",
    "--log_every=1", "--eval_every=0", "--slow_eval_every=0",
    f"--save_every={STOP}", "--faithfulness_warmup_steps=0",
    "--figures_every=0", f"--output_dir={out}")


def records(out) -> dict[int, dict]:
  """Return each logged step's record bar its timings."""
  return {r["step"]: {k: v for k, v in r.items() if k not in TIMINGS}
          for r in run_dir.read_metrics(os.path.join(out, "metrics.jsonl"))}


def _launch(parse, *args) -> None:
  """Run `bin/train`'s setup and loop in this process, as one launch."""
  prepared = train.setup(parse(*args))
  try:
    train.train(prepared)
  finally:  # the run directory's lock, as the launch's exit would
    os.close(prepared.lock)


@pytest.fixture
def token_file(tmp_path):
  return write_token_file(tmp_path / "tokens.bin")


def test_a_token_file_run_resumes_bitwise_onto_the_right_batches(
    parse, tmp_path, token_file, assert_bitwise_equal):
  straight, split = tmp_path / "straight", tmp_path / "split"
  _launch(parse, *tiny_llama_args(token_file, straight))
  _launch(parse, *tiny_llama_args(token_file, split),
          f"--stop_after_step={STOP}")
  assert checkpoint.committed_steps(split / "checkpoints") == [0, STOP]
  assert max(records(split)) == STOP
  _launch(parse, *tiny_llama_args(token_file, split))
  want, got = records(straight), records(split)
  assert sorted(got) == sorted(want) == [1, 2, 3, 4]
  for step in range(STOP + 1, STEPS + 1):  # the resumed launch's steps
    assert got[step] == want[step], step
  ends = [run_dir.load_arrays(str(run / "decomposition.npz"))[0]
          for run in (straight, split)]
  assert_bitwise_equal(ends[1], ends[0])


def _set_up(parse, *args) -> None:
  """Run `bin/train`'s setup in this process (its checks, then the run
  directory's records), its lock released after."""
  os.close(train.setup(parse(*args)).lock)


def test_a_run_on_rewritten_data_is_refused_until_overwritten(
    parse, tmp_path, token_file):
  """The run records its token file's and model's bytes (`inputs.json`);
  the same command on a token file since rewritten is one line naming the
  change and the fixes, the run directory as it was."""
  out = tmp_path / "run"
  args = tiny_llama_args(token_file, out)
  _set_up(parse, *args)
  recorded = json.loads((out / run_dir.INPUTS_FILE).read_text())
  assert recorded["data_path"] == owned_dir.file_identity(token_file)
  assert sorted(recorded["model_dir"]) == ["config.json", "model.safetensors"]
  _set_up(parse, *args)  # the same bytes: a resume
  before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
  tokens.write_tokens(str(token_file), [np.arange(50) % 127], 128, 127,
                      "test")
  with pytest.raises(ValueError) as refused:
    _set_up(parse, *args)
  message = str(refused.value)
  assert "\n" not in message
  assert message.startswith(f"--output_dir: {out} holds a run of other "
                            "input data (data_path.sha256 was ")
  assert message.endswith("resume it on the original data, choose a new "
                          "--output_dir, or pass --overwrite to train it "
                          "again")
  assert {p.name: p.read_bytes() for p in out.iterdir()
          if p.is_file()} == before
  _set_up(parse, *args, "--overwrite")
  recorded = json.loads((out / run_dir.INPUTS_FILE).read_text())
  assert recorded["data_path"] == owned_dir.file_identity(token_file)
