"""Finished toy runs opened once per test module."""

import pytest

from decompax.analysis import explore


@pytest.fixture(scope="module")
def tms(finished_run):
  return explore.load_run(finished_run("tms"))


@pytest.fixture(scope="module")
def induction(finished_run):
  return explore.load_run(finished_run("induction"))
