"""A run's flags.txt read back as bin/train wrote it (`bin/report` checks
it before writing a report of the run)."""

import pytest

from decompax.bin import run_records, train


def _run(tmp_path, text: str) -> str:
  (tmp_path / "flags.txt").write_text(text)
  return str(tmp_path)


def test_every_flag_bin_train_records_is_known():
  recorded = {flag.name for flag in train._run_flags()}
  assert recorded <= run_records.RECORDED_FLAGS
  assert {"target", "seed", "fsdp", "placement"} <= recorded


def test_the_flags_a_run_records_read_back(tmp_path):
  assert run_records.check_flags_file(
    _run(tmp_path, train.resolved_flags_text())) == []


@pytest.mark.parametrize("text, reason", [
  ("--bogus_flag=1\n--c=abc\n", "'--c=abc': invalid literal"),
  ("--bogus_flag=1 --c=abc\n", "sets no flag of bin/train, only "
   "--bogus_flag"),
  ("--target=tms_5-2\ngarbage\n", "line 2, 'garbage', is not --name=value"),
  ("--seed=-1\n", "--seed must lie in [0, 2**32), got -1"),
])
def test_a_damaged_flags_file_is_refused(tmp_path, text, reason):
  with pytest.raises(ValueError, match=None) as refused:
    run_records.check_flags_file(_run(tmp_path, text))
  assert reason in str(refused.value)


def test_a_flag_bin_train_no_longer_has_is_named(tmp_path):
  text = train.resolved_flags_text() + "--retired_flag=3\n"
  assert run_records.check_flags_file(_run(tmp_path, text)) == [
    "retired_flag"]


def test_no_flags_file_is_left_to_the_report_to_name(tmp_path):
  assert run_records.check_flags_file(str(tmp_path)) == []
