"""A harvest's settings: requests and cadences no run can serve are refused
on one line naming the setting, and the statistics' field names are the
tag and context records' own."""

import pytest

from decompax.analysis import harvest_settings
from decompax.measures import tag_context, tag_profile


@pytest.mark.parametrize("field, value, message", [
  ("positions", 0, "positions=0 must be positive"),
  ("batch_size", -1, "batch_size=-1 must be positive"),
  ("top_k", 0, "top_k=0 must be positive"),
  ("window_before", -1, "window_before=-1 must be 0 or more"),
  ("ablation_batches", -2, "ablation_batches=-2 must be 0 or more"),
])
def test_a_request_no_run_can_serve_is_named(field, value, message):
  request = harvest_settings.Request(**{field: value})
  with pytest.raises(ValueError, match=message):
    harvest_settings.check_request(request)


def test_the_default_request_and_its_unset_windows_pass():
  harvest_settings.check_request(harvest_settings.Request())
  harvest_settings.check_request(harvest_settings.Request(
    window_before=0, ablation_batches=0))


def test_a_cadence_no_harvest_can_use_is_named():
  harvest_settings.check_cadence(0.0, 1)
  with pytest.raises(ValueError, match="save_every_s=-1"):
    harvest_settings.check_cadence(-1.0, 1)
  with pytest.raises(ValueError, match="ablation_chunk=0"):
    harvest_settings.check_cadence(1.0, 0)


def test_field_names_follow_the_records():
  assert harvest_settings.TAG_FIELDS == tuple(
    f"tag_{name}" for name in tag_profile.TagStats._fields)
  assert harvest_settings.CONTEXT_FIELDS == tuple(
    f"tag_{name}" for name in tag_context.ContextStats._fields)
  assert set(harvest_settings.CONTEXT_FIELDS).isdisjoint(
    harvest_settings.TAG_FIELDS)
