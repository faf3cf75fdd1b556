"""recipe/checks: the settings' checks run for every caller, not only for
bin/train's flags, and each setting is written once."""

import dataclasses

import pytest

from decompax.recipe import checks, terms
from decompax.recipe import config as config_lib
from decompax.recipe.config import DEFAULTS, TrainConfig
from decompax.recipe.flagfiles import read_args


def test_the_defaults_pass():
  checks.check(DEFAULTS)


@pytest.mark.parametrize("args,message", [
  (("--log_every=5", "--eval_every=7"),
   "--eval_every=7 must be a multiple of --log_every=5"),
  (("--select_at=100",), "--select_at=100 compares restart candidates"),
  (("--stochastic_coeff=0", "--per_site_coeff=0"), "no reconstruction term"),
  (("--c=0",), "--c must be positive, got 0"),
])
def test_read_args_refuses_what_bin_train_refuses(args, message):
  """A library caller (a benchmark, a notebook) gets bin/train's refusal,
  cross-field checks included, instead of a run that does nothing."""
  with pytest.raises(ValueError, match=message):
    read_args(args)


def test_a_config_built_in_code_is_checked_alike():
  bad = dataclasses.replace(DEFAULTS, restarts=2, select_at=0)
  with pytest.raises(ValueError, match="--restarts=2 needs --select_at"):
    checks.check(bad)


@pytest.mark.parametrize("arg,message", [
  ("--attention=bogus", "takes one of reference, xla, cudnn, auto"),
  ("--pgd_betas=0.5,nan", "'nan' is not a finite number"),
  ("--nonlinearity_weights=relu:inf", "'inf' is not a finite number"),
])
def test_read_args_takes_the_flags_choices_and_numbers(arg, message):
  with pytest.raises(ValueError, match=message):
    read_args([arg])


def test_every_setting_has_its_help_text():
  for field in dataclasses.fields(TrainConfig):
    doc = config_lib.doc(field)
    assert doc.help.strip(), field.name
    if doc.choices is not None:
      assert field.default in doc.choices, field.name


def test_every_term_s_coefficient_is_declared_non_negative():
  """A negative coefficient would ascend its term; the domain of each
  coefficient a term reads refuses one."""
  fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
  for term in terms.TERMS:
    domain = config_lib.doc(fields[term.coeff_flag]).domain
    assert (domain.low, domain.open_low) == (0, False), term.coeff_flag


def test_the_rider_help_names_every_term_that_takes_the_rider():
  fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
  help_text = config_lib.doc(fields["hidden_terms"]).help
  named = help_text.partition(":")[2].strip(" .").split(", ")
  assert named == list(terms.RIDER_TERMS)


@pytest.mark.parametrize("args,message", [
  (("--steps_per_call=-1",), "--steps_per_call must be >= 0, got -1"),
  (("--target=hf", "--model_dir=m", "--data_path=t.bin",
    "--steps_per_call=8"),
   "--steps_per_call=8: a run reading token files .* set "
   r"--steps_per_call=1 or 0 \(auto\)"),
])
def test_steps_per_call_is_refused_where_it_cannot_run(args, message):
  with pytest.raises(ValueError, match=message):
    read_args(args)


def test_steps_per_call_auto_is_one_step_a_call():
  """Auto is 1 on every platform (a TPU measured no faster at 64 and not
  bitwise, docs/performance.md); a set value is kept."""
  auto = config_lib.steps_per_call
  assert auto(DEFAULTS) == 1
  assert auto(dataclasses.replace(DEFAULTS, steps_per_call=3)) == 3
