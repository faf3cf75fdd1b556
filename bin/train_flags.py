"""Flags of `bin/train`, defined once, and their frozen config record.

Library code never reads FLAGS: `config_from_flags` turns them into a
`TrainConfig` at the top of `main`, validating every value up front.
"""

import dataclasses
import functools
import math

from absl import flags

from decompax.bin import checkpointing, cli, run_records, term_table


# Every float flag of bin/train refuses NaN and infinity.
_define_float = functools.partial(cli.define_float, module_name=__name__)


class _NumbersListParser(flags.ListParser):
  """Comma-separated list parser whose numbers must be finite: each entry,
  or with `keyed` the weight of each `kind:weight` entry (`kind:none` and
  entries without a colon are left to the flag's reader)."""

  def __init__(self, keyed: bool = False) -> None:
    super().__init__()
    self.keyed = keyed

  def parse(self, argument: str | list[str]) -> list[str]:
    items = super().parse(argument)
    for item in items:
      number = item.partition(":")[2] if self.keyed else item
      if self.keyed and number in ("", "none"):
        continue
      try:
        finite = math.isfinite(float(number))
      except ValueError:
        finite = False
      if not finite:
        raise ValueError(f"{number!r} is not a finite number")
    return items


def _define_numbers(name: str, default: list[str], help_text: str,
                    keyed: bool = False):
  return flags.DEFINE(_NumbersListParser(keyed), name, default, help_text,
                      serializer=flags.CsvListSerializer(","))


_TARGET = flags.DEFINE_string(
  "target", "tms_5-2",
  "Toy target: tms_5-2, tms_5-2-id, tms_40-10, tms_40-10-id, resid_mlp1, "
  "resid_mlp2, resid_mlp3, simple_mlp or induction; or hf, a language "
  "model read from --model_dir.")
_TARGET_SEED = flags.DEFINE_integer(
  "target_seed", None, "Seed of the target's own training (default: the "
  "target's known-good seed).")
_TARGET_PATH = flags.DEFINE_string(
  "target_path", None, "Cached trained target (.npz); trained and written "
  "there when absent. Default: <output_dir>/target.npz.")
_MODEL_DIR = flags.DEFINE_string(
  "model_dir", None, "--target=hf: local Hugging Face checkpoint directory "
  "(config.json and safetensors).")
_SEQ_LEN = flags.DEFINE_integer(
  "seq_len", 64, "Tokens per sequence of a --target=hf batch.")
_DATA_PATH = flags.DEFINE_string(
  "data_path", None, "--target=hf: token file (NAME.bin from bin/tokenize) "
  "the training batches are read from; default: uniform random token ids.")
_EVAL_DATA_PATH = flags.DEFINE_string(
  "eval_data_path", None, "--target=hf: held-out token file of the eval "
  "batches; default: windows of --data_path on a stream of their own (not "
  "held-out text).")
_ATTENTION = flags.DEFINE_enum(
  "attention", "reference", ["reference", "xla", "cudnn", "auto"],
  "Attention of LM targets: plain einsums, or jax.nn.dot_product_attention "
  "with implementation xla, cudnn or JAX's choice (auto).")
_COMPUTE_DTYPE = flags.DEFINE_enum(
  "compute_dtype", "bfloat16", ["bfloat16", "float32"],
  "Dtype of --target=hf frozen weights and activations (SPEC N4).")
_SITES = flags.DEFINE_list(
  "sites", [], "Sites to decompose, comma-separated (default: all); "
  "--target=hf also takes shell patterns, e.g. 'layers.18.mlp.*'.")
_C = flags.DEFINE_integer("c", 20, "Components per decomposed matrix.")
_CI_FN = flags.DEFINE_enum(
  "ci_fn", "component_mlp",
  ["component_mlp", "vector_mlp", "site_mlp", "global_mlp", "transformer"],
  "Causal-importance function: the toy MLPs of SPEC §4.2 or the chunkwise "
  "transformer of §4.3 (LMs: one chunk per decomposed block reading "
  "resid.<block>; toys: one chunk per site reading its input).")
_CI_D_MODEL = flags.DEFINE_integer(
  "ci_d_model", 64, "Transformer CI: width of each chunk's transformer.")
_CI_N_BLOCKS = flags.DEFINE_integer(
  "ci_n_blocks", 2, "Transformer CI: blocks per chunk (0 allowed).")
_CI_N_HEADS = flags.DEFINE_integer(
  "ci_n_heads", 4, "Transformer CI: attention heads (head dim must be even).")
_CI_N_KV_HEADS = flags.DEFINE_integer(
  "ci_n_kv_heads", None, "Transformer CI: key/value heads (default: "
  "--ci_n_heads, i.e. multi-head attention).")
_CI_D_MLP = flags.DEFINE_integer(
  "ci_d_mlp", 256, "Transformer CI: MLP width of each block.")
_CI_ATTENTION = flags.DEFINE_enum(
  "ci_attention", "reference", ["reference", "xla", "cudnn", "auto"],
  "Transformer CI attention: the portable einsum reference, or "
  "jax.nn.dot_product_attention with that implementation (auto: JAX picks).")
_CI_REMAT = flags.DEFINE_bool(
  "ci_remat", False, "Transformer CI: recompute every block activation in "
  "the backward pass instead of keeping the matmul outputs.")
_CI_HIDDEN = flags.DEFINE_list(
  "ci_hidden", ["16"], "Hidden widths of the CI function (d_gate for "
  "component/vector MLPs).")
_FAITHFULNESS_COEFF = _define_float(
  "faithfulness_coeff", 1.0, "Coefficient of the faithfulness loss.")
_IMPORTANCE_COEFF = _define_float(
  "importance_coeff", 3e-3, "Coefficient of importance minimality.")
_P_START = _define_float(
  "p_start", 1.0, "Exponent p of importance minimality at step 0.")
_P_SCHEDULE = flags.DEFINE_enum(
  "p_schedule", "constant", ["constant", "linear", "cosine"],
  "Anneal of p (no warmup: the p-anneal refuses one).")
_P_FINAL_FRAC = _define_float(
  "p_final_frac", 1.0, "Final p as a fraction of --p_start.")
_IMPORTANCE_EPS = _define_float(
  "importance_eps", 1e-12, "ε inside the power of importance minimality.")
_FREQUENCY_COEFF = _define_float(
  "frequency_coeff", 0.0, "Coefficient of frequency minimality (0: off).")
_REFERENCE_TOKEN_COUNT = _define_float(
  "reference_token_count", None, "a' of frequency minimality (default: the "
  "batch's token count).")
_STOCHASTIC_COEFF = _define_float(
  "stochastic_coeff", 1.0, "Stochastic recon with all sites live (0: off).")
_STOCHASTIC_ROUTING = flags.DEFINE_enum(
  "stochastic_routing", "all", ["all", "uniform_k"],
  "Routing of the all-sites stochastic term.")
_PER_SITE_COEFF = _define_float(
  "per_site_coeff", 1.0, "Stochastic recon with one site live at a time "
  "(the SPD layerwise loss; 0: off).")
_SUBSET_COEFF = _define_float(
  "subset_coeff", 0.0, "Stochastic recon over consecutive site chunks "
  "(0: off).")
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
_LR = _define_float("lr", 1e-3, "Peak learning rate of the components.")
_LR_SCHEDULE = flags.DEFINE_enum(
  "lr_schedule", "cosine", ["constant", "linear", "cosine"],
  "Learning-rate decay of both optimizers.")
_LR_FINAL_FRAC = _define_float(
  "lr_final_frac", 0.0, "Final learning rate as a fraction of the peak.")
_LR_WARMUP_PCT = _define_float(
  "lr_warmup_pct", 0.0, "Fraction of steps of linear learning-rate warmup.")
_WEIGHT_DECAY = _define_float(
  "weight_decay", 0.0, "AdamW weight decay of components and CI function.")
_CLIP_MAX_NORM = _define_float(
  "clip_max_norm", 0.0, "Global-norm clip of component gradients (0: off).")
_CI_LR = _define_float(
  "ci_lr", None, "Peak learning rate of the CI function (default: --lr).")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 40_000, "Training steps.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 4096, "Batch size.")
_SEED = flags.DEFINE_integer(
  "seed", 2, "Seed of init, masks and data (default 2: with it the default "
  "TMS 5-2 run recovers the paper's result; see the README).")
_WARMUP_STEPS = flags.DEFINE_integer(
  "faithfulness_warmup_steps", 0, "Faithfulness-only AdamW steps first (the "
  "SPD paper's recipes take none).")
_WARMUP_LR = _define_float(
  "faithfulness_warmup_lr", 0.01, "Learning rate of the warmup.")
_WARMUP_WD = _define_float(
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
_CI_ALIVE_THRESHOLD = _define_float(
  "ci_alive_threshold", 0.1, "CI above which a component counts in CI-L0.")
_EVAL_EVERY = flags.DEFINE_integer(
  "eval_every", 1000, "Steps between fast evals on held-out batches (CI-L0, "
  "alive counts, masked recon family, loss terms); a multiple of "
  "--log_every; also at the last step, and at step 0 of a fresh run (0: "
  "no eval).")
_SLOW_EVAL_EVERY = flags.DEFINE_integer(
  "slow_eval_every", 10000, "Steps between slow evals (CI histograms and "
  "densities, hidden-activation recon, figures, report); a multiple of "
  "--eval_every; also at the last step (0: none).")
_FIGURE_CPU_SHARE = _define_float(
  "figure_cpu_share", 0.05, "Most of one CPU core that drawing the slow "
  "evals' figures may take over a run; at a shorter cadence some slow evals "
  "are not drawn, the last one always is (1: draw each as soon as the last "
  "is done).")
_EVAL_BATCHES = flags.DEFINE_integer(
  "eval_batches", 4, "Held-out batches of --batch_size per eval.")
_SLOW_ON_FIRST_STEP = flags.DEFINE_bool(
  "slow_on_first_step", True, "Run the slow eval at step 0 of a fresh run.")
_EVAL_PGD_STEPS = flags.DEFINE_integer(
  "eval_pgd_steps", 20, "Sign-PGD ascents of the fast eval's fresh-PGD probe "
  "(eval/recon/pgd: every site routed, random sources per site; 0: off).")
_EVAL_PGD_LR = _define_float(
  "eval_pgd_lr", 0.1, "Step size of the eval's fresh-PGD probe.")


_GROUPS_COEFF = _define_float(
  "groups_coeff", 0.0, "Stochastic recon over --recon_groups (0: off).")
_RECON_GROUPS = flags.DEFINE_string(
  "recon_groups", "", "Site groups for plans of kind `groups`: sites joined "
  "by '+', groups by ';' (e.g. 'linear1+linear2;linear2').")
_GROUPS_ROUTING = flags.DEFINE_enum(
  "groups_routing", "uniform_k", ["all", "uniform_k"],
  "Routing within each group of the groups term.")
_EMA_HALFLIFE = _define_float(
  "ema_halflife_steps", 0.0, "Half-life (steps) of the running firing "
  "estimate of frequency minimality (0: per-batch estimate).")
_PGD_COEFF = _define_float(
  "pgd_coeff", 0.0, "Persistent PGD recon term (0: off).")
_PGD_PLAN = flags.DEFINE_enum(
  "pgd_plan", "all_sites", ["all_sites", "per_site", "subset", "groups"],
  "Plan of the persistent PGD term.")
_PGD_ROUTING = flags.DEFINE_enum(
  "pgd_routing", "all", ["all", "uniform_k"], "Routing of the PGD plan.")
_PGD_SCOPE = flags.DEFINE_enum(
  "pgd_scope", "c", ["c", "bc", "sc", "bsc"], "Axes a persistent source "
  "keeps: c (shared over batch), bc (per example); sc/bsc need positions.")
_PGD_PARAMETRIZATION = flags.DEFINE_enum(
  "pgd_parametrization", "clamp", ["clamp", "sigmoid"],
  "Persistent source storage: clamped to [0,1] or raw through a sigmoid.")
_PGD_STEP_RULE = flags.DEFINE_enum(
  "pgd_step_rule", "adam", ["adam", "sign"], "Persistent source ascent rule.")
_PGD_LR = _define_float("pgd_lr", 0.01, "Persistent source step size.")
_PGD_LR_WARMUP_PCT = _define_float(
  "pgd_lr_warmup_pct", 0.0, "Fraction of steps of source LR warmup.")
_PGD_BETAS = _define_numbers(
  "pgd_betas", ["0.5", "0.99"], "Source Adam betas b1,b2.")
_PGD_EPS = _define_float("pgd_eps", 1e-8, "Source Adam eps (after the root).")
_PGD_N_WARMUP = flags.DEFINE_integer(
  "pgd_n_warmup", 0, "Supplemental all-site ascents per step.")
_PGD_OBJECTIVE = flags.DEFINE_enum(
  "pgd_objective", "e2e", ["e2e", "term"], "What the adversary ascends.")
_PGD_START_FRAC = _define_float(
  "pgd_start_frac", 0.0, "Fraction of steps before the PGD term starts.")
_MERGED_COEFF = _define_float(
  "merged_coeff", 0.0, "Merged stochastic/persistent recon term (SPEC "
  "§5.8; 0: off). Its sources step with the --pgd_* settings.")
_MERGED_PLAN = flags.DEFINE_enum(
  "merged_plan", "all_sites", ["all_sites", "per_site", "subset", "groups"],
  "Plan of the merged term.")
_MERGED_ROUTING = flags.DEFINE_enum(
  "merged_routing", "uniform_k", ["all", "uniform_k"],
  "Routing of the merged term's stochastic rows.")
_MERGED_ADV_FRACTION = _define_float(
  "merged_adv_fraction", 0.5, "Probability that a batch row of the merged "
  "term uses the persistent sources, at step 0.")
_MERGED_ADV_FRACTION_FINAL = _define_float(
  "merged_adv_fraction_final_frac", 1.0, "Final adversarial fraction as a "
  "fraction of the first (linear anneal when ≠ 1).")
_HIDDEN_COEFF = _define_float(
  "hidden_coeff", 0.0, "Hidden-activation reconstruction rider (SPEC §5.9) "
  "on the --hidden_terms (0: off).")
_HIDDEN_POINTS = flags.DEFINE_list(
  "hidden_points", [], "Activations the rider matches (tap keys; default: "
  "every decomposed site's output, <site>.out).")
_HIDDEN_TERMS = flags.DEFINE_list(
  "hidden_terms", [], "Recon terms the rider rides on: "
  f"{', '.join(term_table.RIDER_TERMS)}.")
_FRESH_COEFF = _define_float(
  "fresh_pgd_coeff", 0.0, "Fresh (per-step) PGD recon term (0: off).")
_FRESH_INIT = flags.DEFINE_enum(
  "fresh_pgd_init", "random", ["random", "ones", "zeroes"],
  "Initial fresh PGD sources.")
_FRESH_SCOPE = flags.DEFINE_enum(
  "fresh_pgd_scope", "c", ["c", "bc", "bsc"], "Fresh PGD source scope.")
_FRESH_STEPS = flags.DEFINE_integer(
  "fresh_pgd_steps", 1, "Sign ascents of fresh PGD per step.")
_FRESH_STEP_SIZE = _define_float(
  "fresh_pgd_step_size", 0.1, "Fresh PGD ascent step size.")
_FRESH_ROUTING = flags.DEFINE_enum(
  "fresh_pgd_routing", "all", ["all", "uniform_k"], "Fresh PGD routing.")
_NL_COEFF = _define_float(
  "nonlinearity_coeff", 0.0, "Nonlinearity locality loss (0: off).")
_NL_THRESHOLD = _define_float(
  "nonlinearity_threshold", 1.0, "Soft-count threshold t at step 0.")
_NL_THRESHOLD_FINAL = _define_float(
  "nonlinearity_threshold_final_frac", 1.0,
  "Final threshold as a fraction of the first (linear anneal when ≠ 1).")
_NL_WEIGHTS = _define_numbers(
  "nonlinearity_weights", [], "Per unit kind weight, kind:weight or "
  "kind:none (default: weight 1 for every kind the target has).",
  keyed=True)
_COMPONENTS_INIT = flags.DEFINE_enum(
  "components_init", "normal", ["normal", "projected"],
  "V/U init: normal (V ~ N/√d_in, U ~ N/√C; SPEC §6.1) or projected (unit "
  "vectors scaled by their overlap with W; the SPD paper's).")
_CHECKPOINTING = flags.DEFINE_enum(
  "checkpointing", "periodic", ["periodic", "none"],
  "periodic: save to <output_dir>/checkpoints after warmup, every "
  "--save_every steps, at the end and on SIGTERM/SIGINT (then exit 75, "
  "EX_TEMPFAIL, for a requeue); the same command resumes. none: save "
  "nothing; the run directory then cannot be re-entered.")
_SAVE_EVERY = flags.DEFINE_integer(
  "save_every", 1000, "Steps between periodic checkpoints.")
_KEEP_LAST = flags.DEFINE_integer(
  "keep_last", 3, "Checkpoints kept, newest first (the final one is never "
  "pruned).")
_KEEP_ALL = flags.DEFINE_bool(
  "keep_all", False, "Keep every checkpoint (overrides --keep_last).")
_ON_NONFINITE = flags.DEFINE_enum(
  "on_nonfinite", "stop", ["stop", "skip"],
  "A step whose losses or updated state hold NaN or infinity. stop: save "
  "nothing from it and exit 3 at the next log step or save, naming the "
  "step, its first non-finite term and the newest good checkpoint. skip: "
  "drop that update (the step counter still moves on) and count it in "
  "the metrics as nonfinite/steps. May differ between launches of a run.")
_MAX_SKIPPED_IN_A_ROW = flags.DEFINE_integer(
  "max_skipped_in_a_row", 100, "With --on_nonfinite=skip: stop as a "
  "diverged run once this many updates in a row were non-finite (a run "
  "that cannot recover). May differ between launches of a run.")
_INIT_FROM = flags.DEFINE_string(
  "init_from", None, "Fine-tune init: <run_dir>/<step> or <run_dir>/latest. "
  "Starts from that run's decomposition with fresh optimizers, adversaries, "
  "EMA and step 0, no warmup; its sites, C and CI function must match.")
_PROFILE_STEPS = flags.DEFINE_string(
  "profile_steps", "", "START:END writes a jax.profiler trace of steps "
  "[START, END) to <output_dir>/profile (empty: no trace).")
_COMPONENTS_OPTIMIZER = flags.DEFINE_enum(
  "components_optimizer", "adamw", ["adamw", "muon"],
  "Optimizer of the components (the CI function always uses AdamW).")

# Scale-out (read by bin/placement_setup.py into its own config; SPEC §8).
_REPLICATE = flags.DEFINE_integer(
  "replicate", None, "Size of the `replicate` mesh axis (node groups; "
  "default 1).")
_FSDP = flags.DEFINE_integer(
  "fsdp", None, "Size of the `fsdp` mesh axis (data shards; default: every "
  "device the other axes leave).")
_TP = flags.DEFINE_integer(
  "tp", None, "Size of the `tp` mesh axis (the C axis of V/U and CI; "
  "default 1). replicate x fsdp x tp must equal the device count.")
_PLACEMENT = flags.DEFINE_enum(
  "placement", "ddp", ["ddp", "zero1", "owner"],
  "Placement preset: ddp (state replicated, batch over every device), zero1 "
  "(V/U masters and moments sharded over the whole mesh), owner (stacks over "
  "replicate, matrix dims over fsdp, C over tp).")
_PLACE = flags.DEFINE_list(
  "place", [], "Per-category overrides of the preset, category:layout, e.g. "
  "optimizer:fsdp,frozen:replicated; a layout is a name (replicated, data, "
  "batch, fsdp, fsdp_tp, tp, zero1, owner, stacked) or axis=mesh[+mesh];...")
_LOCAL_DEVICE_COUNT = flags.DEFINE_integer(
  "local_device_count", None, "Devices this process drives, as launched "
  "(CPU: simulated devices; default: all it sees).")
_COORDINATOR_ADDRESS = flags.DEFINE_string(
  "coordinator_address", None, "host:port of process 0 of a multi-process "
  "run (jax.distributed); auto: take everything from the cluster "
  "environment.")
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", None, "Processes of a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer(
  "process_id", None, "This process's index, 0 .. num_processes-1 (0 writes "
  "logs and figures).")
_COMPILER = flags.DEFINE_string(
  "compiler", "bare", "XLA options of the step's compile: bare, tuned-v1 "
  "(GPU collective scheduling) or xla_option=value pairs, comma-separated.")
_COMPILATION_CACHE_DIR = flags.DEFINE_string(
  "compilation_cache_dir", None, "Directory of JAX's persistent "
  "compilation cache (default: none).")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Every setting of one decomposition run, validated."""

  target: str
  target_seed: int | None
  target_path: str | None
  model_dir: str | None
  seq_len: int
  data_path: str | None
  eval_data_path: str | None
  attention: str
  compute_dtype: str
  sites: tuple[str, ...]
  c: int
  ci_fn: str
  ci_hidden: tuple[int, ...]
  ci_d_model: int
  ci_n_blocks: int
  ci_n_heads: int
  ci_n_kv_heads: int | None
  ci_d_mlp: int
  ci_attention: str
  ci_remat: bool
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
  eval_every: int
  slow_eval_every: int
  figure_cpu_share: float
  eval_batches: int
  slow_on_first_step: bool
  eval_pgd_steps: int
  eval_pgd_lr: float
  groups_coeff: float
  recon_groups: str
  groups_routing: str
  ema_halflife_steps: float
  pgd_coeff: float
  pgd_plan: str
  pgd_routing: str
  pgd_scope: str
  pgd_parametrization: str
  pgd_step_rule: str
  pgd_lr: float
  pgd_lr_warmup_pct: float
  pgd_betas: tuple[str, ...]
  pgd_eps: float
  pgd_n_warmup: int
  pgd_objective: str
  pgd_start_frac: float
  merged_coeff: float
  merged_plan: str
  merged_routing: str
  merged_adv_fraction: float
  merged_adv_fraction_final_frac: float
  hidden_coeff: float
  hidden_points: tuple[str, ...]
  hidden_terms: tuple[str, ...]
  fresh_pgd_coeff: float
  fresh_pgd_init: str
  fresh_pgd_scope: str
  fresh_pgd_steps: int
  fresh_pgd_step_size: float
  fresh_pgd_routing: str
  nonlinearity_coeff: float
  nonlinearity_threshold: float
  nonlinearity_threshold_final_frac: float
  nonlinearity_weights: tuple[str, ...]
  components_optimizer: str
  components_init: str
  checkpointing: str
  save_every: int
  keep_last: int
  keep_all: bool
  on_nonfinite: str
  max_skipped_in_a_row: int
  init_from: str | None
  profile_steps: str


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


def _validate_eval_cadence(config: TrainConfig) -> None:
  """Raise ValueError unless log_every | eval_every | slow_eval_every."""
  _positive("eval_batches", config.eval_batches)
  _non_negative("eval_every", config.eval_every)
  _non_negative("slow_eval_every", config.slow_eval_every)
  _non_negative("eval_pgd_steps", config.eval_pgd_steps)
  _positive("eval_pgd_lr", config.eval_pgd_lr)
  if not 0.0 < config.figure_cpu_share <= 1.0:
    raise ValueError(f"--figure_cpu_share must lie in (0, 1], got "
                     f"{config.figure_cpu_share}")
  every, slow = config.eval_every, config.slow_eval_every
  if every and every % config.log_every:
    raise ValueError(f"--eval_every={every} must be a multiple of "
                     f"--log_every={config.log_every}")
  if slow and not every:
    raise ValueError("--slow_eval_every needs --eval_every above 0 (or set "
                     "--slow_eval_every=0)")
  if slow and slow % every:
    raise ValueError(f"--slow_eval_every={slow} must be a multiple of "
                     f"--eval_every={every}")


def _validate_sizes(config: TrainConfig) -> None:
  """Raise ValueError for a bad size, count or cadence."""
  if config.c <= 0:
    raise ValueError("--c must be a positive number of components, got "
                     f"{config.c}")
  for name in ("num_steps", "batch_size", "log_every", "n_mask_samples",
               "subset_size", "lr"):
    _positive(name, getattr(config, name))
  _validate_eval_cadence(config)
  for name in ("weight_decay", "clip_max_norm", "faithfulness_warmup_steps",
               "figures_every", "importance_eps"):
    _non_negative(name, getattr(config, name))
  if config.ci_lr is not None:
    _positive("ci_lr", config.ci_lr)
  if config.reference_token_count is not None:
    _positive("reference_token_count", config.reference_token_count)


def _validate_schedules(config: TrainConfig) -> None:
  """Raise ValueError for a schedule setting that does nothing or cannot
  run."""
  if not 0.0 <= config.lr_warmup_pct < 1.0:
    raise ValueError("--lr_warmup_pct must lie in [0, 1), got "
                     f"{config.lr_warmup_pct}")
  constant = config.lr_schedule == "constant"
  if constant and config.lr_final_frac not in (0.0, 1.0):
    raise ValueError("--lr_final_frac has no effect with "
                     "--lr_schedule=constant; drop it or choose linear|cosine")
  if config.p_schedule == "constant" and config.p_final_frac != 1.0:
    raise ValueError("--p_final_frac needs --p_schedule=linear|cosine")


def _validate_coefficients(config: TrainConfig) -> None:
  """Raise ValueError for a negative coefficient or no reconstruction term
  (the terms from `term_table`)."""
  for term in term_table.TERMS:
    _non_negative(term.coeff_flag, term_table.coeff_of(config, term))
  recon = [t for t in term_table.TERMS if t.recon]
  if not any(term_table.coeff_of(config, t) for t in recon):
    names = [f"--{t.coeff_flag}" for t in recon]
    raise ValueError(f"no reconstruction term: set {', '.join(names[:-1])} "
                     f"or {names[-1]} above 0")


def _validate_term_settings(config: TrainConfig) -> None:
  """Raise ValueError for a bad setting of an enabled term."""
  for name in ("pgd_n_warmup", "fresh_pgd_steps", "ema_halflife_steps"):
    _non_negative(name, getattr(config, name))
  if config.ema_halflife_steps > 1e6:
    raise ValueError("--ema_halflife_steps must be at most 1e6")
  if config.ema_halflife_steps and not config.frequency_coeff:
    raise ValueError("--ema_halflife_steps needs --frequency_coeff above 0")
  if len(config.pgd_betas) != 2:
    raise ValueError("--pgd_betas takes two values, b1,b2")
  final = config.merged_adv_fraction * config.merged_adv_fraction_final_frac
  for value in (config.merged_adv_fraction, final):
    if not 0.0 <= value <= 1.0:
      raise ValueError("the merged term's adversarial fraction must stay in "
                       f"[0, 1], got {value}")
  uses_groups = config.groups_coeff or (
    config.pgd_coeff and config.pgd_plan == "groups") or (
    config.merged_coeff and config.merged_plan == "groups")
  if uses_groups and not config.recon_groups:
    raise ValueError("a groups plan needs --recon_groups, e.g. 'a+b;c'")


def _validate_rider(config: TrainConfig) -> None:
  """Raise ValueError for a hidden-activation rider on no term, or on a term
  that is off or takes none."""
  _non_negative("hidden_coeff", config.hidden_coeff)
  if config.hidden_coeff and not config.hidden_terms:
    raise ValueError("the hidden-activation rider never stands alone: name "
                     "the recon terms it rides on with --hidden_terms")
  if config.hidden_terms and not config.hidden_coeff:
    raise ValueError("--hidden_terms needs --hidden_coeff above 0")
  riders = term_table.RIDER_TERMS
  for name in config.hidden_terms:
    if name not in riders:
      raise ValueError(f"--hidden_terms names {name!r}, not a recon term "
                       f"that takes a rider; use {', '.join(riders)}")
    if not term_table.coeff_of(config, riders[name]):
      raise ValueError(f"--hidden_terms names {name}, which is off; set "
                       f"--{riders[name].coeff_flag} above 0")


def _validate_data(config: TrainConfig) -> None:
  """Raise ValueError for bad sequence, token-file or site settings."""
  _positive("seq_len", config.seq_len)
  if (config.data_path or config.eval_data_path) and config.target != "hf":
    raise ValueError("--data_path and --eval_data_path read token files for "
                     "--target=hf; toys draw their own data")
  if config.eval_data_path and not config.data_path:
    raise ValueError("--eval_data_path needs --data_path (the training "
                     "tokens)")
  if len(set(config.sites)) != len(config.sites):
    raise ValueError(f"--sites lists a site twice: {','.join(config.sites)}")


def _validate_run(config: TrainConfig) -> None:
  """Raise ValueError for bad checkpoint, init or profile settings."""
  for name in ("save_every", "keep_last", "max_skipped_in_a_row"):
    _positive(name, getattr(config, name))
  checkpointing.parse_init_from(config.init_from)
  run_records.parse_profile_steps(config.profile_steps, config.num_steps)


def config_from_flags() -> TrainConfig:
  """Return the validated config of the parsed flags."""
  values = {}
  for field in dataclasses.fields(TrainConfig):
    value = flags.FLAGS[field.name].value
    values[field.name] = tuple(value) if isinstance(value, list) else value
  values["ci_hidden"] = _parse_widths(list(values["ci_hidden"]))
  config = TrainConfig(**values)
  validate(config)
  return config


def parse_config(*args: str) -> TrainConfig:
  """Return the validated config of `bin/train` arguments (flagfiles
  included) without leaving them parsed: FLAGS are back at their defaults
  after, so one process can build several runs."""
  flags.FLAGS.unparse_flags()
  try:
    argv = flags.FLAGS.read_flags_from_files(list(args), force_gnu=False)
    flags.FLAGS(["train", *argv])
    return config_from_flags()
  finally:
    flags.FLAGS.unparse_flags()
    flags.FLAGS.mark_as_parsed()


def validate(config: TrainConfig) -> None:
  """Raise ValueError naming the first invalid setting and its fix."""
  _validate_sizes(config)
  _validate_schedules(config)
  _validate_coefficients(config)
  _validate_term_settings(config)
  _validate_rider(config)
  _validate_data(config)
  _validate_run(config)
