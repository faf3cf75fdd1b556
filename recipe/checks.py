"""The rules that join a run's settings: `check(config)`, for every caller.

A setting's own range, choices and emptiness are its declaration's
(`recipe.config.Domain`), checked whenever a `TrainConfig` is built; here
are the rules between settings: cadences that must divide each other,
terms that need one another, targets a setting applies to, formats of
settings read into windows or paths. `bin/train` (on its parsed flags),
`recipe.flagfiles.read_args` (the benchmarks' and notebooks' reader) and
any library caller that builds a `TrainConfig` itself run the same checks.
Each refusal is one line naming the setting as its `bin/train` flag and
the fix. A value a library config refuses when the run is assembled is
named there (`recipe.config.setting`).
"""

import fnmatch
import os

from decompax.core import ci_fns
from decompax.recipe import streams, terms
from decompax.recipe.config import (
  SEED_LIMIT, TrainConfig, candidate_seed, reads_token_files, setting)


def _validate_eval_cadence(config: TrainConfig) -> None:
  """Raise ValueError unless log_every | eval_every | slow_eval_every."""
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
  """Raise ValueError for a cadence, eval or LM-head setting that does not
  fit the others."""
  _validate_eval_cadence(config)
  _validate_eval_attention(config)
  if config.output_chunk and config.target != "hf":
    raise ValueError(f"--output_chunk chunks an LM head, and --target="
                     f"{config.target} has none; drop --output_chunk or use "
                     "--target=hf")


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
  if config.importance_penalty == "lp" and config.p_start <= 0:
    raise ValueError(f"--p_start must be positive, got {config.p_start}: "
                     "minimality raises CI to the power p, and at p = 0 it "
                     "is a constant that trains nothing (p < 0 rewards "
                     "large CI); the SPD recipes use 1 or 2")


def _validate_coefficients(config: TrainConfig) -> None:
  """Raise ValueError for no reconstruction term (the terms from
  `recipe.terms`)."""
  # The non-target stream's terms are checked with its stream.
  recon = [t for t in terms.TERMS if t.recon and not t.stream]
  if not any(terms.coeff_of(config, t) for t in recon):
    names = [f"--{t.coeff_flag}" for t in recon]
    raise ValueError(f"no reconstruction term: set {', '.join(names[:-1])} "
                     f"or {names[-1]} above 0")


def _validate_term_settings(config: TrainConfig) -> None:
  """Raise ValueError for a bad setting of an enabled term."""
  if config.ema_halflife_steps and not config.frequency_coeff:
    raise ValueError("--ema_halflife_steps needs --frequency_coeff above 0")
  if len(config.pgd_betas) != 2:
    raise ValueError("--pgd_betas takes two values, b1,b2")
  # The first fraction's own domain is [0, 1]; the anneal must end there.
  final = config.merged_adv_fraction * config.merged_adv_fraction_final_frac
  if not 0.0 <= final <= 1.0:
    raise ValueError("the merged term's adversarial fraction must stay in "
                     f"[0, 1], got {final} at the end (--merged_adv_fraction "
                     "× --merged_adv_fraction_final_frac)")
  uses_groups = config.groups_coeff or (
    config.pgd_coeff and config.pgd_plan == "groups") or (
    config.merged_coeff and config.merged_plan == "groups")
  if uses_groups and not config.recon_groups:
    raise ValueError("a groups plan needs --recon_groups, e.g. 'a+b;c'")


def _validate_rider(config: TrainConfig) -> None:
  """Raise ValueError for a hidden-activation rider on no term, or on a term
  that is off or takes none."""
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
  """Raise ValueError for bad token-file or site settings."""
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
  streams.check(config)


def _validate_roles(config: TrainConfig) -> None:
  """Raise ValueError for bad dual-role CI settings."""
  with setting("ci_roles"):
    ci_fns.parse_roles(config.ci_roles)
  points = config.hidden_pass_points
  twice = sorted({p for p in points if points.count(p) > 1})
  if twice:
    raise ValueError(f"--hidden_pass_points lists {', '.join(twice)} twice; "
                     "name each activation once")
  if ci_fns.HIDDEN not in config.ci_roles and config.hidden_pass_points:
    raise ValueError("--hidden_pass_points names what the hidden role's "
                     "passes reconstruct; add --ci_roles=output,hidden or "
                     "drop it")


def _validate_seeds(config: TrainConfig) -> None:
  """Raise ValueError for a `--restarts` candidate's seed outside
  [0, 2**32) (each seed's own range is its domain)."""
  last = candidate_seed(config.seed, config.restarts - 1)
  if config.restarts > 1 and last >= SEED_LIMIT:
    raise ValueError(f"--restarts={config.restarts} gives candidate seeds up "
                     f"to {last}, past 2**32 - 1; lower --seed")


def _validate_run(config: TrainConfig) -> None:
  """Raise ValueError for bad seed, init, profile, stop or restart
  settings."""
  _validate_seeds(config)
  parse_init_from(config.init_from)
  parse_profile_steps(config.profile_steps, config.num_steps)
  _validate_stop(config)
  _validate_steps_per_call(config)
  _validate_restarts(config)


def _validate_restarts(config: TrainConfig) -> None:
  """Raise ValueError unless --restarts and --select_at make a selection
  that is saved and evaluated at the chosen step (or ask for none)."""
  select = config.select_at
  if config.restarts == 1:
    if select:
      raise ValueError(f"--select_at={select} compares restart candidates; "
                       "set --restarts above 1 or drop --select_at "
                       "(--select_at=0)")
    return
  if not 0 < select < config.num_steps:
    raise ValueError(f"--restarts={config.restarts} needs --select_at in "
                     f"(0, --num_steps={config.num_steps}), the step at "
                     "which the candidates are compared; for one run, set "
                     "--restarts=1 --select_at=0")
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


def _validate_steps_per_call(config: TrainConfig) -> None:
  """Raise ValueError for a `--steps_per_call` above 1 for a run whose
  batches the host reads one per step."""
  if config.steps_per_call > 1 and reads_token_files(config):
    raise ValueError(
      f"--steps_per_call={config.steps_per_call}: a run reading token files "
      "(--data_path, --target_data_path, --nontarget_data_path) takes one "
      "step per call, its batches read by the host; set --steps_per_call=1 "
      "or 0 (auto)")


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



def parse_init_from(text: str | None) -> tuple[str, int | None] | None:
  """Return `(run_dir, step)` of `--init_from` (step None: latest), or None."""
  if not text:
    return None
  parent, step = os.path.split(os.path.normpath(text))
  if not parent or not (step.isdigit() or step == "latest"):
    raise ValueError(f"--init_from must be <run_dir>/<step> or "
                     f"<run_dir>/latest, got {text!r}")
  return parent, None if step == "latest" else int(step)


def parse_profile_steps(text: str, num_steps: int) -> tuple[int, int] | None:
  """Return the profiled window `(start, end)` of `START:END`, or None."""
  if not text:
    return None
  start, sep, end = text.partition(":")
  try:
    window = (int(start), int(end))
  except ValueError:
    window = None
  if not sep or window is None:
    raise ValueError(f"--profile_steps must be START:END, got {text!r}")
  if not 0 <= window[0] < window[1] <= num_steps:
    raise ValueError(f"--profile_steps {text} must satisfy 0 <= START < END "
                     f"<= --num_steps ({num_steps})")
  return window


def check(config: TrainConfig) -> None:
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
