"""Every TMS flagfile runs through both eval tiers, a step and a save.

A failure that only shows at the first slow eval shows here. The other
flagfiles run in `test_eval_smoke_models.py` (two files, so the suite's
workers share them; `conftest.py` splits the flagfiles).
"""

SMOKE_GROUP = "tms"


def test_flagfile_runs_both_eval_tiers_and_saves(smoke_run, smoke_flagfile):
  smoke_run(smoke_flagfile)
