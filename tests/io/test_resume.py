"""Resuming from a checkpoint (SPEC §12): the first difference in sites, C
or CI function between a checkpoint and a run is named, and term states a
checkpoint stored by position are read by name."""

import pytest

from decompax.core import ci_fns, sites as sites_lib
from decompax.io import checkpoint, decomposition, resume

SITES = (sites_lib.SiteSpec("a", "a", 0, 4, 3, 2),
         sites_lib.SiteSpec("b", "b", 0, 3, 4, 2))
CI = ci_fns.CIConfig()


def _metadata(sites=SITES, ci=CI):
  return {"sites": [decomposition.to_json(s) for s in sites],
          "ci_config": decomposition.to_json(ci)}


def test_a_checkpoint_of_the_same_structure_matches():
  assert resume.structure_mismatch(_metadata(), SITES, CI) is None


def test_the_first_difference_is_named():
  assert resume.structure_mismatch(_metadata(SITES[:1]), SITES, CI) == (
    "sites are a in the parent, a,b here")
  wider = (SITES[0], sites_lib.SiteSpec("b", "b", 0, 3, 4, 5))
  assert resume.structure_mismatch(_metadata(wider), SITES, CI) == (
    "site b.c is 5 in the parent, 2 here")
  other = ci_fns.CIConfig(hidden=(8,))
  assert "ci_config.hidden" in resume.structure_mismatch(
    _metadata(ci=other), SITES, CI)


def test_positional_term_states_are_read_by_name():
  stored = ("term_states/2/sources", "term_states/0/ema", "components/a/v",
            "term_states/pgd/sources")
  assert resume.positional_term_states(stored) == [0, 2]
  assert resume.term_state_renames([0, 2], ("freq", "pgd"), "ckpt") == {
    "term_states/0": "term_states/freq", "term_states/2": "term_states/pgd"}
  with pytest.raises(checkpoint.CheckpointError, match="stores 2 term"):
    resume.term_state_renames([0, 2], ("pgd",), "ckpt")
