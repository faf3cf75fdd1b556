"""Flags of `bin/train`, defined once, and their checks.

Each flag sets the `TrainConfig` field of its name (`decompax.recipe.config`)
and takes its default from there. Library code never reads FLAGS:
`config_from_flags` turns them into a `TrainConfig` at the top of `main`,
checking what only the flags know (sizes, cadences, which settings go
together) up front; a value a library config refuses is refused when the
run is assembled, naming its flag (`recipe.config.setting`).
"""

import dataclasses
import fnmatch
import functools
import math

from absl import flags

from decompax.bin import checkpointing, cli, placement_flags, restarts
from decompax.bin import run_records
from decompax.core import ci_fns
from decompax.core.masks import ROUTINGS
from decompax.recipe import streams, terms
from decompax.recipe.config import DEFAULTS as _D
from decompax.recipe.config import TrainConfig, setting


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
  "target", _D.target,
  "Toy target: tms_5-2, tms_5-2-id, tms_40-10, tms_40-10-id, resid_mlp1, "
  "resid_mlp2, resid_mlp3, simple_mlp, induction or addsub (a ± b mod 23 "
  "plus copying); or hf, a language model read from --model_dir.")
_TARGET_SEED = flags.DEFINE_integer(
  "target_seed", _D.target_seed,
  "Seed of the target's own training (default: the target's known-good seed).")
_TARGET_PATH = flags.DEFINE_string(
  "target_path", _D.target_path,
  "Cached trained target (.npz); trained and written there when absent. "
  "Default: <output_dir>/target.npz.")
_MODEL_DIR = flags.DEFINE_string(
  "model_dir", _D.model_dir,
  "--target=hf: local Hugging Face checkpoint directory (config.json and "
  "safetensors).")
_SEQ_LEN = flags.DEFINE_integer(
  "seq_len", _D.seq_len, "Tokens per sequence of a --target=hf batch.")
_DATA_PATH = flags.DEFINE_string(
  "data_path", _D.data_path,
  "--target=hf: token file (NAME.bin from bin/tokenize) the training batches "
  "are read from; default: uniform random token ids.")
_EVAL_DATA_PATH = flags.DEFINE_string(
  "eval_data_path", _D.eval_data_path,
  "--target=hf: held-out token file of the eval batches; default: windows of "
  "--data_path on a stream of their own (not held-out text).")
_ATTENTION = flags.DEFINE_enum(
  "attention", _D.attention, ["reference", "xla", "cudnn", "auto"],
  "Attention of LM targets: plain einsums, or jax.nn.dot_product_attention "
  "with implementation xla, cudnn or JAX's choice (auto).")
_COMPUTE_DTYPE = flags.DEFINE_enum(
  "compute_dtype", _D.compute_dtype, ["bfloat16", "float32"],
  "Dtype of --target=hf frozen weights and activations (SPEC N4).")
_SITES = flags.DEFINE_list(
  "sites", list(_D.sites),
  "Sites to decompose, comma-separated (default: all); --target=hf also "
  "takes shell patterns, e.g. 'layers.18.mlp.*'.")
_C = flags.DEFINE_integer("c", _D.c, "Components per decomposed matrix.")
_CI_FN = flags.DEFINE_enum(
  "ci_fn", _D.ci_fn,
  ["component_mlp", "vector_mlp", "site_mlp", "global_mlp", "transformer"],
  "Causal-importance function: the toy MLPs of SPEC §4.2 or the chunkwise "
  "transformer of §4.3 (LMs: one chunk per decomposed block reading "
  "resid.<block>; toys: one chunk per site reading its input).")
_CI_D_MODEL = flags.DEFINE_integer(
  "ci_d_model", _D.ci_d_model,
  "Transformer CI: width of each chunk's transformer.")
_CI_N_BLOCKS = flags.DEFINE_integer(
  "ci_n_blocks", _D.ci_n_blocks,
  "Transformer CI: blocks per chunk (0 allowed).")
_CI_N_HEADS = flags.DEFINE_integer(
  "ci_n_heads", _D.ci_n_heads,
  "Transformer CI: attention heads (head dim must be even).")
_CI_N_KV_HEADS = flags.DEFINE_integer(
  "ci_n_kv_heads", _D.ci_n_kv_heads,
  "Transformer CI: key/value heads (default: --ci_n_heads, i.e. multi-head "
  "attention).")
_CI_D_MLP = flags.DEFINE_integer(
  "ci_d_mlp", _D.ci_d_mlp, "Transformer CI: MLP width of each block.")
_CI_ATTENTION = flags.DEFINE_enum(
  "ci_attention", _D.ci_attention, ["reference", "xla", "cudnn", "auto"],
  "Transformer CI attention: the portable einsum reference, or "
  "jax.nn.dot_product_attention with that implementation (auto: JAX picks).")
_CI_REMAT = flags.DEFINE_bool(
  "ci_remat", _D.ci_remat,
  "Transformer CI: recompute every block activation in the backward pass "
  "instead of keeping the matmul outputs.")
_CI_HIDDEN = flags.DEFINE_list(
  "ci_hidden", [str(w) for w in _D.ci_hidden],
  "Hidden widths of the CI function (d_gate for component/vector MLPs).")
_FAITHFULNESS_COEFF = _define_float(
  "faithfulness_coeff", _D.faithfulness_coeff,
  "Coefficient of the faithfulness loss.")
_FAITHFULNESS_FORM = flags.DEFINE_enum(
  "faithfulness_form", _D.faithfulness_form, ["global", "relative"],
  "Faithfulness as the mean squared delta over every entry (global, the SPD "
  "paper's) or the mean over sites of ‖W − VU‖²/‖W‖² (relative: every site "
  "weighs the same whatever its size).")
_IMPORTANCE_COEFF = _define_float(
  "importance_coeff", _D.importance_coeff,
  "Coefficient of importance minimality.")
_P_START = _define_float(
  "p_start", _D.p_start, "Exponent p of importance minimality at step 0.")
_P_SCHEDULE = flags.DEFINE_enum(
  "p_schedule", _D.p_schedule, ["constant", "linear", "cosine"],
  "Anneal of p (no warmup: the p-anneal refuses one).")
_P_FINAL_FRAC = _define_float(
  "p_final_frac", _D.p_final_frac, "Final p as a fraction of --p_start.")
_P_KNOTS = flags.DEFINE_string(
  "p_knots", _D.p_knots, "Knot form of the p anneal instead of "
  "--p_schedule: `at:frac[:shape],…` from at=0 to at=1, p = --p_start·frac, "
  "shape linear|cosine|hold for the segment a knot starts (e.g. "
  "0:1:cosine,0.5:0.4,1:0.4).")
_IMPORTANCE_PENALTY = flags.DEFINE_enum(
  "importance_penalty", _D.importance_penalty, ["lp", "smooth_l0"],
  "What minimality raises CI to: lp, (c + ε)^p; smooth_l0, c²/(c² + γ²) "
  "with γ on its own schedule (p is then unused).")
_SMOOTH_L0_GAMMA = _define_float(
  "smooth_l0_gamma", _D.smooth_l0_gamma, "γ of smooth-L0 at step 0 (> 0).")
_SMOOTH_L0_GAMMA_SCHEDULE = flags.DEFINE_enum(
  "smooth_l0_gamma_schedule", _D.smooth_l0_gamma_schedule,
  ["constant", "linear", "cosine"], "Anneal of γ (no warmup).")
_SMOOTH_L0_GAMMA_FINAL_FRAC = _define_float(
  "smooth_l0_gamma_final_frac", _D.smooth_l0_gamma_final_frac,
  "Final γ as a fraction of --smooth_l0_gamma (ignored when constant).")
_SMOOTH_L0_NORMALIZED = flags.DEFINE_bool(
  "smooth_l0_normalized", _D.smooth_l0_normalized,
  "Scale smooth-L0 by 1 + γ², so a fully active component counts 1 at any "
  "γ.")
_IMPORTANCE_EPS = _define_float(
  "importance_eps", _D.importance_eps,
  "ε inside the power of importance minimality.")
_FREQUENCY_COEFF = _define_float(
  "frequency_coeff", _D.frequency_coeff,
  "Coefficient of frequency minimality (0: off).")
_REFERENCE_TOKEN_COUNT = _define_float(
  "reference_token_count", _D.reference_token_count,
  "a' of frequency minimality (default: the batch's token count).")
_STOCHASTIC_COEFF = _define_float(
  "stochastic_coeff", _D.stochastic_coeff,
  "Stochastic recon with all sites live (0: off).")
_STOCHASTIC_ROUTING = flags.DEFINE_enum(
  "stochastic_routing", _D.stochastic_routing, list(ROUTINGS),
  "Routing of the all-sites stochastic term.")
_ROUTE_PROBABILITY = _define_float(
  "route_probability", _D.route_probability,
  "p of static_probability routing (any *_routing flag): each position "
  "routes to each live site independently with probability p (SPEC §5.4).")
_PER_SITE_COEFF = _define_float(
  "per_site_coeff", _D.per_site_coeff,
  "Stochastic recon with one site live at a time (the SPD layerwise loss; 0: "
  "off).")
_SUBSET_COEFF = _define_float(
  "subset_coeff", _D.subset_coeff,
  "Stochastic recon over consecutive site chunks (0: off).")
_SUBSET_SIZE = flags.DEFINE_integer(
  "subset_size", _D.subset_size, "Sites per chunk of the subset term.")
_SUBSET_ROUTING = flags.DEFINE_enum(
  "subset_routing", _D.subset_routing, list(ROUTINGS),
  "Routing within each chunk of the subset term.")
_N_MASK_SAMPLES = flags.DEFINE_integer(
  "n_mask_samples", _D.n_mask_samples,
  "Stochastic draws per plan entry per step.")
_SAMPLING = flags.DEFINE_enum(
  "sampling", _D.sampling, ["continuous", "binomial"],
  "Stochastic source distribution.")
_USE_DELTA = flags.DEFINE_bool(
  "use_delta_component", _D.use_delta_component,
  "Add the maskable delta channel W − VU.")
_LR = _define_float("lr", _D.lr, "Peak learning rate of the components.")
_LR_SCHEDULE = flags.DEFINE_enum(
  "lr_schedule", _D.lr_schedule, ["constant", "linear", "cosine"],
  "Learning-rate decay of both optimizers.")
_LR_FINAL_FRAC = _define_float(
  "lr_final_frac", _D.lr_final_frac,
  "Final learning rate as a fraction of the peak.")
_LR_WARMUP_PCT = _define_float(
  "lr_warmup_pct", _D.lr_warmup_pct,
  "Fraction of steps of linear learning-rate warmup.")
_LR_KNOTS = flags.DEFINE_string(
  "lr_knots", _D.lr_knots, "Knot form of the learning-rate schedule instead "
  "of --lr_schedule, --lr_final_frac and --lr_warmup_pct: `at:frac[:shape],…` "
  "from at=0 to at=1 (at = step/(num_steps − 1)), lr = --lr·frac, shape "
  "linear|cosine|hold for the segment a knot starts; e.g. a 5% warmup then "
  "cosine to 0: 0:0,0.05:1:cosine,1:0.")
_WEIGHT_DECAY = _define_float(
  "weight_decay", _D.weight_decay,
  "AdamW weight decay of components and CI function.")
_CLIP_MAX_NORM = _define_float(
  "clip_max_norm", _D.clip_max_norm,
  "Global-norm clip of component gradients (0: off).")
_CI_LR = _define_float(
  "ci_lr", _D.ci_lr, "Peak learning rate of the CI function (default: --lr).")
_NUM_STEPS = flags.DEFINE_integer("num_steps", _D.num_steps, "Training steps.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", _D.batch_size, "Batch size.")
_SEED = flags.DEFINE_integer(
  "seed", _D.seed,
  "Seed of init, masks and data (default 2: with it the default TMS 5-2 run "
  "recovers the paper's result; see the README).")
_EVAL_SEED = flags.DEFINE_integer(
  "eval_seed", _D.eval_seed,
  "Seed of the held-out eval batches (default: --seed). Runs compared by "
  "their held-out losses, e.g. restarts with different --seed, share one.")
_RESTARTS = flags.DEFINE_integer(
  "restarts", _D.restarts,
  "Candidate runs to choose among (1: none). Candidate j trains with seed "
  "--seed + 1000·j in <output_dir>/candidates/r<j> up to --select_at; the one "
  "with the lowest held-out total loss there (all scored on the held-out "
  "batches of --eval_seed, default --seed) continues to --num_steps. The "
  "choice reads the loss only, never a recovery metric.")
_SELECT_AT = flags.DEFINE_integer(
  "select_at", _D.select_at,
  "Step at which --restarts candidates are compared; a multiple of "
  "--save_every and --eval_every inside the schedule.")
_WARMUP_STEPS = flags.DEFINE_integer(
  "faithfulness_warmup_steps", _D.faithfulness_warmup_steps,
  "Faithfulness-only AdamW steps first (the SPD paper's recipes take none).")
_WARMUP_LR = _define_float(
  "faithfulness_warmup_lr", _D.faithfulness_warmup_lr,
  "Learning rate of the warmup.")
_WARMUP_WD = _define_float(
  "faithfulness_warmup_weight_decay", _D.faithfulness_warmup_weight_decay,
  "Weight decay of the warmup.")
_OUTPUT_DIR = flags.DEFINE_string(
  "output_dir", _D.output_dir,
  "Run directory (default: runs/<target>). Its parent must exist.")
_OVERWRITE = flags.DEFINE_bool(
  "overwrite", _D.overwrite,
  "Replace a run in --output_dir made with other flags.")
_LOG_EVERY = flags.DEFINE_integer(
  "log_every", _D.log_every,
  "Steps between progress lines and metrics records.")
_FIGURES_EVERY = flags.DEFINE_integer(
  "figures_every", _D.figures_every,
  "Steps between figure refreshes (0: at the end only).")
_CI_ALIVE_THRESHOLD = _define_float(
  "ci_alive_threshold", _D.ci_alive_threshold,
  "CI above which a component counts in CI-L0.")
_EVAL_EVERY = flags.DEFINE_integer(
  "eval_every", _D.eval_every,
  "Steps between fast evals on held-out batches (CI-L0, alive counts, masked "
  "recon family, loss terms); a multiple of --log_every; also at the last "
  "step, and at step 0 of a fresh run (0: no eval).")
_SLOW_EVAL_EVERY = flags.DEFINE_integer(
  "slow_eval_every", _D.slow_eval_every,
  "Steps between slow evals (CI histograms and densities, hidden-activation "
  "recon, figures, report); a multiple of --eval_every; also at the last "
  "step (0: none).")
_FIGURE_CPU_SHARE = _define_float(
  "figure_cpu_share", _D.figure_cpu_share,
  "Most of one CPU core that drawing the slow evals' figures may take over a "
  "run; at a shorter cadence some slow evals are not drawn, the last one "
  "always is (1: draw each as soon as the last is done).")
_EVAL_BATCHES = flags.DEFINE_integer(
  "eval_batches", _D.eval_batches, "Held-out batches of --batch_size per eval.")
_SLOW_ON_FIRST_STEP = flags.DEFINE_bool(
  "slow_on_first_step", _D.slow_on_first_step,
  "Run the slow eval at step 0 of a fresh run.")
_EVAL_PGD_STEPS = flags.DEFINE_integer(
  "eval_pgd_steps", _D.eval_pgd_steps,
  "Sign-PGD ascents of the fast eval's fresh-PGD probe (eval/recon/pgd: "
  "every site routed, random sources per site; 0: off).")
_EVAL_PGD_LR = _define_float(
  "eval_pgd_lr", _D.eval_pgd_lr, "Step size of the eval's fresh-PGD probe.")
_EVAL_ATTENTION_KL = flags.DEFINE_bool(
  "eval_attention_kl", _D.eval_attention_kl,
  "Fast evals also score attention patterns: per block with a decomposed "
  "q_proj or k_proj, eval/attn_kl/{ci_masked,stochastic}/layers.<i> is "
  "KL(clean || masked) of its attention rows, averaged over query heads, "
  "positions and eval batches (/all: over the blocks). LM targets only "
  "(hf, induction).")


_GROUPS_COEFF = _define_float(
  "groups_coeff", _D.groups_coeff,
  "Stochastic recon over --recon_groups (0: off).")
_RECON_GROUPS = flags.DEFINE_string(
  "recon_groups", _D.recon_groups,
  "Site groups for plans of kind `groups`: sites joined by '+', groups by "
  "';' (e.g. 'linear1+linear2;linear2').")
_GROUPS_ROUTING = flags.DEFINE_enum(
  "groups_routing", _D.groups_routing, list(ROUTINGS),
  "Routing within each group of the groups term.")
_EMA_HALFLIFE = _define_float(
  "ema_halflife_steps", _D.ema_halflife_steps,
  "Half-life (steps) of the running firing estimate of frequency minimality "
  "(0: per-batch estimate).")
_PGD_COEFF = _define_float(
  "pgd_coeff", _D.pgd_coeff, "Persistent PGD recon term (0: off).")
_PGD_PLAN = flags.DEFINE_enum(
  "pgd_plan", _D.pgd_plan, ["all_sites", "per_site", "subset", "groups"],
  "Plan of the persistent PGD term.")
_PGD_ROUTING = flags.DEFINE_enum(
  "pgd_routing", _D.pgd_routing, list(ROUTINGS),
  "Routing of the PGD plan.")
_PGD_SCOPE = flags.DEFINE_enum(
  "pgd_scope", _D.pgd_scope, ['c', 'bc', 'sc', 'bsc'],
  "Axes a persistent source keeps: c (shared over batch), bc (per example); "
  "sc/bsc need positions.")
_PGD_PARAMETRIZATION = flags.DEFINE_enum(
  "pgd_parametrization", _D.pgd_parametrization, ["clamp", "sigmoid"],
  "Persistent source storage: clamped to [0,1] or raw through a sigmoid.")
_PGD_STEP_RULE = flags.DEFINE_enum(
  "pgd_step_rule", _D.pgd_step_rule, ['adam', 'sign'],
  "Persistent source ascent rule.")
_PGD_LR = _define_float("pgd_lr", _D.pgd_lr, "Persistent source step size.")
_PGD_LR_WARMUP_PCT = _define_float(
  "pgd_lr_warmup_pct", _D.pgd_lr_warmup_pct,
  "Fraction of steps of source LR warmup.")
_PGD_BETAS = _define_numbers(
  "pgd_betas", list(_D.pgd_betas), "Source Adam betas b1,b2.")
_PGD_EPS = _define_float(
  "pgd_eps", _D.pgd_eps,
  "Source Adam eps (after the root).")
_PGD_N_WARMUP = flags.DEFINE_integer(
  "pgd_n_warmup", _D.pgd_n_warmup, "Supplemental all-site ascents per step.")
_PGD_OBJECTIVE = flags.DEFINE_enum(
  "pgd_objective", _D.pgd_objective, ['e2e', 'term'],
  "What the adversary ascends.")
_PGD_START_FRAC = _define_float(
  "pgd_start_frac", _D.pgd_start_frac,
  "Fraction of steps before the PGD term starts.")
_MERGED_COEFF = _define_float(
  "merged_coeff", _D.merged_coeff,
  "Merged stochastic/persistent recon term (SPEC §5.8; 0: off). Its sources "
  "step with the --pgd_* settings.")
_MERGED_PLAN = flags.DEFINE_enum(
  "merged_plan", _D.merged_plan, ["all_sites", "per_site", "subset", "groups"],
  "Plan of the merged term.")
_MERGED_ROUTING = flags.DEFINE_enum(
  "merged_routing", _D.merged_routing, list(ROUTINGS),
  "Routing of the merged term's stochastic rows.")
_MERGED_ADV_FRACTION = _define_float(
  "merged_adv_fraction", _D.merged_adv_fraction,
  "Probability that a batch row of the merged term uses the persistent "
  "sources, at step 0.")
_MERGED_ADV_FRACTION_FINAL = _define_float(
  "merged_adv_fraction_final_frac", _D.merged_adv_fraction_final_frac,
  "Final adversarial fraction as a fraction of the first (linear anneal when "
  "≠ 1).")
_HIDDEN_COEFF = _define_float(
  "hidden_coeff", _D.hidden_coeff,
  "Hidden-activation reconstruction rider (SPEC §5.9) on the --hidden_terms "
  "(0: off).")
_HIDDEN_POINTS = flags.DEFINE_list(
  "hidden_points", list(_D.hidden_points),
  "Activations the rider matches (tap keys; default: every decomposed site's "
  "output, <site>.out).")
_HIDDEN_TERMS = flags.DEFINE_list(
  "hidden_terms", list(_D.hidden_terms), "Recon terms the rider rides on: "
  f"{', '.join(terms.RIDER_TERMS)}.")
_FRESH_COEFF = _define_float(
  "fresh_pgd_coeff", _D.fresh_pgd_coeff,
  "Fresh (per-step) PGD recon term (0: off).")
_FRESH_INIT = flags.DEFINE_enum(
  "fresh_pgd_init", _D.fresh_pgd_init, ["random", "ones", "zeroes"],
  "Initial fresh PGD sources.")
_FRESH_SCOPE = flags.DEFINE_enum(
  "fresh_pgd_scope", _D.fresh_pgd_scope, ['c', 'bc', 'bsc'],
  "Fresh PGD source scope.")
_FRESH_STEPS = flags.DEFINE_integer(
  "fresh_pgd_steps", _D.fresh_pgd_steps, "Sign ascents of fresh PGD per step.")
_FRESH_STEP_SIZE = _define_float(
  "fresh_pgd_step_size", _D.fresh_pgd_step_size, "Fresh PGD ascent step size.")
_FRESH_ROUTING = flags.DEFINE_enum(
  "fresh_pgd_routing", _D.fresh_pgd_routing, list(ROUTINGS),
  "Fresh PGD routing.")
_NL_COEFF = _define_float(
  "nonlinearity_coeff", _D.nonlinearity_coeff,
  "Nonlinearity locality loss (0: off).")
_NL_THRESHOLD = _define_float(
  "nonlinearity_threshold", _D.nonlinearity_threshold,
  "Soft-count threshold t at step 0.")
_NL_THRESHOLD_FINAL = _define_float(
  "nonlinearity_threshold_final_frac", _D.nonlinearity_threshold_final_frac,
  "Final threshold as a fraction of the first (linear anneal when ≠ 1).")
_NL_WEIGHTS = _define_numbers(
  "nonlinearity_weights", list(_D.nonlinearity_weights),
  "Per unit kind weight, kind:weight or kind:none (default: weight 1 for "
  "every kind the target has).",
  keyed=True)
# Targeted decomposition (SPEC §6.6; `recipe.streams`).
_TARGET_TASK = flags.DEFINE_string(
  "target_task", _D.target_task,
  "Targeted decomposition: the built-in task of the target stream (addsub: "
  "two-operand a±b mod P prompts), whose mechanism is wanted.")
_TARGET_DATA = flags.DEFINE_string(
  "target_data_path", _D.target_data_path,
  "Targeted decomposition: a token file as the target stream (instead of "
  "--target_task).")
_TARGET_BATCH = flags.DEFINE_integer(
  "target_batch_size", _D.target_batch_size,
  "Target stream's batch size (0: --batch_size).")
_TARGET_SEQ = flags.DEFINE_integer(
  "target_seq_len", _D.target_seq_len,
  "Sequence length of a token-file target stream (0: --seq_len); a task "
  "fixes its own.")
_TARGET_POSITIONS = flags.DEFINE_enum(
  "target_loss_positions", _D.target_loss_positions, ["answer", "all"],
  "Where the target stream's output divergence is scored: the task's answer "
  "positions, or every position.")
_NONTARGET_TASK = flags.DEFINE_string(
  "nontarget_task", _D.nontarget_task,
  "Targeted decomposition: the built-in task of the non-target stream "
  "(copy: induction copying over the task model's vocabulary); its masked "
  "forwards pin the delta path on (δ ≡ 1).")
_NONTARGET_DATA = flags.DEFINE_string(
  "nontarget_data_path", _D.nontarget_data_path,
  "Targeted decomposition: a token file as the non-target stream.")
_NONTARGET_BATCH = flags.DEFINE_integer(
  "nontarget_batch_size", _D.nontarget_batch_size,
  "Non-target stream's batch size (0: --batch_size).")
_NONTARGET_SEQ = flags.DEFINE_integer(
  "nontarget_seq_len", _D.nontarget_seq_len,
  "Sequence length of a token-file non-target stream (0: --seq_len).")
_NONTARGET_RECON = _define_float(
  "nontarget_recon_coeff", _D.nontarget_recon_coeff,
  "Non-target stream's delta-pinned reconstruction (required above 0 in a "
  "targeted run).")
_NONTARGET_SOURCES = flags.DEFINE_enum(
  "nontarget_sources", _D.nontarget_sources, ["stochastic", "constant"],
  "Non-target masks: ci + (1 − ci)·U[0,1] (stochastic) or the lower CI "
  "itself (constant source 0).")
_NONTARGET_UNMASKED = _define_float(
  "nontarget_unmasked_coeff", _D.nontarget_unmasked_coeff,
  "Non-target unmasked-no-delta reconstruction: every mask 1, delta off "
  "(0: off).")
_NONTARGET_IMP = _define_float(
  "nontarget_importance_coeff", _D.nontarget_importance_coeff,
  "Importance minimality on the non-target stream's CI (0: off).")
_NONTARGET_PGD = _define_float(
  "nontarget_pgd_coeff", _D.nontarget_pgd_coeff,
  "Non-target persistent PGD recon, its own sources, settings of --pgd_* "
  "(0: off).")
_NONTARGET_MERGED = _define_float(
  "nontarget_merged_coeff", _D.nontarget_merged_coeff,
  "Non-target merged stochastic/persistent recon, its own sources, "
  "settings of --merged_* (0: off).")
_CI_SCALED_DECAY = _define_float(
  "ci_scaled_decay", _D.ci_scaled_decay,
  "Targeted decomposition: after each update V[:,c], U[c,:] *= 1 − "
  "lr·decay·(1 − max CI of c over both streams' batches) (0: off).")
_CI_ROLES = flags.DEFINE_list(
  "ci_roles", list(_D.ci_roles),
  "CI readouts: output, or output,hidden for dual-role CI (one shared "
  "trunk, two heads; every recon and importance term also runs in each "
  "stream's hidden pass on the hidden role's masks).")
_HIDDEN_PASS_POINTS = flags.DEFINE_list(
  "hidden_pass_points", list(_D.hidden_pass_points),
  "Activations a hidden pass reconstructs, each as MSE relative to its own "
  "clean scale (default: the MLP outputs from the first decomposed layer "
  "to the last; a toy's site outputs).")
_HIDDEN_PASS_COEFF = _define_float(
  "hidden_pass_coeff", _D.hidden_pass_coeff,
  "The hidden passes' recon terms run at their term's coefficient times "
  "this.")
_SEQUENTIAL_PASSES = flags.DEFINE_bool(
  "sequential_passes", _D.sequential_passes,
  "Score the step's passes (stream × CI role) one at a time behind an "
  "optimization barrier and add their gradients: the same objective, with "
  "one pass's masked forwards in memory at a time.")
_AB_GRID = flags.DEFINE_enum(
  "ab_grid", _D.ab_grid, ["auto", "on", "off"],
  "Targeted decomposition: the A/B grid page of each slow eval (auto: when "
  "the target stream is a two-operand task; on: refuse a run where it is "
  "not; off: never).")
_COMPONENTS_INIT = flags.DEFINE_enum(
  "components_init", _D.components_init, ["normal", "projected"],
  "V/U init: normal (V ~ N/√d_in, U ~ N/√C; SPEC §6.1) or projected (unit "
  "vectors scaled by their overlap with W; the SPD paper's).")
_CHECKPOINTING = flags.DEFINE_enum(
  "checkpointing", _D.checkpointing, ["periodic", "none"],
  "periodic: save to <output_dir>/checkpoints after warmup, every "
  "--save_every steps, at the end and on SIGTERM/SIGINT (then exit 75, "
  "EX_TEMPFAIL, for a requeue); the same command resumes. none: save "
  "nothing; the run directory then cannot be re-entered.")
_SAVE_EVERY = flags.DEFINE_integer(
  "save_every", _D.save_every, "Steps between periodic checkpoints.")
_WANDB_PROJECT = flags.DEFINE_string(
  "wandb_project", "", "Also log the run to this Weights & Biases project: "
  "the metrics.jsonl scalars, the settings and the final figures "
  "(WANDB_MODE=offline writes them under the run directory; needs the "
  "decompax[wandb] extra). Empty: no W&B.")
_STOP_AFTER_STEP = flags.DEFINE_integer(
  "stop_after_step", _D.stop_after_step,
  "Train only up to this step of the --num_steps schedule, save and exit 0; "
  "rerun without it (or with a later step) to continue. A multiple of "
  "--save_every and --eval_every, so the stop is saved and evaluated. 0: "
  "off. May change between launches.")
_KEEP_LAST = flags.DEFINE_integer(
  "keep_last", _D.keep_last,
  "Checkpoints kept, newest first (the final one is never pruned).")
_KEEP_ALL = flags.DEFINE_bool(
  "keep_all", _D.keep_all, "Keep every checkpoint (overrides --keep_last).")
_ON_NONFINITE = flags.DEFINE_enum(
  "on_nonfinite", _D.on_nonfinite, ["stop", "skip"],
  "A step whose losses or updated state hold NaN or infinity. stop: save "
  "nothing from it and exit 3 at the next log step or save, naming the "
  "step, its first non-finite term and the newest good checkpoint. skip: "
  "drop that update (the step counter still moves on) and count it in "
  "the metrics as nonfinite/steps. May differ between launches of a run.")
_MAX_SKIPPED_IN_A_ROW = flags.DEFINE_integer(
  "max_skipped_in_a_row", _D.max_skipped_in_a_row,
  "With --on_nonfinite=skip: stop as a diverged run once this many updates "
  "in a row were non-finite (a run that cannot recover). May differ between "
  "launches of a run.")
_MAX_SKIPPED_SHARE = _define_float(
  "max_skipped_share", _D.max_skipped_share,
  "With --on_nonfinite=skip: stop as a diverged run once more than this "
  "share of --num_steps updates were non-finite, in a row or not (a run "
  "that mostly trained nothing; 1: no limit). May differ between launches "
  "of a run.")
_INIT_FROM = flags.DEFINE_string(
  "init_from", _D.init_from,
  "Fine-tune init: <run_dir>/<step> or <run_dir>/latest. Starts from that "
  "run's decomposition with fresh optimizers, adversaries, EMA and step 0, "
  "no warmup; its sites, C and CI function must match.")
_PROFILE_STEPS = flags.DEFINE_string(
  "profile_steps", _D.profile_steps,
  "START:END writes a jax.profiler trace of steps [START, END) to "
  "<output_dir>/profile (empty: no trace).")
_COMPONENTS_OPTIMIZER = flags.DEFINE_enum(
  "components_optimizer", _D.components_optimizer, ["adamw", "muon"],
  "Optimizer of the components (the CI function always uses AdamW).")

# Scale-out (read by bin/placement_setup.py into its own config; SPEC §8):
# defined here, as this module's flags, so that a run's flags.txt records
# them; bin/harvest defines the same flags for itself.
placement_flags.define(__name__)


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


def check_alive_threshold(flag: str, value: float) -> None:
  """Raise ValueError unless a CI threshold lies in [0, 1): CI does, so a
  negative one counts every component alive and 1 counts none."""
  if not 0.0 <= value < 1.0:
    raise ValueError(f"--{flag} must lie in [0, 1), the range of CI, got "
                     f"{value}")


def _validate_eval_cadence(config: TrainConfig) -> None:
  """Raise ValueError unless log_every | eval_every | slow_eval_every."""
  check_alive_threshold("ci_alive_threshold", config.ci_alive_threshold)
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


# Targets whose forward has attention (the GLU decoders).
ATTENTION_TARGETS = ("hf", "induction", "addsub")
# More blocks than any decoder has: the layer indices a --sites entry is
# tried against to see whether it can select a query or key projection.
_MAX_BLOCKS = 1000


def _selects_query_or_key(patterns: tuple[str, ...]) -> bool:
  """Return whether a --sites list can select a q_proj or k_proj (empty:
  every site), matching as `recipe.lm.expand_sites` does."""
  if not patterns:
    return True
  names = [f"layers.{i}.self_attn.{r}_proj"
           for i in range(_MAX_BLOCKS) for r in ("q", "k")]
  return any(fnmatch.fnmatchcase(n, p) for p in patterns for n in names)


def _validate_eval_attention(config: TrainConfig) -> None:
  """Raise ValueError for the attention-pattern eval on a target without
  attention, or on sites without a query or key projection, before the
  run compiles (the eval's own check comes after)."""
  if not config.eval_attention_kl:
    return
  if config.target not in ATTENTION_TARGETS:
    choices = " or ".join(ATTENTION_TARGETS)
    raise ValueError(
      f"--eval_attention_kl scores attention patterns, and --target="
      f"{config.target} has no attention; drop --eval_attention_kl or "
      f"decompose a language model (--target={choices})")
  if not _selects_query_or_key(config.sites):
    raise ValueError(
      "--eval_attention_kl scores blocks with a decomposed q_proj or "
      "k_proj, and --sites names none; add one (e.g. "
      "layers.<i>.self_attn.q_proj) or drop --eval_attention_kl")


def _validate_sizes(config: TrainConfig) -> None:
  """Raise ValueError for a bad size, count or cadence."""
  if config.c <= 0:
    raise ValueError("--c must be a positive number of components, got "
                     f"{config.c}")
  for name in ("num_steps", "batch_size", "log_every", "n_mask_samples",
               "subset_size", "lr"):
    _positive(name, getattr(config, name))
  _validate_eval_cadence(config)
  _validate_eval_attention(config)
  for name in ("weight_decay", "clip_max_norm", "faithfulness_warmup_steps",
               "figures_every", "importance_eps"):
    _non_negative(name, getattr(config, name))
  if config.ci_lr is not None:
    _positive("ci_lr", config.ci_lr)


def _validate_schedules(config: TrainConfig) -> None:
  """Raise ValueError for a schedule setting that does nothing (the
  schedules refuse those that cannot run)."""
  constant = config.lr_schedule == "constant"
  if constant and config.lr_final_frac not in (0.0, 1.0):
    raise ValueError("--lr_final_frac has no effect with "
                     "--lr_schedule=constant; drop it or choose linear|cosine")
  if config.lr_knots and config.lr_warmup_pct:
    raise ValueError("--lr_knots replaces --lr_warmup_pct; put the warmup in "
                     "the knots (e.g. 0:0,0.05:1:cosine,1:0)")
  if config.p_knots and config.p_schedule != "constant":
    raise ValueError("--p_knots replaces --p_schedule; drop one")
  if config.importance_penalty == "smooth_l0" and config.p_knots:
    raise ValueError("--p_knots anneals p, which smooth_l0 does not use; "
                     "anneal γ with --smooth_l0_gamma_schedule")
  # A negative final fraction ends the decay below zero: a learning rate
  # would ascend the loss, an exponent p turn minimality around.
  for name in ("lr_final_frac", "p_final_frac"):
    _non_negative(name, getattr(config, name))
  if config.importance_penalty == "lp" and config.p_start <= 0:
    raise ValueError(f"--p_start must be positive, got {config.p_start}: "
                     "minimality raises CI to the power p, and at p = 0 it "
                     "is a constant that trains nothing (p < 0 rewards "
                     "large CI); the SPD recipes use 1 or 2")


def _validate_coefficients(config: TrainConfig) -> None:
  """Raise ValueError for a negative coefficient or no reconstruction term
  (the terms from `recipe.terms`)."""
  for term in terms.TERMS:
    _non_negative(term.coeff_flag, terms.coeff_of(config, term))
  # The non-target stream's terms are checked with its stream.
  recon = [t for t in terms.TERMS if t.recon and not t.stream]
  if not any(terms.coeff_of(config, t) for t in recon):
    names = [f"--{t.coeff_flag}" for t in recon]
    raise ValueError(f"no reconstruction term: set {', '.join(names[:-1])} "
                     f"or {names[-1]} above 0")


def _validate_term_settings(config: TrainConfig) -> None:
  """Raise ValueError for a bad setting of an enabled term."""
  for name in ("pgd_n_warmup", "fresh_pgd_steps"):
    _non_negative(name, getattr(config, name))
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
  riders = terms.RIDER_TERMS
  for name in config.hidden_terms:
    if name not in riders:
      raise ValueError(f"--hidden_terms names {name!r}, not a recon term "
                       f"that takes a rider; use {', '.join(riders)}")
    if not terms.coeff_of(config, riders[name]):
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


def _validate_streams(config: TrainConfig) -> None:
  """Raise ValueError for a targeted run's bad stream settings
  (`recipe.streams.check`)."""
  for name in ("target_batch_size", "nontarget_batch_size",
               "target_seq_len", "nontarget_seq_len", "ci_scaled_decay"):
    _non_negative(name, getattr(config, name))
  streams.check(config)


def _validate_roles(config: TrainConfig) -> None:
  """Raise ValueError for bad dual-role CI settings."""
  with setting("ci_roles"):
    ci_fns.parse_roles(config.ci_roles)
  _non_negative("hidden_pass_coeff", config.hidden_pass_coeff)
  points = config.hidden_pass_points
  twice = sorted({p for p in points if points.count(p) > 1})
  if twice:
    raise ValueError(f"--hidden_pass_points lists {', '.join(twice)} twice; "
                     "name each activation once")
  if ci_fns.HIDDEN not in config.ci_roles and config.hidden_pass_points:
    raise ValueError("--hidden_pass_points names what the hidden role's "
                     "passes reconstruct; add --ci_roles=output,hidden or "
                     "drop it")


# Seeds become JAX keys, which keep 32 bits: a larger or negative seed
# would silently name the same key as one in range (2**32 is seed 0).
SEED_LIMIT = 2**32
SEED_FLAGS = ("seed", "target_seed", "eval_seed")


def _validate_seeds(config: TrainConfig) -> None:
  """Raise ValueError for a seed (or a `--restarts` candidate's seed)
  outside [0, 2**32)."""
  for name in SEED_FLAGS:
    value = getattr(config, name)
    if value is not None and not 0 <= value < SEED_LIMIT:
      raise ValueError(f"--{name}={value} must lie in [0, 2**32) "
                       f"(0..{SEED_LIMIT - 1})")
  last = restarts.candidate_seed(config.seed, config.restarts - 1)
  if config.restarts > 1 and last >= SEED_LIMIT:
    raise ValueError(f"--restarts={config.restarts} gives candidate seeds up "
                     f"to {last}, past 2**32 - 1; lower --seed")


def _validate_output_dir(config: TrainConfig) -> None:
  """Raise ValueError for an empty `--output_dir`, which would make the
  working directory the run directory (an unset shell variable does it)."""
  if config.output_dir is not None and not config.output_dir.strip():
    raise ValueError(f"--output_dir={config.output_dir!r} names no directory; "
                     "name the run directory, or drop the flag for "
                     "runs/<target>")


def _validate_run(config: TrainConfig) -> None:
  """Raise ValueError for bad run directory, seed, checkpoint, init or
  profile settings."""
  _validate_output_dir(config)
  _validate_seeds(config)
  for name in ("save_every", "keep_last", "max_skipped_in_a_row"):
    _positive(name, getattr(config, name))
  if not 0.0 < config.max_skipped_share <= 1.0:
    raise ValueError("--max_skipped_share must lie in (0, 1], got "
                     f"{config.max_skipped_share}")
  checkpointing.parse_init_from(config.init_from)
  run_records.parse_profile_steps(config.profile_steps, config.num_steps)
  _validate_stop(config)
  _validate_restarts(config)


def _validate_restarts(config: TrainConfig) -> None:
  """Raise ValueError unless --restarts and --select_at make a selection
  that is saved and evaluated at the chosen step (or ask for none)."""
  _positive("restarts", config.restarts)
  select = config.select_at
  if config.restarts == 1:
    if select:
      raise ValueError(f"--select_at={select} compares restart candidates; "
                       "set --restarts above 1 or drop --select_at")
    return
  if not 0 < select < config.num_steps:
    raise ValueError(f"--restarts={config.restarts} needs --select_at in "
                     f"(0, --num_steps={config.num_steps}), the step at "
                     "which the candidates are compared")
  if not config.eval_every or select % config.eval_every:
    raise ValueError(f"--select_at={select} must be a multiple of "
                     f"--eval_every={config.eval_every}, so every candidate "
                     "has a held-out loss there")
  if config.checkpointing != "periodic" or select % config.save_every:
    raise ValueError(f"--select_at={select} must be a multiple of "
                     f"--save_every={config.save_every} with periodic "
                     "checkpointing, so the chosen candidate continues")
  if config.stop_after_step:
    raise ValueError("--stop_after_step stops one run; a --restarts run "
                     "resumes by rerunning its command instead")
  if config.init_from:
    raise ValueError("--restarts starts candidates from fresh seeds; with "
                     "--init_from they would share one start: drop one")


def _validate_stop(config: TrainConfig) -> None:
  """Raise ValueError unless --stop_after_step lands on a saved, evaluated
  step inside the schedule."""
  stop = config.stop_after_step
  if not stop:
    return
  if not 0 < stop < config.num_steps:
    raise ValueError(f"--stop_after_step={stop} must lie in (0, "
                     f"--num_steps={config.num_steps}); 0 turns it off")
  if config.checkpointing != "periodic" or stop % config.save_every:
    raise ValueError(f"--stop_after_step={stop} must be a multiple of "
                     f"--save_every={config.save_every} with periodic "
                     "checkpointing, or the stop is not saved")
  if config.eval_every and stop % config.eval_every:
    raise ValueError(f"--stop_after_step={stop} must be a multiple of "
                     f"--eval_every={config.eval_every}")


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
  _validate_streams(config)
  _validate_roles(config)
