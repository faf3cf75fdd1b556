"""Number flags of bin/train refuse NaN and infinity when they are parsed.

A non-finite value passes every comparison in `train_flags.validate` (each
comparison with NaN is false) and would reach the optimizer. The binary's
one-line refusal of one, its run directory unwritten, is a row of
tests/bin/test_bad_inputs.py (`lr_nan`).
"""

import dataclasses
import pathlib

import pytest
from absl import flags

from decompax.bin import cli, train_flags
from decompax.recipe import config as config_lib
from decompax.recipe import flagfiles

ROOT = pathlib.Path(__file__).resolve().parents[2]
FLOAT_FLAGS = sorted(
  f.name for f in flags.FLAGS.get_flags_for_module(train_flags)
  if isinstance(f.parser, flags.FloatParser))
NON_FINITE = ("nan", "NaN", "inf", "-inf", "Infinity", "1e999")


@pytest.fixture
def parse_args():
  """Parse `bin/train` arguments (flagfiles too); restore the defaults."""

  def _parse(*args):
    flags.FLAGS.unparse_flags()
    argv = flags.FLAGS.read_flags_from_files(list(args), force_gnu=False)
    flags.FLAGS(["train", *argv])

  yield _parse
  flags.FLAGS.unparse_flags()
  flags.FLAGS.mark_as_parsed()


def test_every_float_flag_is_found():
  # Guards the parametrization below against silently covering nothing.
  assert len(FLOAT_FLAGS) >= 37
  assert {"lr", "pgd_eps", "ci_lr", "reference_token_count"} <= set(
    FLOAT_FLAGS)


@pytest.mark.parametrize("name", FLOAT_FLAGS)
@pytest.mark.parametrize("text", NON_FINITE)
def test_float_flags_refuse_non_finite_values(parse_args, name, text):
  with pytest.raises(flags.IllegalFlagValueError) as info:
    parse_args(f"--{name}={text}")
  assert f"--{name}={text}: must be a finite number" in str(info.value)


@pytest.mark.parametrize("name", FLOAT_FLAGS)
def test_float_flags_keep_finite_values(parse_args, name):
  parse_args(f"--{name}=0.25")
  assert flags.FLAGS[name].value == 0.25


def test_a_flagfile_value_is_checked_too(parse_args, tmp_path):
  flagfile = tmp_path / "run.flags"
  flagfile.write_text("--c=4\n--ci_lr=inf\n")
  with pytest.raises(flags.IllegalFlagValueError,
                     match="--ci_lr=inf: must be a finite number"):
    parse_args(f"--flagfile={flagfile}")


@pytest.mark.parametrize("name,text", [
  ("pgd_betas", "nan,0.99"),
  ("pgd_betas", "0.5,inf"),
  ("pgd_betas", "0.5,x"),
  ("nonlinearity_weights", "gelu:nan"),
  ("nonlinearity_weights", "relu:1,gelu:-inf"),
])
def test_list_flags_of_numbers_refuse_non_finite_entries(parse_args, name,
                                                         text):
  with pytest.raises(flags.IllegalFlagValueError) as info:
    parse_args(f"--{name}={text}")
  assert f"--{name}={text}: " in str(info.value)
  assert "finite number" in str(info.value)


def test_list_flags_of_numbers_keep_good_entries(parse_args):
  parse_args("--pgd_betas=0.9,0.999", "--nonlinearity_weights=relu:2,gelu:none")
  assert flags.FLAGS.pgd_betas == ["0.9", "0.999"]
  assert flags.FLAGS.nonlinearity_weights == ["relu:2", "gelu:none"]


def test_every_config_field_is_a_flag_with_the_field_default():
  """bin/train's flags set the fields of `TrainConfig` and take their
  defaults from it: parsing nothing gives the library's defaults."""
  module_flags = {f.name for f in
                  flags.FLAGS.get_flags_for_module(train_flags)}
  fields = {f.name for f in dataclasses.fields(config_lib.TrainConfig)}
  assert fields <= module_flags
  assert train_flags.parse_config() == config_lib.DEFAULTS


def test_every_flag_shows_its_settings_help_and_takes_its_choices():
  """The flags are generated from the settings: a help text or a choice
  written on the field is what `--helpfull` shows and the flag accepts."""
  for field in dataclasses.fields(config_lib.TrainConfig):
    doc, flag = config_lib.doc(field), flags.FLAGS[field.name]
    assert flag.help.endswith(doc.help), field.name  # enums: "<a|b>: "
    assert getattr(flag.parser, "enum_values", None) == (
      None if doc.choices is None else list(doc.choices)), field.name


@pytest.mark.parametrize("path", sorted((ROOT / "flags").glob("*.flags")),
                         ids=lambda p: p.stem)
def test_the_library_reads_every_flagfile_as_the_flags_do(path):
  """`recipe.flagfiles.read_args` (the benchmarks' reader) and bin/train's
  flags turn each recipe, and overrides of every kind, into one config."""
  args = (f"--flagfile={path}", "--model_dir=unused", "--c=7",
          "--ci_hidden=5,3", "--noslow_on_first_step", "--pgd_betas=0.4,0.9",
          "--lr=2e-3", "--sites=")
  assert flagfiles.read_args(args) == train_flags.parse_config(*args)


def test_helpfull_lists_bin_train_s_own_flags_first_by_topic():
  groups = train_flags.help_groups()
  grouped = [name for _, names in groups for name in names]
  own = flags.FLAGS.get_flags_for_module(train_flags)
  assert sorted(grouped) == sorted(flag.name for flag in own)
  text = cli.grouped_help(groups)
  titles = [text.index(f"{title}:\n") for title, _ in groups]
  assert titles == sorted(titles) and titles[0] == 0
  others = text.index("absl.app:\n")
  for title, names in groups:
    start = text.index(f"{title}:\n")
    for name in names:
      shown = text.index(f"--{name}:") if f"--{name}:" in text else (
        text.index(f"--[no]{name}:"))
      assert start < shown < others, name
  # absl's own flags are still there, after.
  assert "--flagfile:" in text[others:]


def test_helpfull_of_any_binary_lists_decompax_s_flags_before_absl_s():
  values = flags.FlagValues()
  flags.DEFINE_integer("own_count", 1, "A binary's own.", flag_values=values,
                       module_name="decompax.bin.some_binary")
  flags.DEFINE_string("library_option", "", "A library's.",
                      flag_values=values, module_name="absl.app")
  flags.DEFINE_string("shared_option", "", "A decompax helper module's.",
                      flag_values=values,
                      module_name="decompax.bin.placement_flags")
  names = cli.project_flags(values)
  assert sorted(names) == ["own_count", "shared_option"]
  text = cli.grouped_help((("some_binary", names),), values)
  assert text.startswith("some_binary:\n")
  assert (text.index("--own_count:") < text.index("absl.app:\n")
          < text.index("--library_option:"))
