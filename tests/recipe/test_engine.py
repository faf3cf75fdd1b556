"""The engine's objects from a config: the sites a run names, the learning
rate schedules, the compute dtype and the step's static settings."""

import pytest

from decompax.core import optim, sites as sites_lib
from decompax.core.schedules import KnotSchedule, Schedule
from decompax.recipe import engine

SITES = tuple(sites_lib.SiteSpec(n, n, 0, 2, 2, 1) for n in ("a", "b", "c"))


def test_named_sites_keep_their_canonical_order():
  assert engine.select_sites(SITES, (), "toy") == SITES
  assert engine.select_sites(SITES, ("c", "a"), "toy") == (SITES[0],
                                                           SITES[2])
  with pytest.raises(ValueError, match="unknown site 'z' for target toy"):
    engine.select_sites(SITES, ("z",), "toy")


def test_the_schedule_is_warmup_then_decay_or_the_knots(parse):
  config = parse("--lr_schedule=cosine", "--lr_final_frac=0.1",
                 "--lr_warmup_pct=0.2")
  assert engine.lr_schedule(config, 0.5) == Schedule(0.5, "cosine", 0.1, 0.2)
  constant = parse("--lr_schedule=constant", "--lr_final_frac=0")
  assert engine.lr_schedule(constant, 0.5).final_frac == 1.0
  knots = engine.lr_schedule(parse("--lr_knots=0:0,0.5:1,1:0.25"), 0.5)
  assert isinstance(knots, KnotSchedule) and knots.max_val == 0.5


def test_the_step_config_carries_the_runs_settings(parse):
  config = parse("--num_steps=7", "--lr=0.01", "--ci_lr=0.02",
                 "--components_optimizer=adamw")
  step = engine.step_config(config)
  assert step.total_steps == 7 and step.streams == ()
  assert isinstance(step.components_opt, optim.AdamWConfig)
  assert step.components_opt.lr.start == 0.01
  assert step.ci_opt.lr.start == 0.02
  assert engine.compute_dtype(config) is None  # a toy uses its masters
