"""A step's streams, passes and checks (SPEC §6.6): each term scores the
stream it names, and the settings no step can run are refused before
anything is built (I22, I45)."""

import pytest

from decompax.core import optim, step_records, step_streams
from decompax.core.schedules import Schedule


def _term(name, stream="", **options):
  return step_records.LossTerm(name, 1.0, None, stream=stream, **options)


def _config(streams=(), **options):
  adam = optim.AdamWConfig(lr=Schedule(1e-3))
  return step_records.StepConfig(10, adam, adam, streams=streams, **options)


TWO = (step_records.StreamSpec("target"),
       step_records.StreamSpec("nontarget", delta_pin=True))


def test_a_plain_step_has_one_unnamed_stream():
  assert step_streams.stream_specs(_config()) == (
    step_records.StreamSpec(""),)
  assert step_streams.stream_specs(_config(TWO)) == TWO


def test_each_term_scores_the_stream_it_names():
  terms = (_term("a", "nontarget"), _term("b", "target"),
           _term("c", "nontarget"))
  assert step_streams.term_streams(terms, _config(TWO)) == (1, 0, 1)
  with pytest.raises(ValueError, match="scores stream 'other'"):
    step_streams.term_streams((_term("d", "other"),), _config(TWO))
  assert step_streams.by_stream(_config(), 3) == {"": 3}
  per_stream = {"target": 1, "nontarget": 2}
  assert step_streams.by_stream(_config(TWO), per_stream) is per_stream


def test_clashing_term_names_are_refused():
  with pytest.raises(ValueError, match="must be unique"):
    step_streams.check_term_names((_term("a"), _term("a")))
  with pytest.raises(ValueError, match="would be shared"):
    step_streams.check_term_names((_term("a", "target"),
                                   _term("a", "nontarget")))
  step_streams.check_term_names((_term("a"), _term("b")))


@pytest.mark.parametrize("terms, config, message", [
  ((), _config(on_nonfinite="retry"), "on_nonfinite"),
  ((_term("a", finish=lambda *a: None),), _config(), "no init_state"),
  ((), _config(ci_scaled_decay=-1.0), "decay must be >= 0"),
  ((), _config((step_records.StreamSpec("x"),) * 2), "distinct"),
])
def test_settings_no_step_can_run_are_refused(terms, config, message):
  with pytest.raises(ValueError, match=message):
    step_streams.check_step(terms, config)
