"""recipe/terms as bin/train shows it: every term's coefficient is a flag,
the rider flag's help lists the rider terms, the console line shows the
terms' short forms in table order (the table itself: tests/recipe/
test_term_table.py)."""

import pytest
from absl import flags

from decompax.bin import train
from decompax.core import sites as sites_lib
from decompax.recipe import terms as term_table

PLAIN = tuple(t for t in term_table.TERMS if not t.stream)


def test_every_coefficient_flag_is_a_train_flag():
  for term in term_table.TERMS:
    assert flags.FLAGS[term.coeff_flag].default is not None


def test_the_rider_flag_help_lists_the_rider_terms():
  help_text = flags.FLAGS["hidden_terms"].help
  for name in term_table.RIDER_TERMS:
    assert name in help_text


def test_the_progress_line_shows_short_forms_in_table_order():
  site = sites_lib.SiteSpec("linear1", "linear1", 0, 2, 2, 3)
  metrics = {f"loss/{t.name}": 1.0 for t in reversed(PLAIN)}
  metrics["ci_l0/linear1"] = 0.5
  line = train.progress_line(1, 10, metrics, (site,), 100.0)
  shorts = [part.split()[0] for part in line.split("  ")[1:-3]]
  assert shorts == [t.short for t in PLAIN]


def test_the_eta_counts_to_where_the_launch_stops():
  site = sites_lib.SiteSpec("linear1", "linear1", 0, 2, 2, 3)
  metrics = {f"loss/{t.name}": 1.0 for t in PLAIN} | {"ci_l0/linear1": 0.5}
  line = train.progress_line(1000, 40000, metrics, (site,), 100.0)
  assert line.endswith("ETA 6m30s")
  line = train.progress_line(1000, 40000, metrics, (site,), 100.0,
                             stop=12000)
  assert line.startswith("step 1000/40000") and line.endswith(
    "ETA 1m50s to step 12000")


@pytest.mark.parametrize("per_s, shown", [
  (173.4, "173 it/s"), (100.0, "100 it/s"), (54.27, "54.3 it/s"),
  (6.125, "6.12 it/s"), (0.4, "0.4 it/s")])
def test_the_rate_keeps_three_digits_below_a_hundred(per_s, shown):
  site = sites_lib.SiteSpec("linear1", "linear1", 0, 2, 2, 3)
  metrics = {f"loss/{t.name}": 1.0 for t in PLAIN} | {"ci_l0/linear1": 0.5}
  assert f"  {shown}  " in train.progress_line(1, 10, metrics, (site,),
                                               per_s)


def test_a_targeted_progress_line_shows_each_stream_behind_its_name():
  site = sites_lib.SiteSpec("linear1", "linear1", 0, 2, 2, 3)
  metrics = {"target/loss/stochastic_recon": 1.0,
             "target/loss/importance_minimality": 2.0,
             "nontarget/loss/recon": 3.0,
             "target/ci_l0/linear1": 0.5, "nontarget/ci_l0/linear1": 0.25}
  line = train.progress_line(1, 10, metrics, (site,), 100.0, targeted=True)
  assert ("target: imp 2.000e+00  recon 1.000e+00  nontarget: recon "
          "3.000e+00  target L0 0.50  nontarget L0 0.25") in line


@pytest.mark.parametrize("name", ["p_warmup_pct", "pgd_bundle",
                                  "merged_bundle", "pgd_lr_schedule"])
def test_flags_that_could_only_be_refused_are_gone(name):
  assert name not in flags.FLAGS
