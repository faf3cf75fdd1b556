"""Every TMS flagfile runs through both eval tiers, a step and a save.

A failure that only shows at the first slow eval shows here. The other
flagfiles run in `test_eval_smoke_models.py` (two files, so the suite's
workers share them; `conftest.py` splits the flagfiles). The default suite
runs one flagfile per code path (`conftest.SMOKE_IN_DEFAULT`), the rest are
`slow`; `test_flagfiles_lower.py` lowers the slow ones' steps (this
file's own recipe, `tms_5-2`, among them).
"""

import math

from decompax.io import run_dir

SMOKE_GROUP = "tms"


def test_flagfile_runs_both_eval_tiers_and_saves(smoke_run, smoke_flagfile,
                                                  tmp_path):
  smoke_run(smoke_flagfile)
  # Every logged value is a finite plain number (a JSON round trip alone
  # would pass NaN, lists and strings).
  records = run_dir.read_metrics(tmp_path / "run" / run_dir.METRICS_FILE)
  assert len(records) == 2
  for record in records:
    for key, value in record.items():
      assert type(value) in (int, float), (key, value)
      assert math.isfinite(value), (key, value)
