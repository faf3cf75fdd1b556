"""The settings of one decomposition run: `TrainConfig`, and reading them.

`TrainConfig` holds every setting of a run, each field named as the
`bin/train` flag that sets it and defaulting to that flag's default (the
flags take their defaults from here). A recipe is a flagfile: one
`--name=value` per line, `#` comments; `read_args` turns flagfiles and
overrides into a config without absl, for the benchmarks and any library
caller, while `bin/train` parses the same text with its flags. Neither
validates combinations here: the flags check theirs
(`bin/train_flags.validate`), and each library config built from these
values checks itself in its constructor; `setting` names the field of a
value such a constructor refused, as `--name: why`.
"""

import contextlib
import dataclasses
import functools
import math
import types
import typing
from collections.abc import Iterator, Sequence


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Every setting of one decomposition run (see the module docstring)."""

  target: str = "tms_5-2"
  target_seed: int | None = None
  target_path: str | None = None
  model_dir: str | None = None
  seq_len: int = 64
  data_path: str | None = None
  eval_data_path: str | None = None
  attention: str = "reference"
  compute_dtype: str = "bfloat16"
  sites: tuple[str, ...] = ()
  c: int = 20
  ci_fn: str = "component_mlp"
  ci_hidden: tuple[int, ...] = (16,)
  ci_d_model: int = 64
  ci_n_blocks: int = 2
  ci_n_heads: int = 4
  ci_n_kv_heads: int | None = None
  ci_d_mlp: int = 256
  ci_attention: str = "reference"
  ci_remat: bool = False
  faithfulness_coeff: float = 1.0
  faithfulness_form: str = "global"
  importance_coeff: float = 0.003
  p_start: float = 1.0
  p_schedule: str = "constant"
  p_final_frac: float = 1.0
  p_knots: str = ""
  importance_penalty: str = "lp"
  smooth_l0_gamma: float = 1.0
  smooth_l0_gamma_schedule: str = "linear"
  smooth_l0_gamma_final_frac: float = 0.01
  smooth_l0_normalized: bool = False
  importance_eps: float = 1e-12
  frequency_coeff: float = 0.0
  reference_token_count: float | None = None
  stochastic_coeff: float = 1.0
  stochastic_routing: str = "all"
  per_site_coeff: float = 1.0
  subset_coeff: float = 0.0
  subset_size: int = 2
  subset_routing: str = "uniform_k"
  n_mask_samples: int = 1
  sampling: str = "continuous"
  use_delta_component: bool = False
  lr: float = 0.001
  lr_schedule: str = "cosine"
  lr_final_frac: float = 0.0
  lr_warmup_pct: float = 0.0
  lr_knots: str = ""
  route_probability: float = 0.5
  weight_decay: float = 0.0
  clip_max_norm: float = 0.0
  ci_lr: float | None = None
  num_steps: int = 40000
  batch_size: int = 4096
  seed: int = 2
  eval_seed: int | None = None
  restarts: int = 1
  select_at: int = 0
  faithfulness_warmup_steps: int = 0
  faithfulness_warmup_lr: float = 0.01
  faithfulness_warmup_weight_decay: float = 0.1
  output_dir: str | None = None
  overwrite: bool = False
  log_every: int = 500
  figures_every: int = 0
  ci_alive_threshold: float = 0.1
  eval_every: int = 1000
  slow_eval_every: int = 10000
  figure_cpu_share: float = 0.05
  eval_batches: int = 4
  slow_on_first_step: bool = True
  eval_pgd_steps: int = 20
  eval_pgd_lr: float = 0.1
  eval_attention_kl: bool = False
  groups_coeff: float = 0.0
  recon_groups: str = ""
  groups_routing: str = "uniform_k"
  ema_halflife_steps: float = 0.0
  pgd_coeff: float = 0.0
  pgd_plan: str = "all_sites"
  pgd_routing: str = "all"
  pgd_scope: str = "c"
  pgd_parametrization: str = "clamp"
  pgd_step_rule: str = "adam"
  pgd_lr: float = 0.01
  pgd_lr_warmup_pct: float = 0.0
  pgd_betas: tuple[str, ...] = ("0.5", "0.99")
  pgd_eps: float = 1e-08
  pgd_n_warmup: int = 0
  pgd_objective: str = "e2e"
  pgd_start_frac: float = 0.0
  merged_coeff: float = 0.0
  merged_plan: str = "all_sites"
  merged_routing: str = "uniform_k"
  merged_adv_fraction: float = 0.5
  merged_adv_fraction_final_frac: float = 1.0
  hidden_coeff: float = 0.0
  hidden_points: tuple[str, ...] = ()
  hidden_terms: tuple[str, ...] = ()
  fresh_pgd_coeff: float = 0.0
  fresh_pgd_init: str = "random"
  fresh_pgd_scope: str = "c"
  fresh_pgd_steps: int = 1
  fresh_pgd_step_size: float = 0.1
  fresh_pgd_routing: str = "all"
  nonlinearity_coeff: float = 0.0
  nonlinearity_threshold: float = 1.0
  nonlinearity_threshold_final_frac: float = 1.0
  nonlinearity_weights: tuple[str, ...] = ()
  components_optimizer: str = "adamw"
  components_init: str = "normal"
  checkpointing: str = "periodic"
  save_every: int = 1000
  stop_after_step: int = 0
  keep_last: int = 3
  keep_all: bool = False
  on_nonfinite: str = "stop"
  max_skipped_in_a_row: int = 100
  max_skipped_share: float = 0.1
  init_from: str | None = None
  profile_steps: str = ""
  target_task: str = ""
  target_data_path: str | None = None
  target_batch_size: int = 0
  target_seq_len: int = 0
  target_loss_positions: str = "answer"
  nontarget_task: str = ""
  nontarget_data_path: str | None = None
  nontarget_batch_size: int = 0
  nontarget_seq_len: int = 0
  nontarget_recon_coeff: float = 0.0
  nontarget_sources: str = "stochastic"
  nontarget_unmasked_coeff: float = 0.0
  nontarget_importance_coeff: float = 0.0
  nontarget_pgd_coeff: float = 0.0
  nontarget_merged_coeff: float = 0.0
  ci_scaled_decay: float = 0.0
  ci_roles: tuple[str, ...] = ("output",)
  hidden_pass_points: tuple[str, ...] = ()
  hidden_pass_coeff: float = 1.0
  sequential_passes: bool = False
  ab_grid: str = "auto"


DEFAULTS = TrainConfig()


class SettingError(ValueError):
  """A refused setting; the one-line message starts with `--<field>:`."""


@contextlib.contextmanager
def setting(name: str):
  """Re-raise a library config's ValueError as a SettingError naming the
  `TrainConfig` field `name` (its `bin/train` flag) whose value it refused.
  An error that already names its setting passes unchanged."""
  try:
    yield
  except SettingError:
    raise
  except ValueError as e:
    raise SettingError(f"--{name}: {e}") from None


_TRUE, _FALSE = ("true", "t", "1"), ("false", "f", "0")


@functools.cache
def _types() -> dict[str, typing.Any]:
  return typing.get_type_hints(TrainConfig)


def _flagfile_args(path: str) -> list[str]:
  with open(path) as f:
    lines = [line.strip() for line in f]
  return [line for line in lines
          if line and not line.startswith(("#", "//"))]


def _expand(args: Sequence[str], depth: int = 0) -> Iterator[str]:
  """Yield `args` with each `--flagfile=PATH` replaced by PATH's lines."""
  if depth > 20:
    raise ValueError("flagfiles nest more than 20 deep")
  for arg in args:
    name, sep, value = arg.removeprefix("--").partition("=")
    if arg.startswith("--") and name == "flagfile" and sep:
      yield from _expand(_flagfile_args(value), depth + 1)
    else:
      yield arg


def _convert(kind: typing.Any, text: str) -> typing.Any:
  """Return `text` as a value of the field type `kind`; an empty value of
  an optional field is None, as a run's `flags.txt` writes unset ones."""
  if typing.get_origin(kind) in (typing.Union, types.UnionType):
    if text == "" and type(None) in typing.get_args(kind):
      return None
    kind = next(a for a in typing.get_args(kind) if a is not type(None))
  if typing.get_origin(kind) is tuple:
    item = typing.get_args(kind)[0]
    return tuple(_convert(item, p.strip()) for p in text.split(",")
                 if p.strip())
  if kind is bool:
    if text.lower() not in _TRUE + _FALSE:
      raise ValueError(f"{text!r} is not a boolean")
    return text.lower() in _TRUE
  value = kind(text)
  if kind is float and not math.isfinite(value):
    raise ValueError(f"{text!r} is not a finite number")
  return value


def _setting(arg: str) -> tuple[str, typing.Any]:
  """Return the field and value one `--name=value` argument sets."""
  name, sep, text = arg.removeprefix("--").partition("=")
  fields = _types()
  if not sep and name.startswith("no") and fields.get(name[2:]) is bool:
    return name[2:], False
  if not arg.startswith("--") or name not in fields:
    raise ValueError(f"{arg!r} sets no setting of a run")
  if not sep:
    if fields[name] is not bool:
      raise ValueError(f"{arg!r} needs a value, --{name}=value")
    return name, True
  try:
    return name, _convert(fields[name], text)
  except ValueError as e:
    raise ValueError(f"{arg!r}: {e}") from None


def read_args(args: Sequence[str],
              config: TrainConfig = DEFAULTS) -> TrainConfig:
  """Return `config` with the settings of `--name=value` arguments.

  `--flagfile=PATH` stands for PATH's lines (nested flagfiles too, paths
  relative to the working directory); later settings override earlier
  ones, as on `bin/train`'s command line. Raises ValueError naming an
  argument that sets no field or whose value does not convert.
  """
  return dataclasses.replace(config, **dict(map(_setting, _expand(args))))


def held_out_seed(config: TrainConfig) -> int:
  """Return the seed of the run's held-out batches: `eval_seed`, else
  `seed`. Runs that differ only in `seed` score on the same batches when
  they share an `eval_seed`."""
  return config.seed if config.eval_seed is None else config.eval_seed
