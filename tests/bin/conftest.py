"""Fixtures shared by the bin tests."""

import pytest
from absl import flags

from decompax.bin import train_flags


@pytest.fixture
def parse():
  """Parse flags into a TrainConfig; restore the defaults after."""

  def _parse(*args):
    flags.FLAGS.unparse_flags()
    argv = flags.FLAGS.read_flags_from_files(list(args), force_gnu=False)
    flags.FLAGS(["train", *argv])
    return train_flags.config_from_flags()

  yield _parse
  flags.FLAGS.unparse_flags()
  flags.FLAGS.mark_as_parsed()
