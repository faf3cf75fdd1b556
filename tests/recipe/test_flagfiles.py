"""recipe/flagfiles: `read_args` reads recipes (flagfiles and
`--name=value` overrides) into a checked config without absl."""

import pytest

from decompax.recipe.config import DEFAULTS, TrainConfig
from decompax.recipe.flagfiles import read_args


def test_no_arguments_are_the_defaults():
  assert read_args([]) == DEFAULTS == TrainConfig()


def test_values_take_their_field_types():
  config = read_args(["--c=7", "--lr=2e-3", "--target=resid_mlp1",
                      "--ci_hidden=8,4", "--sites=a, b", "--target_seed=5",
                      "--pgd_betas=0.4,0.9"])
  assert (config.c, config.lr, config.target) == (7, 2e-3, "resid_mlp1")
  assert config.ci_hidden == (8, 4) and config.sites == ("a", "b")
  assert config.target_seed == 5 and config.pgd_betas == ("0.4", "0.9")


@pytest.mark.parametrize("arg,value", [
  ("--keep_all", True), ("--nokeep_all", False), ("--keep_all=true", True),
  ("--keep_all=False", False), ("--keep_all=1", True), ("--keep_all=0", False)])
def test_booleans_take_every_absl_form(arg, value):
  assert read_args([arg]).keep_all is value


def test_flagfiles_nest_skip_comments_and_later_settings_win(tmp_path):
  inner = tmp_path / "inner.flags"
  inner.write_text("# a comment\n--c=3\n// another\n\n--lr=0.5\n")
  outer = tmp_path / "outer.flags"
  outer.write_text(f"--c=9\n--flagfile={inner}\n--seed=4\n")
  config = read_args([f"--flagfile={outer}", "--lr=0.25"])
  assert (config.c, config.lr, config.seed) == (3, 0.25, 4)


def test_a_config_is_read_over_another():
  base = read_args(["--c=3"])
  assert read_args(["--lr=0.5"], base) == read_args(["--c=3", "--lr=0.5"])


@pytest.mark.parametrize("arg,message", [
  ("--nonsense=1", "'--nonsense=1' sets no setting of a run"),
  ("c=3", "sets no setting"),
  ("--c", "needs a value, --c=value"),
  ("--c=x", "'--c=x': invalid literal for int()"),
  ("--lr=nan", "'--lr=nan': 'nan' is not a finite number"),
  ("--keep_all=maybe", "'maybe' is not a boolean"),
])
def test_bad_arguments_are_one_line_errors_naming_them(arg, message):
  with pytest.raises(ValueError) as info:
    read_args([arg])
  assert message in str(info.value)
  assert "\n" not in str(info.value)


def test_an_empty_optional_setting_reads_as_unset():
  """A run's flags.txt writes unset optional flags as `--name=`."""
  config = read_args(["--ci_lr=", "--target_seed="])
  assert config.ci_lr is None and config.target_seed is None
  with pytest.raises(ValueError, match="'--lr='"):
    read_args(["--lr="])
