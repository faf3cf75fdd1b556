"""Fixtures of the recipe tests: settings read as `bin/train` reads them,
through `recipe.flagfiles.read_args` (no absl flags to parse or restore)."""

import pytest

from decompax.recipe import flagfiles


@pytest.fixture
def parse():
  """Return `parse(*args)`: the checked `TrainConfig` of `--name=value`
  arguments and `--flagfile=PATH`s over the defaults, later ones winning."""

  def _parse(*args):
    return flagfiles.read_args(args)

  return _parse
