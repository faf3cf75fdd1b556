"""--wandb_project: a run logs what metrics.jsonl holds, its settings and
its figures to W&B, here in offline mode (files under the run directory,
no network); a resumed run continues the same W&B run without logging a
step twice."""

import glob
import json
import os
import pathlib
import struct
import subprocess
import sys
import time

import matplotlib
import pytest
from wandb.proto import wandb_internal_pb2

from decompax.bin import wandb_sink
from decompax.io import run_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARGS = ("--target=tms_5-2", "--c=6", "--batch_size=16", "--num_steps=8",
        "--log_every=2", "--eval_every=4", "--slow_eval_every=8",
        "--save_every=4", "--wandb_project=decompax-test")


def _train(output_dir, *extra):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_MODE": "offline",
         "WANDB_SILENT": "true"}
  done = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "train"), *ARGS,
     f"--output_dir={output_dir}", *extra], cwd=ROOT, capture_output=True,
    text=True, env=env)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _records(path):
  """Return the protobuf records of a `.wandb` file: a 7-byte header, then
  log records (crc, length, type) in 32 KiB blocks, split across blocks by
  the FIRST/MIDDLE/LAST types."""
  data, at, block = open(path, "rb").read(), 7, 1 << 15
  records, pending = [], b""
  while at + 7 <= len(data):
    room = block - at % block
    if room < 7:
      at += room
      continue
    _, length, kind = struct.unpack("<IHB", data[at:at + 7])
    if kind == 0:
      break
    chunk, at = data[at + 7:at + 7 + length], at + 7 + length
    pending += chunk
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      records.append(record)
      pending = b""
  return records


def _logged(run_dir):
  """Return per offline W&B run (in launch order): its history rows
  `{step: {key: value}}` and its config keys."""
  runs = []
  for path in sorted(glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb")):
    history, config = {}, set()
    for record in _records(path):
      kind = record.WhichOneof("record_type")
      if kind == "history":
        row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
               for i in record.history.item}
        step = row.pop("_step")
        history.setdefault(step, {}).update(row)
      elif kind in ("config", "run"):
        # The settings given at init travel in the run record.
        update = (record.config if kind == "config" else record.run.config)
        config |= {"/".join(i.nested_key) or i.key for i in update.update}
    runs.append((history, config))
  return runs


def _logged_once_flushed(run_dir, last_step, timeout_s=60.0):
  """Return `_logged(run_dir)` once the second run's history holds
  `last_step`, or as it stands after `timeout_s`: W&B's service process
  writes the offline file behind `finish`, and under load it can lag."""
  deadline = time.monotonic() + timeout_s
  while True:
    runs = _logged(run_dir)
    if (len(runs) >= 2 and last_step in runs[1][0]) or (
        time.monotonic() > deadline):
      return runs
    time.sleep(0.2)


def _metrics(run_dir):
  return {r["step"]: r for r in map(json.loads, open(
    os.path.join(run_dir, "metrics.jsonl")))}


@pytest.mark.slow
def test_offline_runs_log_the_metrics_settings_and_figures_once(tmp_path):
  """Two launches (a stop at step 4, then the rest): one W&B run, each
  metrics.jsonl record logged once with its values, the settings at init
  and the figures at the end."""
  _train(tmp_path, "--stop_after_step=4")
  _train(tmp_path)
  (first, config), (second, _) = _logged(tmp_path)
  assert sorted(first) == [0, 2, 4] and sorted(second) == [6, 8]
  ids = {os.path.basename(p).split("-")[-1] for p in glob.glob(
    f"{tmp_path}/wandb/offline-run-*")}
  assert len(ids) == 1
  history = {**first, **second}
  for step, record in _metrics(tmp_path).items():
    for key, value in record.items():
      if key != "step" and isinstance(value, float):
        assert history[step][key] == value, (step, key)
  assert {"lr", "c", "target", "seed"} <= config
  assert any(k.startswith("figures/") for k in second[8])


def test_the_sink_logs_each_record_once_across_a_resume(tmp_path, monkeypatch):
  """Fast variant of the two launches above, with the sink alone: records
  appended to metrics.jsonl are logged once, with their values, by a sink
  and by its resumed successor; settings at init, figures at close."""
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  metrics = tmp_path / run_dir.METRICS_FILE
  settings = {"lr": 1e-3, "c": 6}

  def append(step, loss):
    run_dir.append_metrics(str(metrics), {"step": step, "loss/total": loss,
                                          "note": "text is left out"})

  sink = wandb_sink.open_sink("decompax-test", str(tmp_path), settings)
  append(0, 1.0)
  append(2, 0.5)
  sink.sync()
  sink.sync()  # nothing new: nothing logged
  sink.close()
  append(4, 0.25)
  figures = tmp_path / "figures"
  figures.mkdir()
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  plt.figure(figsize=(1, 1))
  plt.savefig(figures / "ci.png")
  plt.close()
  # An offline run's directory is named by its id and start second: a
  # resume within the same second would reuse the first one's directory.
  time.sleep(1.1)
  resumed = wandb_sink.open_sink("decompax-test", str(tmp_path), settings)
  resumed.close(str(figures))
  (first, config), (second, _) = _logged_once_flushed(tmp_path, 4)
  assert {s: h["loss/total"] for s, h in first.items()} == {0: 1.0, 2: 0.5}
  assert second[4]["loss/total"] == 0.25 and sorted(second) == [4]
  assert any(k.startswith("figures/ci/") for k in second[4])
  assert {"lr", "c"} <= config
  assert json.loads((tmp_path / wandb_sink.STATE_FILE).read_text())[
    "step"] == 4
