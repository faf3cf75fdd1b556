"""bench/recovery.py runs a cell through bin/train, measures its sites from
the finished run and reads a finished cell instead of rerunning it; a stop
reaches the running cells, starts no new one and exits for a requeue."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The bench reads the fast evals' held-out loss and probes the finished
# decomposition itself: no slow tier to compile or draw.
SHORT = ["--num_steps=40", "--log_every=20", "--eval_every=20",
         "--batch_size=64", "--eval_batches=1", "--c=8",
         "--noslow_on_first_step", "--slow_eval_every=0",
         "--restarts=1", "--select_at=0"]


@pytest.fixture(scope="module")
def bench(load_bench):
  return load_bench("recovery")


def test_grid_parsing(bench):
  assert bench.parse_seeds("0-3") == [0, 1, 2, 3]
  assert bench.parse_seeds("1+4") == [1, 4]
  assert bench.parse_grid(["tms_5-2:1+4", "resid_mlp1:0"]) == [
    ("tms_5-2", 1), ("tms_5-2", 4), ("resid_mlp1", 0)]
  assert bench.parse_grid(["flags/tms_5-2.flags:2"]) == [("tms_5-2", 2)]
  with pytest.raises(Exception, match="no flagfile"):
    bench.parse_grid(["tms_9-9:0"])
  with pytest.raises(Exception, match="names no seeds"):
    bench.parse_grid(["tms_5-2"])
  for bad in ("a", "3-1", "0-", "1++2", "-2"):
    with pytest.raises(Exception, match="neither a rising range"):
      bench.parse_grid([f"tms_5-2:{bad}"])


def test_a_broken_site_is_described_by_its_nonzero_forms(bench):
  assert bench.describe_breaks(
    {"shared": 1, "shared_features": 4, "split": 0, "weak": 0}) == \
    "1 shared by 4 features"
  assert bench.describe_breaks(
    {"extra": 21, "extra_features": 40, "missing": 2}) == \
    "21 extra on 40 features, 2 block columns never kept"
  assert bench.describe_breaks(
    {"extra": 0, "extra_features": 0, "missing": 4,
     "lowest_peak": 0.8958}) == \
    "4 block columns never kept (lowest peak 0.896)"
  assert bench.describe_breaks({"missing": 1}) == "1 block column never kept"
  assert bench.describe_breaks(
    {"shared": 0, "shared_features": 0, "split": 0, "weak": 1,
     "lowest_peak": 0.83}) == "1 weak (lowest peak 0.830)"
  assert bench.describe_breaks(
    {"weak": 7, "lowest_peak": 0.696, "weak_read": 0.4012}) == \
    "7 weak (lowest peak 0.696, read 0.40x the rest's)"
  assert bench.describe_breaks(
    {"shared": 1, "shared_features": 2, "split": 1, "weak": 0}) == \
    "1 shared by 2 features, 1 feature split"
  assert bench.describe_breaks(
    {"shared": 1, "shared_features": 2, "split": 1, "weak": 0,
     "shared_cosine": 0.94312, "shared_as_parallel": 1,
     "feature_pairs": 5151}) == \
    ("1 shared by 2 features (reads at cosine 0.943 or more; 1 of the "
     "site's 5151 pairs as parallel), 1 feature split")
  row = {"alive": 4, "error": 4, "breaks": {"shared": 1, "shared_features": 4,
                                            "split": 0, "weak": 0}}
  assert bench._site_cell(row) == "4 / 4: 1 shared by 4 features"
  # Rows tabled before the breakdown existed still render.
  assert bench._site_cell({"alive": 5, "error": 2}) == "5 / 2"


def test_extra_flags_keep_commas_inside_values(bench):
  assert bench.split_extra("--restarts=3,--select_at=12000") == [
    "--restarts=3", "--select_at=12000"]
  knots = "--p_knots=0:1:linear,0.5:0.25:hold,1:0.25"
  assert bench.split_extra(knots + ",--seed=1") == [knots, "--seed=1"]
  assert bench.split_extra("") == []


def test_a_stop_reaches_the_running_cell_and_starts_no_more(bench, tmp_path):
  ready = tmp_path / "ready"
  # Stands in for bin/train: exits 75 on SIGTERM, as a run that saved does.
  child = [sys.executable, "-c",
           "import pathlib, signal, sys, time; "
           "signal.signal(signal.SIGTERM, lambda *_: sys.exit(75)); "
           f"pathlib.Path({str(ready)!r}).touch(); time.sleep(120)"]
  codes = []
  worker = threading.Thread(
    target=lambda: codes.append(bench.run_logged(child, tmp_path / "log")))
  try:
    worker.start()
    deadline = time.time() + 60
    while not ready.exists() and time.time() < deadline:
      time.sleep(0.05)
    bench.stop(signal.SIGTERM)
    worker.join(60)
    assert codes == [75]
    with pytest.raises(bench.Stopped, match="stopping"):
      bench.run_logged(child, tmp_path / "log")
  finally:
    bench._stopping.clear()


def test_a_stopped_bench_names_its_cells_and_exits_for_a_requeue(tmp_path):
  long_run = [f for f in SHORT if not f.startswith("--num_steps")] + [
    "--num_steps=1000000"]
  bench_run = subprocess.Popen(
    [sys.executable, "-P", "-m", "bench.recovery",
     "--grid=tms_5-2:0+1", "--jobs=1", f"--out_dir={tmp_path}",
     "--variant=v", "--extra=" + ",".join(long_run)],
    env={**os.environ, "PYTHONPATH": str(ROOT)},
    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  log = tmp_path / "v" / "tms_5-2_s0.log"
  deadline = time.time() + 240
  # Past warmup, so that the stop is saved as a checkpoint.
  while time.time() < deadline and not (
      log.exists() and "step 20/" in log.read_text()):
    time.sleep(0.2)
  bench_run.send_signal(signal.SIGTERM)
  out, err = bench_run.communicate(timeout=120)
  assert bench_run.returncode == 75, err[-2000:]
  assert "[recovery] stopped tms_5-2 seed 0: tms_5-2_s0 stopped for a " \
    "requeue" in out
  assert "[recovery] stopped tms_5-2 seed 1: not started" in out
  assert "FAILED" not in out
  assert "2 cell(s) stopped; rerun the same command" in err
  cell = tmp_path / "v" / "tms_5-2_s0"
  assert any((cell / "checkpoints").iterdir())
  assert float(cell.with_suffix(".wall").read_text()) > 0
  assert not (tmp_path / "v" / "tms_5-2_s1").exists()


def test_a_failed_cell_outranks_a_stopped_one_in_the_exit(bench):
  with pytest.raises(SystemExit) as failed:
    bench.finish(["a seed 0: exited 1"], ["b seed 1: stopped"])
  assert str(failed.value.code).startswith("1 cell(s) failed: a seed 0")
  assert "1 cell(s) stopped; rerun" in str(failed.value.code)
  with pytest.raises(SystemExit) as stopped:
    bench.finish([], ["b seed 1: stopped"])
  assert stopped.value.code == 75
  bench.finish([], [])  # every cell finished: a normal return


def test_a_cell_runs_once_and_is_measured(bench, tmp_path):
  said = []
  bench.run_cell(tmp_path, "tms_5-2", 3, SHORT, said.append)
  directory = bench.cell_dir(tmp_path, "tms_5-2", 3)
  assert (directory / "decomposition.npz").exists()
  flags_text = (directory / "flags.txt").read_text()
  assert "--seed=3" in flags_text and "--num_steps=40" in flags_text
  wall = float(directory.with_suffix(".wall").read_text())
  assert wall > 0
  # The restarts' selection score (the full selection runs in the slow
  # tier): the held-out loss the step-20 eval logged.
  assert bench.held_out_loss(directory, 20) > 0
  result = bench.measure_cell(directory, "tms_5-2")
  assert set(result["sites"]) == {"linear1", "linear2"}
  for row in result["sites"].values():
    assert 0 <= row["alive"] <= 8 and row["error"] >= 0
    assert -1 <= row["mmcs"] <= 1 and row["ml2r"] >= 0
    # An identity site breaks in some named form exactly when it has errors.
    counts = {"shared", "shared_features", "split", "weak"}
    # Weak features come with how the site reads them next to the rest,
    # where some feature is not weak.
    some_weak = 0 < row["breaks"]["weak"] < 5
    # Shared components come with how parallel their features' reads are.
    shared = {"shared_cosine", "shared_as_parallel", "feature_pairs"}
    assert set(row["breaks"]) == counts | {"lowest_peak"} | (
      {"weak_read"} if some_weak else set()) | (
      shared if row["breaks"]["shared"] else set())
    assert row["breaks"].get("weak_read", 1.0) > 0
    assert (row["error"] == 0) == (not any(row["breaks"][k] for k in counts))
    assert 0 <= row["breaks"]["lowest_peak"] <= 1
  # 40 steps do not recover TMS; the verdict follows the errors.
  assert result["recovered"] == all(
    r["error"] == 0 for r in result["sites"].values())
  # A finished cell is read, not rerun: nothing is launched, no wall added.
  said.clear()
  bench.run_cell(tmp_path, "tms_5-2", 3, SHORT, said.append)
  assert said == []
  assert float(directory.with_suffix(".wall").read_text()) == wall
  bench.write_tables(tmp_path, {("tms_5-2", 3): result}, "short", SHORT)
  table = (tmp_path / "recovery.md").read_text()
  assert "| tms_5-2 | " + ("1" if result["recovered"] else "0") + " of 1 |" \
    in table
  cells = json.loads((tmp_path / "recovery.json").read_text())["cells"]
  assert cells[0]["seed"] == 3 and cells[0]["sites"] == json.loads(
    json.dumps(result["sites"]))
  # A later invocation over other seeds keeps the cells tabled before.
  bench.write_tables(tmp_path, {("tms_5-2", 7): result}, "short", SHORT)
  cells = json.loads((tmp_path / "recovery.json").read_text())["cells"]
  assert [c["seed"] for c in cells] == [3, 7]
  assert "of 2 |" in (tmp_path / "recovery.md").read_text()
  # The bench itself measures on the CPU, leaving the accelerator to the
  # cells: the environment here names a TPU this machine lacks, and the
  # finished cell is read and measured without one.
  bench_run = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bench" / "recovery.py"),
     "--grid=tms_5-2:3", f"--out_dir={tmp_path.parent}",
     f"--variant={tmp_path.name}"],
    capture_output=True, text=True, timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "tpu"})
  assert bench_run.returncode == 0, bench_run.stderr[-2000:]
  assert "tms_5-2 seed 3: " in bench_run.stdout
  _snapshot_measures_an_unfinished_copy(bench, directory, result,
                                        tmp_path / "unfinished")


def _snapshot_measures_an_unfinished_copy(bench, directory, result, variant):
  """The finished cell with its final decomposition taken away stands for a
  cell between stretches: its newest checkpoint is the run's last step."""
  copy = bench.cell_dir(variant, "tms_5-2", 3)
  shutil.copytree(directory, copy)
  (copy / "decomposition.npz").unlink()
  with pytest.raises(FileNotFoundError, match="--snapshot"):
    bench.measure_cell(copy, "tms_5-2")
  snapshot = bench.measure_cell(copy, "tms_5-2", snapshot=True)
  assert snapshot["step"] == 40
  assert snapshot["sites"] == result["sites"]
  assert "| 3 (step 40) | " in bench.markdown(
    {("tms_5-2", 3): snapshot}, "short", SHORT)
  # The command trains nothing and records nothing: the tables hold
  # finished cells.
  snapshot_run = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bench" / "recovery.py"),
     "--grid=tms_5-2:3", f"--out_dir={variant.parent}",
     f"--variant={variant.name}", "--snapshot"],
    capture_output=True, text=True, timeout=300)
  assert snapshot_run.returncode == 0, snapshot_run.stderr[-2000:]
  assert "tms_5-2 seed 3 at step 40: " in snapshot_run.stdout
  assert not (copy / "decomposition.npz").exists()
  assert not (variant / "recovery.json").exists()
  empty = variant.parent / "empty"
  with pytest.raises(FileNotFoundError, match="no checkpoint yet"):
    bench.measure_cell(bench.cell_dir(empty, "tms_5-2", 3), "tms_5-2",
                       snapshot=True)
  # A --restarts cell before its choice has no one run to measure.
  choosing = bench.cell_dir(variant.parent / "choosing", "tms_5-2", 3)
  (choosing / "candidates" / "r0").mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match="still choosing"):
    bench.measure_cell(choosing, "tms_5-2", snapshot=True)


@pytest.mark.slow
def test_a_restarts_cell_is_measured_on_the_chosen_candidate(bench, tmp_path):
  said = []
  extra = SHORT + ["--save_every=20", "--restarts=2", "--select_at=20"]
  bench.run_cell(tmp_path, "tms_5-2", 5, extra, said.append)
  cell = bench.cell_dir(tmp_path, "tms_5-2", 5)
  directory, choice = bench.final_run(cell)
  losses = {int(k): v for k, v in choice["losses"].items()}
  assert choice["chosen"] == min(losses, key=losses.get)
  assert directory == cell / "candidates" / f"r{choice['chosen']}"
  assert (directory / "decomposition.npz").exists()
  for j in (0, 1):
    run = cell / "candidates" / f"r{j}"
    assert bench.held_out_loss(run, 20) == pytest.approx(losses[j])
    # Scored on the cell seed's held-out batches, not the candidate's own.
    assert "--eval_seed=5" in (run / "flags.txt").read_text().split()
  result = bench.measure_cell(cell, "tms_5-2")
  assert result["selection"] == choice and result["wall_s"] > 0
  # A rerun reads the finished cell and launches nothing.
  said.clear()
  bench.run_cell(tmp_path, "tms_5-2", 5, extra, said.append)
  assert said == []
