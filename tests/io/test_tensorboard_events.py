"""io/tensorboard_events: metrics.jsonl converted to TensorBoard event files."""

import glob
import json
import os
import struct

import pytest
from tensorboardX.proto import event_pb2

from decompax.io import run_dir
from decompax.io import tensorboard_events as tensorboard


def _events(directory):
  """Return every scalar `(tag, step, value)` of the event files, read as
  TFRecords: length, its CRC, the Event proto, its CRC."""
  found = []
  for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
    data = open(path, "rb").read()
    at = 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at:at + 8])
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
      at += 12 + length + 4
      for value in event.summary.value:
        found.append((value.tag, event.step, value.simple_value))
  return found


def _write_metrics(path, records):
  with open(os.path.join(path, run_dir.METRICS_FILE), "w") as f:
    for record in records:
      f.write(json.dumps(record) + "\n")


def test_numeric_values_become_scalars_at_their_steps(tmp_path):
  _write_metrics(tmp_path, [
    {"step": 0, "eval/recon/zero": 0.5, "note": "baseline"},
    {"step": 10, "loss/total": 1.25, "lr": 2e-3, "skipped": True},
    {"step": 20, "loss/total": float("nan"), "lr": 1e-3},
  ])
  path, count = tensorboard.write_events(str(tmp_path))
  assert path == os.path.join(tmp_path, tensorboard.EVENTS_DIR)
  scalars = sorted(_events(path))
  assert scalars == sorted([
    ("eval/recon/zero", 0, 0.5), ("loss/total", 10, 1.25),
    ("lr", 10, pytest.approx(2e-3)), ("lr", 20, pytest.approx(1e-3))])
  assert count == 4
  # A rerun replaces the conversion rather than adding to it.
  _write_metrics(tmp_path, [{"step": 0, "loss/total": 3.0}])
  tensorboard.write_events(str(tmp_path))
  assert _events(path) == [("loss/total", 0, 3.0)]
  # No staging directory is left behind.
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".tensorboard")]


def test_a_directory_without_metrics_is_named(tmp_path):
  with pytest.raises(ValueError, match="holds no metrics.jsonl"):
    tensorboard.write_events(str(tmp_path))
