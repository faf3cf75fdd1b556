"""Every non-TMS flagfile runs through both eval tiers, a step and a save:
the residual MLPs, the induction toy and the tiny Llama (see
`test_eval_smoke.py`; which of them the default suite runs)."""

SMOKE_GROUP = "models"


def test_every_kind_of_cpu_flagfile_has_a_smoke_run(cpu_flagfile_names,
                                                   smoke_in_default):
  assert cpu_flagfile_names >= {
    "tms_5-2", "tms_5-2_vpd", "resid_mlp1", "resid_mlp2", "resid_mlp3",
    "tiny_llama", "induction"}
  assert "l18" not in cpu_flagfile_names
  # A renamed flagfile must not drop its code path out of the default suite.
  assert smoke_in_default <= cpu_flagfile_names


def test_flagfile_runs_both_eval_tiers_and_saves(smoke_run, smoke_flagfile):
  smoke_run(smoke_flagfile)
