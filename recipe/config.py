"""The settings of one decomposition run: `TrainConfig`, each declared once.

`TrainConfig` holds every setting of a run, each written once: a field
named as the `bin/train` flag that sets it, with its type, its default and,
in its metadata (`Doc`), the help text the flag shows and the domain of
values it takes (`Domain`: bounds, choices, whether it may be empty);
`bin/train_flags` generates the flags from the fields, and `TOPICS` groups
them for `--helpfull`. Every config is checked against the domains as it
is built (`check_fields`, from `__post_init__`, so `dataclasses.replace`
too); the rules that join settings are `recipe.checks`, run by every
reader of settings (`recipe.flagfiles.read_args`, `bin/train`). Each
library config built from these values checks itself in its constructor
too, and `setting` names the field of a value such a constructor refused,
as `--name: why`.

This module imports no other module of `recipe`: the settings sit below
everything that reads them.
"""

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from decompax.core.masks import ROUTINGS


class Domain(NamedTuple):
  """The values a setting takes; `check_fields` refuses any other.

  A number, or each number of a list setting, lies between `low` and
  `high` (None: no bound), each bound closed unless `open_low` /
  `open_high`, and is finite. A string setting with `choices` takes one
  of them. A text or list setting may be empty unless `empty` is False.
  `numbers` marks a list setting whose entries are finite numbers
  (`plain`) or `kind:number` pairs whose number may be `none` (`keyed`);
  the entries stay strings. An optional setting may always be None
  (unset). `why` completes a refusal: after a number's bounds, or in place
  of "is empty".
  """

  low: int | float | None = None
  high: int | float | None = None
  open_low: bool = False
  open_high: bool = False
  choices: tuple[str, ...] | None = None
  empty: bool = True
  numbers: str | None = None
  why: str = ""


# Any value of the setting's type (a number: any finite one).
ANY = Domain()
POSITIVE = Domain(low=0, open_low=True)
NON_NEGATIVE = Domain(low=0)
# A fraction of the schedule's steps, before its last.
FRACTION = Domain(low=0, high=1, open_high=True)
# A share of something that must not be none of it.
SHARE = Domain(low=0, high=1, open_low=True)
PROBABILITY = Domain(low=0, high=1)
# Seeds become JAX keys, which keep 32 bits: a larger or negative seed
# would silently name the same key as one in range (2**32 is seed 0).
SEED_LIMIT = 2**32
SEED = Domain(low=0, high=SEED_LIMIT, open_high=True)
NUMBERS = Domain(numbers="plain")
KEYED_NUMBERS = Domain(numbers="keyed")


def one_of(*choices: str) -> Domain:
  """Return the domain of a string setting taking one of `choices`."""
  return Domain(choices=choices)


class Doc(NamedTuple):
  """What a setting's flag shows and accepts beyond its type and default:
  its help text and its domain."""

  help: str
  domain: Domain

  @property
  def choices(self) -> tuple[str, ...] | None:
    return self.domain.choices

  @property
  def numbers(self) -> str | None:
    return self.domain.numbers


def _setting(default: Any, help_text: str, domain: Domain) -> Any:
  return dataclasses.field(
    default=default, metadata={"doc": Doc(help_text, domain)})


def doc(field: dataclasses.Field) -> Doc:
  """Return the help text and domain of a `TrainConfig` field."""
  return field.metadata["doc"]


CI_FNS = ("component_mlp", "vector_mlp", "site_mlp", "global_mlp",
          "transformer")
_ATTENTIONS = ("reference", "xla", "cudnn", "auto")
_SCHEDULES = ("constant", "linear", "cosine")
_PLANS = ("all_sites", "per_site", "subset", "groups")



@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Every setting of one decomposition run (see the module docstring)."""

  target: str = _setting(
    "tms_5-2",
    "Toy target: tms_5-2, tms_5-2-id, tms_40-10, tms_40-10-id, resid_mlp1, "
    "resid_mlp2, resid_mlp3, simple_mlp, induction or addsub (a ± b mod 23 "
    "plus copying); or hf, a language model read from --model_dir.",
    Domain(empty=False))
  target_seed: int | None = _setting(
    None,
    "Seed of the target's own training (default: the target's known-good "
    "seed).", SEED)
  target_path: str | None = _setting(
    None,
    "Cached trained target (.npz); trained and written there when absent. "
    "Default: <output_dir>/target.npz.", ANY)
  model_dir: str | None = _setting(
    None,
    "--target=hf: local Hugging Face checkpoint directory (config.json and "
    "safetensors).", ANY)
  seq_len: int = _setting(64, "Tokens per sequence of a --target=hf batch.",
    POSITIVE)
  data_path: str | None = _setting(
    None,
    "--target=hf: token file (NAME.bin from bin/tokenize) the training "
    "batches are read from; default: uniform random token ids.", ANY)
  eval_data_path: str | None = _setting(
    None,
    "--target=hf: held-out token file of the eval batches; default: windows "
    "of --data_path on a stream of their own (not held-out text).", ANY)
  attention: str = _setting(
    "reference",
    "Attention of LM targets: plain einsums, or jax.nn.dot_product_attention "
    "with implementation xla, cudnn or JAX's choice (auto).",
    one_of(*_ATTENTIONS))
  output_chunk: int = _setting(
    0,
    "--target=hf: the train step's output KL runs the LM head over chunks "
    "of this many positions, each recomputed in the backward, so the whole "
    "[tokens, vocab] logits never exist (same values and gradients); 0: "
    "whole logits. Evals always read whole logits.", NON_NEGATIVE)
  compute_dtype: str = _setting(
    "bfloat16",
    "Dtype of --target=hf frozen weights and activations (SPEC N4).",
    one_of("bfloat16", "float32"))
  sites: tuple[str, ...] = _setting(
    (),
    "Sites to decompose, comma-separated (default: all); --target=hf also "
    "takes shell patterns, e.g. 'layers.18.mlp.*'.", ANY)
  c: int = _setting(20, "Components per decomposed matrix.", POSITIVE)
  ci_fn: str = _setting(
    "component_mlp",
    "Causal-importance function: the toy MLPs of SPEC §4.2 or the chunkwise "
    "transformer of §4.3 (LMs: one chunk per decomposed block reading "
    "resid.<block>; toys: one chunk per site reading its input).",
    one_of(*CI_FNS))
  ci_hidden: tuple[int, ...] = _setting(
    (16,),
    "Hidden widths of the CI function (d_gate for component/vector MLPs).",
    POSITIVE)
  ci_d_model: int = _setting(
    64,
    "Transformer CI: width of each chunk's transformer.", POSITIVE)
  ci_n_blocks: int = _setting(
    2,
    "Transformer CI: blocks per chunk (0 allowed).", NON_NEGATIVE)
  ci_n_heads: int = _setting(
    4,
    "Transformer CI: attention heads (head dim must be even).", POSITIVE)
  ci_n_kv_heads: int | None = _setting(
    None,
    "Transformer CI: key/value heads (default: --ci_n_heads, i.e. multi-head "
    "attention).", POSITIVE)
  ci_d_mlp: int = _setting(256, "Transformer CI: MLP width of each block.",
    POSITIVE)
  ci_attention: str = _setting(
    "reference",
    "Transformer CI attention: the portable einsum reference, or "
    "jax.nn.dot_product_attention with that implementation (auto: JAX picks).",
    one_of(*_ATTENTIONS))
  ci_remat: bool = _setting(
    False,
    "Transformer CI: recompute every block activation in the backward pass "
    "instead of keeping the matmul outputs.", ANY)
  faithfulness_coeff: float = _setting(
    1.0,
    "Coefficient of the faithfulness loss.", NON_NEGATIVE)
  faithfulness_form: str = _setting(
    "global",
    "Faithfulness as the mean squared delta over every entry (global, the "
    "SPD paper's) or the mean over sites of ‖W − VU‖²/‖W‖² (relative: every "
    "site weighs the same whatever its size).",
    one_of("global", "relative"))
  importance_coeff: float = _setting(
    0.003,
    "Coefficient of importance minimality.", NON_NEGATIVE)
  importance_site_weights: tuple[str, ...] = _setting(
    (),
    "Per-site weight of importance minimality, site_glob:weight (e.g. "
    "layers.0.*:4): a site takes the last matching entry's weight, 1 where "
    "none matches; each glob must name a site (default: 1 everywhere).",
    KEYED_NUMBERS)
  p_start: float = _setting(
    1.0,
    "Exponent p of importance minimality at step 0.", ANY)
  p_schedule: str = _setting(
    "constant",
    "Anneal of p (no warmup: the p-anneal refuses one).",
    one_of(*_SCHEDULES))
  p_final_frac: float = _setting(1.0, "Final p as a fraction of --p_start.",
    NON_NEGATIVE)
  p_knots: str = _setting(
    "",
    "Knot form of the p anneal instead of --p_schedule: `at:frac[:shape],…` "
    "from at=0 to at=1, p = --p_start·frac, shape linear|cosine|hold for the "
    "segment a knot starts (e.g. 0:1:cosine,0.5:0.4,1:0.4).", ANY)
  importance_penalty: str = _setting(
    "lp",
    "What minimality raises CI to: lp, (c + ε)^p; smooth_l0, c²/(c² + γ²) "
    "with γ on its own schedule (p is then unused).",
    one_of("lp", "smooth_l0"))
  smooth_l0_gamma: float = _setting(1.0, "γ of smooth-L0 at step 0 (> 0).",
    POSITIVE)
  smooth_l0_gamma_schedule: str = _setting(
    "linear",
    "Anneal of γ (no warmup).",
    one_of(*_SCHEDULES))
  smooth_l0_gamma_final_frac: float = _setting(
    0.01,
    "Final γ as a fraction of --smooth_l0_gamma (ignored when constant).",
    NON_NEGATIVE)
  smooth_l0_normalized: bool = _setting(
    False,
    "Scale smooth-L0 by 1 + γ², so a fully active component counts 1 at any "
    "γ.", ANY)
  importance_eps: float = _setting(
    1e-12,
    "ε inside the power of importance minimality.", NON_NEGATIVE)
  frequency_coeff: float = _setting(
    0.0,
    "Coefficient of frequency minimality (0: off).", NON_NEGATIVE)
  reference_token_count: float | None = _setting(
    None,
    "a' of frequency minimality (default: the batch's token count).", POSITIVE)
  stochastic_coeff: float = _setting(
    1.0,
    "Stochastic recon with all sites live (0: off).", NON_NEGATIVE)
  stochastic_routing: str = _setting(
    "all",
    "Routing of the all-sites stochastic term.",
    one_of(*ROUTINGS))
  per_site_coeff: float = _setting(
    1.0,
    "Stochastic recon with one site live at a time (the SPD layerwise loss; "
    "0: off).", NON_NEGATIVE)
  subset_coeff: float = _setting(
    0.0,
    "Stochastic recon over consecutive site chunks (0: off).", NON_NEGATIVE)
  subset_size: int = _setting(2, "Sites per chunk of the subset term.",
    POSITIVE)
  subset_routing: str = _setting(
    "uniform_k",
    "Routing within each chunk of the subset term.",
    one_of(*ROUTINGS))
  n_mask_samples: int = _setting(1, "Stochastic draws per plan entry per step.",
    POSITIVE)
  sampling: str = _setting(
    "continuous",
    "Stochastic source distribution.",
    one_of("continuous", "binomial"))
  use_delta_component: bool = _setting(
    False,
    "Add the maskable delta channel W − VU.", ANY)
  lr: float = _setting(0.001, "Peak learning rate of the components.", POSITIVE)
  lr_schedule: str = _setting(
    "cosine",
    "Learning-rate decay of both optimizers.",
    one_of(*_SCHEDULES))
  lr_final_frac: float = _setting(
    0.0,
    "Final learning rate as a fraction of the peak.", NON_NEGATIVE)
  lr_warmup_pct: float = _setting(
    0.0,
    "Fraction of steps of linear learning-rate warmup.", FRACTION)
  lr_knots: str = _setting(
    "",
    "Knot form of the learning-rate schedule instead of --lr_schedule, "
    "--lr_final_frac and --lr_warmup_pct: `at:frac[:shape],…` from at=0 to "
    "at=1 (at = step/(num_steps − 1)), lr = --lr·frac, shape "
    "linear|cosine|hold for the segment a knot starts; e.g. a 5% warmup then "
    "cosine to 0: 0:0,0.05:1:cosine,1:0.", ANY)
  route_probability: float = _setting(
    0.5,
    "p of static_probability routing (any *_routing flag): each position "
    "routes to each live site independently with probability p (SPEC §5.4).",
    SHARE)
  weight_decay: float = _setting(
    0.0,
    "AdamW weight decay of components and CI function.", NON_NEGATIVE)
  clip_max_norm: float = _setting(
    0.0,
    "Global-norm clip of component gradients (0: off).", NON_NEGATIVE)
  ci_lr: float | None = _setting(
    None,
    "Peak learning rate of the CI function (default: --lr).", POSITIVE)
  num_steps: int = _setting(40000, "Training steps.", POSITIVE)
  batch_size: int = _setting(4096, "Batch size.", POSITIVE)
  seed: int = _setting(
    2,
    "Seed of init, masks and data. TMS 5-2 recovers on any seed measured "
    "with the --restarts of flags/tms_5-2.flags (README).", SEED)
  eval_seed: int | None = _setting(
    None,
    "Seed of the held-out eval batches (default: --seed). Runs compared by "
    "their held-out losses, e.g. restarts with different --seed, share one.",
    SEED)
  restarts: int = _setting(
    1,
    "Candidate runs to choose among (1: none). Candidate j trains with seed "
    "--seed + 1000·j in <output_dir>/candidates/r<j> up to --select_at; the "
    "one with the lowest held-out total loss there (all scored on the "
    "held-out batches of --eval_seed, default --seed) continues to "
    "--num_steps. The choice reads the loss only, never a recovery metric.",
    POSITIVE)
  select_at: int = _setting(
    0,
    "Step at which --restarts candidates are compared; a multiple of "
    "--save_every and --eval_every inside the schedule.", NON_NEGATIVE)
  faithfulness_warmup_steps: int = _setting(
    0,
    "Faithfulness-only AdamW steps first (the SPD paper's recipes take none).",
    NON_NEGATIVE)
  faithfulness_warmup_lr: float = _setting(0.01, "Learning rate of the warmup.",
    POSITIVE)
  faithfulness_warmup_weight_decay: float = _setting(
    0.1,
    "Weight decay of the warmup.", NON_NEGATIVE)
  output_dir: str | None = _setting(
    None,
    "Run directory (default: runs/<target>). Its parent must exist.",
    Domain(empty=False, why="names no directory; name the run directory, or "
           "drop the flag for runs/<target>"))
  overwrite: bool = _setting(
    False,
    "Replace a run in --output_dir made with other flags.", ANY)
  log_every: int = _setting(
    500,
    "Steps between progress lines and metrics records.", POSITIVE)
  figures_every: int = _setting(
    0,
    "Steps between figure refreshes (0: at the end only).", NON_NEGATIVE)
  ci_alive_threshold: float = _setting(
    0.1,
    "CI above which a component counts in CI-L0.",
    Domain(low=0, high=1, open_high=True, why="the range of CI"))
  eval_every: int = _setting(
    1000,
    "Steps between fast evals on held-out batches (CI-L0, alive counts, "
    "masked recon family, loss terms); a multiple of --log_every; also at "
    "the last step, and at step 0 of a fresh run (0: no eval).", NON_NEGATIVE)
  slow_eval_every: int = _setting(
    10000,
    "Steps between slow evals (CI histograms and densities, "
    "hidden-activation recon, figures, report); a multiple of --eval_every; "
    "also at the last step (0: none).", NON_NEGATIVE)
  figure_cpu_share: float = _setting(
    0.05,
    "Most of one CPU core that drawing the slow evals' figures may take over "
    "a run; at a shorter cadence some slow evals are not drawn, the last one "
    "always is (1: draw each as soon as the last is done).", SHARE)
  eval_batches: int = _setting(4, "Held-out batches of --batch_size per eval.",
    POSITIVE)
  slow_on_first_step: bool = _setting(
    True,
    "Run the slow eval at step 0 of a fresh run.", ANY)
  eval_pgd_steps: int = _setting(
    20,
    "Sign-PGD ascents of the fast eval's fresh-PGD probe (eval/recon/pgd: "
    "every site routed, random sources per site; 0: off).", NON_NEGATIVE)
  eval_pgd_lr: float = _setting(0.1, "Step size of the eval's fresh-PGD probe.",
    POSITIVE)
  eval_attention_kl: bool = _setting(
    False,
    "Fast evals also score attention patterns: per block with a decomposed "
    "q_proj or k_proj, eval/attn_kl/{ci_masked,stochastic}/layers.<i> is "
    "KL(clean || masked) of its attention rows, averaged over query heads, "
    "positions and eval batches (/all: over the blocks). LM targets only "
    "(hf, induction).", ANY)
  groups_coeff: float = _setting(
    0.0,
    "Stochastic recon over --recon_groups (0: off).", NON_NEGATIVE)
  recon_groups: str = _setting(
    "",
    "Site groups for plans of kind `groups`: sites joined by '+', groups by "
    "';' (e.g. 'linear1+linear2;linear2').", ANY)
  groups_routing: str = _setting(
    "uniform_k",
    "Routing within each group of the groups term.",
    one_of(*ROUTINGS))
  ema_halflife_steps: float = _setting(
    0.0,
    "Half-life (steps) of the running firing estimate of frequency "
    "minimality (0: per-batch estimate).", NON_NEGATIVE)
  pgd_coeff: float = _setting(0.0, "Persistent PGD recon term (0: off).",
    NON_NEGATIVE)
  pgd_plan: str = _setting(
    "all_sites",
    "Plan of the persistent PGD term.",
    one_of(*_PLANS))
  pgd_routing: str = _setting(
    "all",
    "Routing of the PGD plan.",
    one_of(*ROUTINGS))
  pgd_scope: str = _setting(
    "c",
    "Axes a persistent source keeps: c (shared over batch), bc (per "
    "example); sc/bsc need positions.",
    one_of("c", "bc", "sc", "bsc"))
  pgd_parametrization: str = _setting(
    "clamp",
    "Persistent source storage: clamped to [0,1] or raw through a sigmoid.",
    one_of("clamp", "sigmoid"))
  pgd_step_rule: str = _setting(
    "adam",
    "Persistent source ascent rule.",
    one_of("adam", "sign"))
  pgd_lr: float = _setting(0.01, "Persistent source step size.", POSITIVE)
  pgd_lr_warmup_pct: float = _setting(
    0.0,
    "Fraction of steps of source LR warmup.", FRACTION)
  pgd_betas: tuple[str, ...] = _setting(
    ('0.5', '0.99'),
    "Source Adam betas b1,b2.",
    NUMBERS)
  pgd_eps: float = _setting(1e-08, "Source Adam eps (after the root).",
    NON_NEGATIVE)
  pgd_n_warmup: int = _setting(0, "Supplemental all-site ascents per step.",
    NON_NEGATIVE)
  pgd_objective: str = _setting(
    "e2e",
    "What the adversary ascends.",
    one_of("e2e", "term"))
  pgd_start_frac: float = _setting(
    0.0,
    "Fraction of steps before the PGD term starts.", FRACTION)
  merged_coeff: float = _setting(
    0.0,
    "Merged stochastic/persistent recon term (SPEC §5.8; 0: off). Its "
    "sources step with the --pgd_* settings.", NON_NEGATIVE)
  merged_plan: str = _setting(
    "all_sites",
    "Plan of the merged term.",
    one_of(*_PLANS))
  merged_routing: str = _setting(
    "uniform_k",
    "Routing of the merged term's stochastic rows.",
    one_of(*ROUTINGS))
  merged_adv_fraction: float = _setting(
    0.5,
    "Probability that a batch row of the merged term uses the persistent "
    "sources, at step 0.", PROBABILITY)
  merged_adv_fraction_final_frac: float = _setting(
    1.0,
    "Final adversarial fraction as a fraction of the first (linear anneal "
    "when ≠ 1).", NON_NEGATIVE)
  hidden_coeff: float = _setting(
    0.0,
    "Hidden-activation reconstruction rider (SPEC §5.9) on the "
    "--hidden_terms (0: off).", NON_NEGATIVE)
  hidden_points: tuple[str, ...] = _setting(
    (),
    "Activations the rider matches (tap keys; default: every decomposed "
    "site's output, <site>.out).", ANY)
  hidden_terms: tuple[str, ...] = _setting(
    (),
    "Recon terms the rider rides on: stochastic_recon, "
    "stochastic_recon_per_site, stochastic_recon_subset, "
    "stochastic_recon_groups, persistent_pgd_recon, merged_recon.", ANY)
  fresh_pgd_coeff: float = _setting(
    0.0,
    "Fresh (per-step) PGD recon term (0: off).", NON_NEGATIVE)
  fresh_pgd_init: str = _setting(
    "random",
    "Initial fresh PGD sources.",
    one_of("random", "ones", "zeroes"))
  fresh_pgd_scope: str = _setting(
    "c",
    "Fresh PGD source scope.",
    one_of("c", "bc", "bsc"))
  fresh_pgd_steps: int = _setting(1, "Sign ascents of fresh PGD per step.",
    NON_NEGATIVE)
  fresh_pgd_step_size: float = _setting(0.1, "Fresh PGD ascent step size.",
    POSITIVE)
  fresh_pgd_routing: str = _setting(
    "all",
    "Fresh PGD routing.",
    one_of(*ROUTINGS))
  nonlinearity_coeff: float = _setting(
    0.0,
    "Nonlinearity locality loss (0: off).", NON_NEGATIVE)
  nonlinearity_threshold: float = _setting(
    1.0,
    "Soft-count threshold t at step 0.", POSITIVE)
  nonlinearity_threshold_final_frac: float = _setting(
    1.0,
    "Final threshold as a fraction of the first (linear anneal when ≠ 1).",
    NON_NEGATIVE)
  nonlinearity_weights: tuple[str, ...] = _setting(
    (),
    "Per unit kind weight, kind:weight or kind:none (default: weight 1 for "
    "every kind the target has).",
    KEYED_NUMBERS)
  components_optimizer: str = _setting(
    "adamw",
    "Optimizer of the components (the CI function always uses AdamW).",
    one_of("adamw", "muon"))
  components_init: str = _setting(
    "normal",
    "V/U init: normal (V ~ N/√d_in, U ~ N/√C; SPEC §6.1) or projected (unit "
    "vectors scaled by their overlap with W; the SPD paper's).",
    one_of("normal", "projected"))
  checkpointing: str = _setting(
    "periodic",
    "periodic: save to <output_dir>/checkpoints after warmup, every "
    "--save_every steps, at the end and on SIGTERM/SIGINT (then exit 75, "
    "EX_TEMPFAIL, for a requeue); the same command resumes. none: save "
    "nothing; the run directory then cannot be re-entered.",
    one_of("periodic", "none"))
  save_every: int = _setting(1000, "Steps between periodic checkpoints.",
    POSITIVE)
  stop_after_step: int = _setting(
    0,
    "Train only up to this step of the --num_steps schedule, save and exit "
    "0; rerun without it (or with a later step) to continue. A multiple of "
    "--save_every and --eval_every, so the stop is saved and evaluated. 0: "
    "off. May change between launches.", NON_NEGATIVE)
  keep_last: int = _setting(
    3,
    "Checkpoints kept, newest first (the final one is never pruned).", POSITIVE)
  keep_all: bool = _setting(
    False,
    "Keep every checkpoint (overrides --keep_last).", ANY)
  on_nonfinite: str = _setting(
    "stop",
    "A step whose losses or updated state hold NaN or infinity. stop: save "
    "nothing from it and exit 3 at the next log step or save, naming the "
    "step, its first non-finite term and the newest good checkpoint. skip: "
    "drop that update (the step counter still moves on) and count it in the "
    "metrics as nonfinite/steps. May differ between launches of a run.",
    one_of("stop", "skip"))
  max_skipped_in_a_row: int = _setting(
    100,
    "With --on_nonfinite=skip: stop as a diverged run once this many updates "
    "in a row were non-finite (a run that cannot recover). May differ "
    "between launches of a run.", POSITIVE)
  max_skipped_share: float = _setting(
    0.1,
    "With --on_nonfinite=skip: stop as a diverged run once more than this "
    "share of --num_steps updates were non-finite, in a row or not (a run "
    "that mostly trained nothing; 1: no limit). May differ between launches "
    "of a run.", SHARE)
  init_from: str | None = _setting(
    None,
    "Fine-tune init: <run_dir>/<step> or <run_dir>/latest. Starts from that "
    "run's decomposition with fresh optimizers, adversaries, EMA and step 0, "
    "no warmup; its sites, C and CI function must match.", ANY)
  steps_per_call: int = _setting(
    0,
    "Training steps per compiled call, run as one loop inside the program "
    "(small models spend most of a step in dispatch on an accelerator). "
    "Logging, evals, checkpoints, the profile window and the stop-signal "
    "check run between calls, and a call ends early at every step where "
    "the loop logs, saves or starts or stops the profile, so the run, its "
    "logged metrics (each log step's own) and its checkpoints are bitwise "
    "those of one step per call; a stop signal is serviced at the end of "
    "the call it arrives in (where XLA compiles the loop's body as it "
    "compiles the step alone: on a CPU, not on a TPU). 0: auto, 1 on every "
    "platform (on a TPU, 64 a call measured no faster for ResidMLP-3, whose "
    "step is compute, and not bitwise; docs/performance.md); runs reading "
    "token files (--data_path, --target_data_path, --nontarget_data_path) "
    "take one step per call. May change between launches of a run.",
    NON_NEGATIVE)
  profile_steps: str = _setting(
    "",
    "START:END writes a jax.profiler trace of steps [START, END) to "
    "<output_dir>/profile (empty: no trace).", ANY)
  target_task: str = _setting(
    "",
    "Targeted decomposition: the built-in task of the target stream (addsub: "
    "two-operand a±b mod P prompts), whose mechanism is wanted.", ANY)
  target_data_path: str | None = _setting(
    None,
    "Targeted decomposition: a token file as the target stream (instead of "
    "--target_task).", ANY)
  target_batch_size: int = _setting(
    0,
    "Target stream's batch size (0: --batch_size).", NON_NEGATIVE)
  target_seq_len: int = _setting(
    0,
    "Sequence length of a token-file target stream (0: --seq_len); a task "
    "fixes its own.", NON_NEGATIVE)
  target_loss_positions: str = _setting(
    "answer",
    "Where the target stream's output divergence is scored: the task's "
    "answer positions, or every position.",
    one_of("answer", "all"))
  nontarget_task: str = _setting(
    "",
    "Targeted decomposition: the built-in task of the non-target stream "
    "(copy: induction copying over the task model's vocabulary); its masked "
    "forwards pin the delta path on (δ ≡ 1).", ANY)
  nontarget_data_path: str | None = _setting(
    None,
    "Targeted decomposition: a token file as the non-target stream.", ANY)
  nontarget_batch_size: int = _setting(
    0,
    "Non-target stream's batch size (0: --batch_size).", NON_NEGATIVE)
  nontarget_seq_len: int = _setting(
    0,
    "Sequence length of a token-file non-target stream (0: --seq_len).",
    NON_NEGATIVE)
  nontarget_recon_coeff: float = _setting(
    0.0,
    "Non-target stream's delta-pinned reconstruction (required above 0 in a "
    "targeted run).", NON_NEGATIVE)
  nontarget_sources: str = _setting(
    "stochastic",
    "Non-target masks: ci + (1 − ci)·U[0,1] (stochastic) or the lower CI "
    "itself (constant source 0).",
    one_of("stochastic", "constant"))
  nontarget_unmasked_coeff: float = _setting(
    0.0,
    "Non-target unmasked-no-delta reconstruction: every mask 1, delta off "
    "(0: off).", NON_NEGATIVE)
  nontarget_importance_coeff: float = _setting(
    0.0,
    "Importance minimality on the non-target stream's CI (0: off).",
    NON_NEGATIVE)
  nontarget_pgd_coeff: float = _setting(
    0.0,
    "Non-target persistent PGD recon, its own sources, settings of --pgd_* "
    "(0: off).", NON_NEGATIVE)
  nontarget_merged_coeff: float = _setting(
    0.0,
    "Non-target merged stochastic/persistent recon, its own sources, "
    "settings of --merged_* (0: off).", NON_NEGATIVE)
  ci_scaled_decay: float = _setting(
    0.0,
    "Targeted decomposition: after each update V[:,c], U[c,:] *= 1 − "
    "lr·decay·(1 − max CI of c over both streams' batches) (0: off).",
    NON_NEGATIVE)
  ci_roles: tuple[str, ...] = _setting(
    ('output',),
    "CI readouts: output, or output,hidden for dual-role CI (one shared "
    "trunk, two heads; every recon and importance term also runs in each "
    "stream's hidden pass on the hidden role's masks).", ANY)
  hidden_pass_points: tuple[str, ...] = _setting(
    (),
    "Activations a hidden pass reconstructs, each as MSE relative to its own "
    "clean scale (default: the MLP outputs from the first decomposed layer "
    "to the last; a toy's site outputs).", ANY)
  hidden_pass_coeff: float = _setting(
    1.0,
    "The hidden passes' recon terms run at their term's coefficient times "
    "this.", NON_NEGATIVE)
  sequential_passes: bool = _setting(
    False,
    "Score the step's passes (stream × CI role) one at a time behind an "
    "optimization barrier and add their gradients: the same objective, with "
    "one pass's masked forwards in memory at a time.", ANY)
  ab_grid: str = _setting(
    "auto",
    "Targeted decomposition: the A/B grid page of each slow eval (auto: when "
    "the target stream is a two-operand task; on: refuse a run where it is "
    "not; off: never).",
    one_of("auto", "on", "off"))

  def __post_init__(self) -> None:
    check_fields(self)


class SettingError(ValueError):
  """A refused setting; the one-line message starts with `--<field>`."""


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


def check_numbers(items: Sequence[str], keyed: bool) -> None:
  """Raise ValueError unless each entry of a `numbers` list setting is a
  finite number or, `keyed`, a `kind:number` pair (`kind:none` and an entry
  without a colon are left to the setting's reader)."""
  for item in items:
    number = item.partition(":")[2] if keyed else item
    if keyed and number in ("", "none"):
      continue
    try:
      finite = math.isfinite(float(number))
    except ValueError:
      finite = False
    if not finite:
      raise ValueError(f"{number!r} is not a finite number")


def _bound_text(bound: int | float) -> str:
  power = int(bound).bit_length() - 1
  return f"2**{power}" if bound == 2**power >= 2**16 else f"{bound}"


def _rule(domain: Domain) -> str:
  """Return what a number of `domain` must be, as a refusal says it."""
  low, high = domain.low, domain.high
  if high is None and low == 0:
    return "be positive" if domain.open_low else "be >= 0"
  if high is None:
    return f"be {'>' if domain.open_low else '>='} {_bound_text(low)}"
  if low is None:
    return f"be {'<' if domain.open_high else '<='} {_bound_text(high)}"
  return (f"lie in {'(' if domain.open_low else '['}{_bound_text(low)}, "
          f"{_bound_text(high)}{')' if domain.open_high else ']'}")


def _inside(value: int | float, domain: Domain) -> bool:
  low, high = domain.low, domain.high
  return math.isfinite(value) and not (
    low is not None and (value <= low if domain.open_low else value < low)
  ) and not (
    high is not None and (value >= high if domain.open_high
                          else value > high))


def _check_numbers(name: str, value: Any, domain: Domain) -> None:
  """Raise SettingError for a number of a setting outside its domain."""
  numbers = value if isinstance(value, tuple) else (value,)
  numbers = [v for v in numbers
             if isinstance(v, (int, float)) and not isinstance(v, bool)]
  if all(_inside(v, domain) for v in numbers):
    return
  whose = f"--{name} entries" if isinstance(value, tuple) else f"--{name}"
  if not all(map(math.isfinite, numbers)):
    raise SettingError(f"{whose} must be finite, got {value}")
  why = f", {domain.why}" if domain.why else ""
  raise SettingError(f"{whose} must {_rule(domain)}{why}, got {value}")


def check_value(name: str, value: Any, domain: Domain) -> None:
  """Raise SettingError, naming the setting `name` and its domain, unless
  `value` lies in `domain`."""
  if value is None:
    return
  if isinstance(value, (str, tuple)) and not domain.empty and not (
      value.strip() if isinstance(value, str) else value):
    raise SettingError(f"--{name}={value!r} {domain.why or 'is empty'}")
  if domain.choices is not None and value not in domain.choices:
    raise SettingError(f"--{name}={value!r} takes one of "
                       f"{', '.join(domain.choices)}")
  if domain.numbers:
    with setting(name):
      check_numbers(value, keyed=domain.numbers == "keyed")
  _check_numbers(name, value, domain)


def check_fields(config: TrainConfig) -> None:
  """Raise SettingError naming the first setting of `config` outside the
  domain its declaration gives (`Domain`); `TrainConfig` runs this on
  every construction, `dataclasses.replace` included."""
  for field in dataclasses.fields(config):
    check_value(field.name, getattr(config, field.name), doc(field).domain)


DEFAULTS = TrainConfig()


# The topics `bin/train --helpfull` groups the settings under, in order;
# every field is in exactly one (tests/recipe/test_config.py).
TOPICS: tuple[tuple[str, tuple[str, ...]], ...] = (
  ("Target and data", (
    "target", "target_seed", "target_path", "model_dir", "seq_len",
    "data_path", "eval_data_path", "attention", "output_chunk",
    "compute_dtype", "sites")),
  ("Components and CI function", (
    "c", "ci_fn", "ci_hidden", "ci_d_model", "ci_n_blocks", "ci_n_heads",
    "ci_n_kv_heads", "ci_d_mlp", "ci_attention", "ci_remat", "ci_roles",
    "components_init", "use_delta_component")),
  ("Faithfulness and minimality", (
    "faithfulness_coeff", "faithfulness_form", "importance_coeff",
    "importance_site_weights", "p_start", "p_schedule", "p_final_frac",
    "p_knots", "importance_penalty", "smooth_l0_gamma",
    "smooth_l0_gamma_schedule", "smooth_l0_gamma_final_frac",
    "smooth_l0_normalized", "importance_eps", "frequency_coeff",
    "reference_token_count", "ema_halflife_steps", "nonlinearity_coeff",
    "nonlinearity_threshold", "nonlinearity_threshold_final_frac",
    "nonlinearity_weights")),
  ("Stochastic reconstruction", (
    "stochastic_coeff", "stochastic_routing", "per_site_coeff",
    "subset_coeff", "subset_size", "subset_routing", "groups_coeff",
    "recon_groups", "groups_routing", "n_mask_samples", "sampling",
    "route_probability", "hidden_coeff", "hidden_points", "hidden_terms")),
  ("Adversarial reconstruction", (
    "pgd_coeff", "pgd_plan", "pgd_routing", "pgd_scope",
    "pgd_parametrization", "pgd_step_rule", "pgd_lr", "pgd_lr_warmup_pct",
    "pgd_betas", "pgd_eps", "pgd_n_warmup", "pgd_objective",
    "pgd_start_frac", "merged_coeff", "merged_plan", "merged_routing",
    "merged_adv_fraction", "merged_adv_fraction_final_frac",
    "fresh_pgd_coeff", "fresh_pgd_init", "fresh_pgd_scope",
    "fresh_pgd_steps", "fresh_pgd_step_size", "fresh_pgd_routing")),
  ("Optimization", (
    "lr", "lr_schedule", "lr_final_frac", "lr_warmup_pct", "lr_knots",
    "weight_decay", "clip_max_norm", "ci_lr", "components_optimizer",
    "num_steps", "batch_size", "faithfulness_warmup_steps",
    "faithfulness_warmup_lr", "faithfulness_warmup_weight_decay")),
  ("Seeds and restarts", (
    "seed", "eval_seed", "restarts", "select_at")),
  ("Evaluation and figures", (
    "log_every", "eval_every", "slow_eval_every", "eval_batches",
    "slow_on_first_step", "ci_alive_threshold", "eval_pgd_steps",
    "eval_pgd_lr", "eval_attention_kl", "figures_every",
    "figure_cpu_share", "ab_grid")),
  ("Run directory, checkpoints and stops", (
    "output_dir", "overwrite", "checkpointing", "save_every",
    "stop_after_step", "keep_last", "keep_all", "on_nonfinite",
    "max_skipped_in_a_row", "max_skipped_share", "init_from",
    "steps_per_call", "profile_steps")),
  ("Targeted decomposition", (
    "target_task", "target_data_path", "target_batch_size",
    "target_seq_len", "target_loss_positions", "nontarget_task",
    "nontarget_data_path", "nontarget_batch_size", "nontarget_seq_len",
    "nontarget_recon_coeff", "nontarget_sources", "nontarget_unmasked_coeff",
    "nontarget_importance_coeff", "nontarget_pgd_coeff",
    "nontarget_merged_coeff", "ci_scaled_decay", "hidden_pass_points",
    "hidden_pass_coeff", "sequential_passes")),
)


# `--restarts` candidate seeds step by this much, far apart from a grid's
# own seeds.
SEED_STRIDE = 1000


def candidate_seed(seed: int, index: int) -> int:
  """Return the seed of `--restarts` candidate `index`."""
  return seed + SEED_STRIDE * index


def steps_per_call(config: TrainConfig) -> int:
  """Return the steps the run takes per compiled call: `--steps_per_call`,
  or its auto value, 1."""
  return config.steps_per_call or 1


def reads_token_files(config: TrainConfig) -> bool:
  """Return whether the host reads the run's batches from token files, one
  per step, instead of the step drawing its own (a targeted run's task
  streams are drawn in the step)."""
  return bool(config.data_path or config.target_data_path
              or config.nontarget_data_path)


def held_out_seed(config: TrainConfig) -> int:
  """Return the seed of the run's held-out batches: `eval_seed`, else
  `seed`. Runs that differ only in `seed` score on the same batches when
  they share an `eval_seed`."""
  return config.seed if config.eval_seed is None else config.eval_seed
