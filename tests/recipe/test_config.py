"""recipe/config: each setting's declared domain is checked on every config
built (reading recipes: tests/recipe/test_flagfiles.py)."""

import dataclasses
import math
import typing

import pytest

from decompax.recipe import config as config_lib
from decompax.recipe.config import DEFAULTS, TrainConfig
from decompax.recipe.flagfiles import read_args


def test_a_setting_names_the_field_a_library_refused():
  with pytest.raises(config_lib.SettingError) as info:
    with config_lib.setting("lr_warmup_pct"):
      raise ValueError("warmup_pct must lie in [0, 1), got 1.0")
  assert str(info.value) == (
    "--lr_warmup_pct: warmup_pct must lie in [0, 1), got 1.0")
  # An error that names its setting already passes unchanged.
  with pytest.raises(config_lib.SettingError) as info:
    with config_lib.setting("p_start"), config_lib.setting("p_final_frac"):
      raise ValueError("why")
  assert str(info.value) == "--p_final_frac: why"


FIELDS = dataclasses.fields(TrainConfig)
# Number settings that take any finite value: their limits join other
# settings (`p_start` must be positive only under the lp penalty).
UNBOUNDED_NUMBERS = {"p_start"}


def _number_kind(field: dataclasses.Field) -> type | None:
  """Return int or float for a number setting (or a list of numbers)."""
  kind = typing.get_type_hints(TrainConfig)[field.name]
  args = [a for a in typing.get_args(kind) if a not in (type(None), ...)]
  kind = args[0] if typing.get_origin(kind) else kind
  return kind if kind in (int, float) else None


def _outside(field: dataclasses.Field) -> list:
  """Return values of the field's type outside its declared domain."""
  domain = config_lib.doc(field).domain
  listed = isinstance(field.default, tuple)
  values = []
  if domain.choices is not None:
    values.append("none_of_them")
  if not domain.empty:
    values.append(() if listed else " ")
  if domain.numbers:
    values.append(("relu:x",) if domain.numbers == "keyed" else ("x",))
  if kind := _number_kind(field):
    step = 1 if kind is int else 0.5
    if domain.low is not None:
      values.append(kind(domain.low if domain.open_low
                         else domain.low - step))
    if domain.high is not None:
      values.append(kind(domain.high if domain.open_high
                         else domain.high + step))
    if kind is float:
      values.append(math.nan)
  return [(v,) if listed and not isinstance(v, tuple) else v for v in values]


def test_every_setting_declares_its_domain():
  for field in FIELDS:
    assert isinstance(config_lib.doc(field).domain, config_lib.Domain), (
      field.name)


def test_every_number_setting_has_a_bound_or_is_known_to_take_any():
  for field in FIELDS:
    domain = config_lib.doc(field).domain
    if _number_kind(field) and field.name not in UNBOUNDED_NUMBERS:
      assert (domain.low, domain.high) != (None, None), field.name


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_no_config_is_built_with_a_setting_outside_its_domain(field):
  """Plain construction and `dataclasses.replace` alike: every path that
  builds a config runs the check."""
  for value in _outside(field):
    for build in (lambda: TrainConfig(**{field.name: value}),
                  lambda: dataclasses.replace(DEFAULTS,
                                              **{field.name: value})):
      with pytest.raises(config_lib.SettingError) as info:
        build()
      assert str(info.value).startswith(f"--{field.name}"), str(info.value)
      assert "\n" not in str(info.value)


def test_the_domain_s_edges_are_kept_and_their_refusals_say_the_fix():
  edge = dataclasses.replace(DEFAULTS, ci_alive_threshold=0.0,
                             max_skipped_share=1.0, lr_warmup_pct=0.0,
                             seed=2**32 - 1, merged_adv_fraction=1.0)
  assert edge.seed == 2**32 - 1
  for changes, message in [
    ({"pgd_lr": -0.5}, "--pgd_lr must be positive, got -0.5"),
    ({"eval_pgd_steps": -1}, "--eval_pgd_steps must be >= 0, got -1"),
    ({"seed": 2**32}, "--seed must lie in [0, 2**32), got 4294967296"),
    ({"ci_alive_threshold": 1.0},
     "--ci_alive_threshold must lie in [0, 1), the range of CI, got 1.0"),
    ({"max_skipped_share": 0.0}, "--max_skipped_share must lie in (0, 1]"),
    ({"ci_hidden": (4, 0)}, "--ci_hidden entries must be positive, got (4, 0)"),
    ({"lr": math.inf}, "--lr must be finite, got inf"),
    ({"attention": "x"}, "--attention='x' takes one of reference, xla, "),
    ({"output_dir": ""}, "--output_dir='' names no directory"),
  ]:
    with pytest.raises(config_lib.SettingError) as info:
      dataclasses.replace(DEFAULTS, **changes)
    assert str(info.value).startswith(message), str(info.value)


def test_a_negative_pgd_lr_is_refused_by_the_reader():
  with pytest.raises(ValueError, match="--pgd_lr must be positive"):
    read_args(["--pgd_lr=-0.5", "--pgd_coeff=1"])


def test_the_topics_hold_every_setting_once():
  listed = [name for _, names in config_lib.TOPICS for name in names]
  assert sorted(listed) == sorted(f.name for f in FIELDS)
