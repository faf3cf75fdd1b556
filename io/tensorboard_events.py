"""A run's `metrics.jsonl` as TensorBoard event files (`bin/tensorboard`).

Every numeric value of every record becomes a scalar at the record's step,
under its own key (`loss/total`, `eval/recon/ci_masked`, …); strings and
other values are left out. The events are written to a fresh directory and
moved into place whole, so a rerun replaces the previous conversion and an
interrupted one leaves the previous in place.
"""

import os
import shutil
import tempfile

from decompax.io import run_dir

EVENTS_DIR = "tensorboard"


def write_events(path: str) -> tuple[str, int]:
  """Convert the run at `path` and return the event directory and the
  number of scalars written.

  Raises ValueError when `path` holds no `metrics.jsonl`, and ImportError
  naming the extra to install when tensorboardX is missing.
  """
  metrics = os.path.join(path, run_dir.METRICS_FILE)
  if not os.path.isfile(metrics):
    raise ValueError(f"{path} holds no {run_dir.METRICS_FILE}; pass the "
                     "output directory of a bin/train run")
  try:
    from tensorboardX import SummaryWriter  # noqa: PLC0415 (optional extra)
  except ImportError:
    raise ImportError("tensorboardX is not installed; install the extra: "
                      "pip install 'decompax[tensorboard]'") from None
  target = os.path.join(path, EVENTS_DIR)
  staging = tempfile.mkdtemp(prefix=".tensorboard-", dir=path)
  count = 0
  try:
    writer = SummaryWriter(logdir=staging)
    for record in run_dir.read_metrics(metrics):
      for key, value in run_dir.scalar_values(record).items():
        writer.add_scalar(key, value, global_step=int(record["step"]))
        count += 1
    writer.close()
    if os.path.exists(target):
      shutil.rmtree(target)
    os.rename(staging, target)
  finally:
    if os.path.exists(staging):
      shutil.rmtree(staging)
  return target, count
