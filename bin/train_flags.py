"""Flags of `bin/train`, defined once, and their frozen config record.

Library code never reads FLAGS: `config_from_flags` turns them into a
`TrainConfig` at the top of `main`, validating every value up front.
"""

import dataclasses

from absl import flags

_TARGET = flags.DEFINE_string(
  "target", "tms_5-2",
  "Toy target: tms_5-2, tms_5-2-id, tms_40-10, tms_40-10-id, resid_mlp1, "
  "resid_mlp2, resid_mlp3 or simple_mlp.")
_TARGET_SEED = flags.DEFINE_integer(
  "target_seed", None, "Seed of the target's own training (default: the "
  "target's known-good seed).")
_TARGET_PATH = flags.DEFINE_string(
  "target_path", None, "Cached trained target (.npz); trained and written "
  "there when absent. Default: <output_dir>/target.npz.")
_SITES = flags.DEFINE_list(
  "sites", [], "Sites to decompose, comma-separated (default: all).")
_C = flags.DEFINE_integer("c", 20, "Components per decomposed matrix.")
_CI_FN = flags.DEFINE_enum(
  "ci_fn", "component_mlp",
  ["component_mlp", "vector_mlp", "site_mlp", "global_mlp"],
  "Causal-importance function (SPEC §4.2).")
_CI_HIDDEN = flags.DEFINE_list(
  "ci_hidden", ["16"], "Hidden widths of the CI function (d_gate for "
  "component/vector MLPs).")
_FAITHFULNESS_COEFF = flags.DEFINE_float(
  "faithfulness_coeff", 1.0, "Coefficient of the faithfulness loss.")
_IMPORTANCE_COEFF = flags.DEFINE_float(
  "importance_coeff", 3e-3, "Coefficient of importance minimality.")
_P_START = flags.DEFINE_float(
  "p_start", 1.0, "Exponent p of importance minimality at step 0.")
_P_SCHEDULE = flags.DEFINE_enum(
  "p_schedule", "constant", ["constant", "linear", "cosine"],
  "Anneal of p (no warmup: the p-anneal refuses one).")
_P_FINAL_FRAC = flags.DEFINE_float(
  "p_final_frac", 1.0, "Final p as a fraction of --p_start.")
_IMPORTANCE_EPS = flags.DEFINE_float(
  "importance_eps", 1e-12, "ε inside the power of importance minimality.")
_FREQUENCY_COEFF = flags.DEFINE_float(
  "frequency_coeff", 0.0, "Coefficient of frequency minimality (0: off).")
_REFERENCE_TOKEN_COUNT = flags.DEFINE_float(
  "reference_token_count", None, "a' of frequency minimality (default: the "
  "batch's token count).")
_STOCHASTIC_COEFF = flags.DEFINE_float(
  "stochastic_coeff", 1.0, "Stochastic recon with all sites live (0: off).")
_STOCHASTIC_ROUTING = flags.DEFINE_enum(
  "stochastic_routing", "all", ["all", "uniform_k"],
  "Routing of the all-sites stochastic term.")
_PER_SITE_COEFF = flags.DEFINE_float(
  "per_site_coeff", 1.0, "Stochastic recon with one site live at a time "
  "(the SPD layerwise loss; 0: off).")
_SUBSET_COEFF = flags.DEFINE_float(
  "subset_coeff", 0.0, "Stochastic recon over consecutive site chunks (0: off).")
_SUBSET_SIZE = flags.DEFINE_integer(
  "subset_size", 2, "Sites per chunk of the subset term.")
_SUBSET_ROUTING = flags.DEFINE_enum(
  "subset_routing", "uniform_k", ["all", "uniform_k"],
  "Routing within each chunk of the subset term.")
_N_MASK_SAMPLES = flags.DEFINE_integer(
  "n_mask_samples", 1, "Stochastic draws per plan entry per step.")
_SAMPLING = flags.DEFINE_enum(
  "sampling", "continuous", ["continuous", "binomial"],
  "Stochastic source distribution.")
_USE_DELTA = flags.DEFINE_bool(
  "use_delta_component", False, "Add the maskable delta channel W − VU.")
_LR = flags.DEFINE_float("lr", 1e-3, "Peak learning rate of the components.")
_LR_SCHEDULE = flags.DEFINE_enum(
  "lr_schedule", "cosine", ["constant", "linear", "cosine"],
  "Learning-rate decay of both optimizers.")
_LR_FINAL_FRAC = flags.DEFINE_float(
  "lr_final_frac", 0.0, "Final learning rate as a fraction of the peak.")
_LR_WARMUP_PCT = flags.DEFINE_float(
  "lr_warmup_pct", 0.0, "Fraction of steps of linear learning-rate warmup.")
_WEIGHT_DECAY = flags.DEFINE_float(
  "weight_decay", 0.0, "AdamW weight decay of components and CI function.")
_CLIP_MAX_NORM = flags.DEFINE_float(
  "clip_max_norm", 0.0, "Global-norm clip of component gradients (0: off).")
_CI_LR = flags.DEFINE_float(
  "ci_lr", None, "Peak learning rate of the CI function (default: --lr).")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 40_000, "Training steps.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 4096, "Batch size.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of init, masks and data.")
_WARMUP_STEPS = flags.DEFINE_integer(
  "faithfulness_warmup_steps", 200, "Faithfulness-only AdamW steps first.")
_WARMUP_LR = flags.DEFINE_float(
  "faithfulness_warmup_lr", 0.01, "Learning rate of the warmup.")
_WARMUP_WD = flags.DEFINE_float(
  "faithfulness_warmup_weight_decay", 0.1, "Weight decay of the warmup.")
_OUTPUT_DIR = flags.DEFINE_string(
  "output_dir", None, "Run directory (default: runs/<target>). Its parent "
  "must exist.")
_OVERWRITE = flags.DEFINE_bool(
  "overwrite", False, "Replace a run in --output_dir made with other flags.")
_LOG_EVERY = flags.DEFINE_integer(
  "log_every", 500, "Steps between progress lines and metrics records.")
_FIGURES_EVERY = flags.DEFINE_integer(
  "figures_every", 0, "Steps between figure refreshes (0: at the end only).")
_CI_ALIVE_THRESHOLD = flags.DEFINE_float(
  "ci_alive_threshold", 0.0, "CI above which a component counts in CI-L0.")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Every setting of one decomposition run, validated."""

  target: str
  target_seed: int | None
  target_path: str | None
  sites: tuple[str, ...]
  c: int
  ci_fn: str
  ci_hidden: tuple[int, ...]
  faithfulness_coeff: float
  importance_coeff: float
  p_start: float
  p_schedule: str
  p_final_frac: float
  importance_eps: float
  frequency_coeff: float
  reference_token_count: float | None
  stochastic_coeff: float
  stochastic_routing: str
  per_site_coeff: float
  subset_coeff: float
  subset_size: int
  subset_routing: str
  n_mask_samples: int
  sampling: str
  use_delta_component: bool
  lr: float
  lr_schedule: str
  lr_final_frac: float
  lr_warmup_pct: float
  weight_decay: float
  clip_max_norm: float
  ci_lr: float | None
  num_steps: int
  batch_size: int
  seed: int
  faithfulness_warmup_steps: int
  faithfulness_warmup_lr: float
  faithfulness_warmup_weight_decay: float
  output_dir: str | None
  overwrite: bool
  log_every: int
  figures_every: int
  ci_alive_threshold: float


def _positive(name: str, value: int | float) -> None:
  if value <= 0:
    raise ValueError(f"--{name} must be positive, got {value}")


def _non_negative(name: str, value: int | float) -> None:
  if value < 0:
    raise ValueError(f"--{name} must be >= 0, got {value}")


def _parse_widths(values: list[str]) -> tuple[int, ...]:
  try:
    return tuple(int(v) for v in values)
  except ValueError:
    raise ValueError(
      f"--ci_hidden must be comma-separated integers, got {','.join(values)}"
    ) from None


def config_from_flags() -> TrainConfig:
  """Return the validated config of the parsed flags."""
  config = TrainConfig(
    target=_TARGET.value,
    target_seed=_TARGET_SEED.value,
    target_path=_TARGET_PATH.value,
    sites=tuple(_SITES.value),
    c=_C.value,
    ci_fn=_CI_FN.value,
    ci_hidden=_parse_widths(_CI_HIDDEN.value),
    faithfulness_coeff=_FAITHFULNESS_COEFF.value,
    importance_coeff=_IMPORTANCE_COEFF.value,
    p_start=_P_START.value,
    p_schedule=_P_SCHEDULE.value,
    p_final_frac=_P_FINAL_FRAC.value,
    importance_eps=_IMPORTANCE_EPS.value,
    frequency_coeff=_FREQUENCY_COEFF.value,
    reference_token_count=_REFERENCE_TOKEN_COUNT.value,
    stochastic_coeff=_STOCHASTIC_COEFF.value,
    stochastic_routing=_STOCHASTIC_ROUTING.value,
    per_site_coeff=_PER_SITE_COEFF.value,
    subset_coeff=_SUBSET_COEFF.value,
    subset_size=_SUBSET_SIZE.value,
    subset_routing=_SUBSET_ROUTING.value,
    n_mask_samples=_N_MASK_SAMPLES.value,
    sampling=_SAMPLING.value,
    use_delta_component=_USE_DELTA.value,
    lr=_LR.value,
    lr_schedule=_LR_SCHEDULE.value,
    lr_final_frac=_LR_FINAL_FRAC.value,
    lr_warmup_pct=_LR_WARMUP_PCT.value,
    weight_decay=_WEIGHT_DECAY.value,
    clip_max_norm=_CLIP_MAX_NORM.value,
    ci_lr=_CI_LR.value,
    num_steps=_NUM_STEPS.value,
    batch_size=_BATCH_SIZE.value,
    seed=_SEED.value,
    faithfulness_warmup_steps=_WARMUP_STEPS.value,
    faithfulness_warmup_lr=_WARMUP_LR.value,
    faithfulness_warmup_weight_decay=_WARMUP_WD.value,
    output_dir=_OUTPUT_DIR.value,
    overwrite=_OVERWRITE.value,
    log_every=_LOG_EVERY.value,
    figures_every=_FIGURES_EVERY.value,
    ci_alive_threshold=_CI_ALIVE_THRESHOLD.value,
  )
  validate(config)
  return config


def validate(config: TrainConfig) -> None:
  """Raise ValueError naming the first invalid setting and its fix."""
  if config.c <= 0:
    raise ValueError(f"--c must be a positive number of components, got {config.c}")
  for name in ("num_steps", "batch_size", "log_every", "n_mask_samples",
               "subset_size", "lr"):
    _positive(name, getattr(config, name))
  for name in ("faithfulness_coeff", "importance_coeff", "frequency_coeff",
               "stochastic_coeff", "per_site_coeff", "subset_coeff",
               "weight_decay", "clip_max_norm", "faithfulness_warmup_steps",
               "figures_every", "importance_eps"):
    _non_negative(name, getattr(config, name))
  if config.ci_lr is not None:
    _positive("ci_lr", config.ci_lr)
  if config.reference_token_count is not None:
    _positive("reference_token_count", config.reference_token_count)
  if not 0.0 <= config.lr_warmup_pct < 1.0:
    raise ValueError(f"--lr_warmup_pct must lie in [0, 1), got {config.lr_warmup_pct}")
  if config.lr_schedule == "constant" and config.lr_final_frac not in (0.0, 1.0):
    raise ValueError("--lr_final_frac has no effect with --lr_schedule=constant;"
                     " drop it or choose linear|cosine")
  if config.p_schedule == "constant" and config.p_final_frac != 1.0:
    raise ValueError("--p_final_frac needs --p_schedule=linear|cosine")
  if not (config.stochastic_coeff or config.per_site_coeff or config.subset_coeff):
    raise ValueError("no reconstruction term: set --stochastic_coeff, "
                     "--per_site_coeff or --subset_coeff above 0")
  if len(set(config.sites)) != len(config.sites):
    raise ValueError(f"--sites lists a site twice: {','.join(config.sites)}")
