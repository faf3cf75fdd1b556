"""`bin/train --restarts`: candidates to --select_at, the lowest held-out
loss continues, and a rerun resumes the selection."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from decompax.bin import checkpointing, placement_setup, restarts, train
from decompax.io import load_decomposition, run_dir
from decompax.analysis import explore

ROOT = pathlib.Path(__file__).resolve().parents[2]

TINY = ("--target=tms_5-2", "--batch_size=16", "--c=6", "--ci_hidden=4",
        "--num_steps=4", "--eval_every=2", "--save_every=2", "--log_every=1",
        "--slow_eval_every=0", "--eval_batches=1", "--figures_every=0",
        "--eval_pgd_steps=1", "--noslow_on_first_step")


def _launch(parse, tms_target, out, *args):
  """Run bin/train's restarts path in-process; return the config."""
  config = parse(*TINY, f"--target_path={tms_target}",
                 f"--output_dir={out}", "--restarts=3", "--select_at=2",
                 *args)
  placement = placement_setup.make_placement(
    placement_setup.config_from_flags(), (config.batch_size,))
  output_dir, lock = train.prepare_selection(config)
  try:
    train.train_with_restarts(config, placement, output_dir)
  finally:
    os.close(lock)  # as the launch's process would on exit
  return config


def _steps(directory) -> list[int]:
  return sorted({r["step"] for r in run_dir.read_metrics(
    os.path.join(directory, run_dir.METRICS_FILE)) if "step" in r})


def test_the_lowest_held_out_loss_continues_and_a_rerun_resumes(
    parse, tms_target, tmp_path, monkeypatch, capsys):
  out = tmp_path / "run"
  config = parse(*TINY, f"--target_path={tms_target}", f"--output_dir={out}",
                 "--restarts=3", "--select_at=2")
  placement = placement_setup.make_placement(
    placement_setup.config_from_flags(), (config.batch_size,))
  # The first launch stops right after choosing (as if killed there).
  output_dir, lock = train.prepare_selection(config)
  choice = train.select_candidate(config, placement, output_dir)
  os.close(lock)
  shown = capsys.readouterr().out
  assert f"candidate {choice['chosen']} continues" in shown
  # The driver goes on by itself: no candidate's stop asks for a rerun,
  # and each one's ETA counts to where it stops.
  assert "rerun without it" not in shown
  assert "ETA 0s to step 2" in shown
  losses = {int(j): loss for j, loss in choice["losses"].items()}
  assert len(losses) == 3
  # Each recorded loss is the candidate's own logged held-out loss.
  for j, loss in losses.items():
    assert loss == restarts.held_out_loss(
      run_dir.candidate_dir(str(out), j), 2)
  assert choice["chosen"] == min(losses, key=losses.get)
  assert choice["held_out_seed"] == config.seed
  # The rerun keeps the recorded choice and trains only the chosen one on.
  trained = []
  original = train.run_candidate

  def recording(config, placement, output_dir, index, stop_at):
    trained.append((index, stop_at))
    original(config, placement, output_dir, index, stop_at)

  monkeypatch.setattr(train, "run_candidate", recording)
  _launch(parse, tms_target, out)
  assert trained == [(choice["chosen"], 0)]
  assert json.loads((out / run_dir.CHOICE_FILE).read_text()) == choice
  for j in range(3):
    directory = run_dir.candidate_dir(str(out), j)
    recorded = (out / "candidates" / f"r{j}" / run_dir.FLAGS_FILE).read_text()
    # A candidate's record is its own run: its seed, the shared eval seed.
    assert f"--seed={config.seed + 1000 * j}\n" in recorded
    assert f"--eval_seed={config.seed}\n" in recorded
    assert "--restarts=1\n" in recorded
    finished = os.path.exists(os.path.join(directory, "decomposition.npz"))
    assert finished == (j == choice["chosen"])
    assert max(_steps(directory)) == (4 if finished else 2)
  assert "--restarts=3\n" in (out / run_dir.FLAGS_FILE).read_text()
  # Consumers name the selection's directory and get the chosen run's.
  chosen = run_dir.candidate_dir(str(out), choice["chosen"])
  assert run_dir.chosen_run(out) == chosen
  assert load_decomposition(out).step == load_decomposition(chosen).step == 4
  # So do the finished-run tools (explore, harvest, browse; tensorboard).
  loaded = explore.load_run(str(out))
  assert loaded.config.restarts == 1
  assert loaded.config.seed == config.seed + 1000 * choice["chosen"]
  done = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "tensorboard"),
     f"--run_dir={out}"], cwd=ROOT, capture_output=True, text=True,
    timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-2000:]
  assert os.listdir(os.path.join(chosen, "tensorboard"))
  # The finished selection is refused on a rerun, naming --overwrite.
  with pytest.raises(restarts.SelectionError, match="--overwrite"):
    _launch(parse, tms_target, out)


def test_a_diverged_candidate_is_left_out_of_the_choice(
    parse, tms_target, tmp_path, monkeypatch):
  out = tmp_path / "run"
  original = train.run_candidate

  def diverging_first(config, placement, output_dir, index, stop_at):
    if index == 0 and stop_at:
      raise checkpointing.Diverged("diverged at step 1")
    original(config, placement, output_dir, index, stop_at)

  monkeypatch.setattr(train, "run_candidate", diverging_first)
  # The choice alone: how the chosen one continues is the test above's.
  config = parse(*TINY, f"--target_path={tms_target}", f"--output_dir={out}",
                 "--restarts=2", "--select_at=2")
  placement = placement_setup.make_placement(
    placement_setup.config_from_flags(), (config.batch_size,))
  output_dir, lock = train.prepare_selection(config)
  try:
    returned = train.select_candidate(config, placement, output_dir)
  finally:
    os.close(lock)
  choice = json.loads((out / run_dir.CHOICE_FILE).read_text())
  assert choice == returned
  assert choice["losses"]["0"] is None and choice["chosen"] == 1
  assert choice["losses"]["1"] == restarts.held_out_loss(
    run_dir.candidate_dir(str(out), 1), 2)
  with pytest.raises(restarts.SelectionError, match="all 2 restart "):
    restarts.choose({0: None, 1: None})


@pytest.mark.parametrize("args,message", [
  (("--restarts=0",), "--restarts must be positive"),
  (("--select_at=2",), "set --restarts above 1"),
  (("--restarts=2",), r"needs --select_at in \(0, --num_steps=4\)"),
  (("--restarts=2", "--select_at=4"), "needs --select_at in"),
  (("--restarts=2", "--select_at=2", "--eval_every=4", "--log_every=2"),
   "multiple of --eval_every=4"),
  (("--restarts=2", "--select_at=2", "--save_every=4"),
   "multiple of --save_every=4"),
  (("--restarts=2", "--select_at=2", "--stop_after_step=2"),
   "rerunning its command"),
])
def test_bad_restart_flags_are_refused_in_one_line(parse, args, message):
  with pytest.raises(ValueError, match=message) as info:
    parse(*TINY, *args)
  assert "\n" not in str(info.value)
