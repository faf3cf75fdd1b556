"""Targeted decomposition's two data streams (SPEC §6.6): which stream
reads what, and the refusals of a targeted run's settings.

A targeted run names a *target* stream (the task whose mechanism is
wanted: `--target_task` or `--target_data_path`) and a *non-target* stream
(everything else the model must keep doing: `--nontarget_task` or
`--nontarget_data_path`). Each has its own batch size. The target stream's
divergence averages over the task's answer positions
(`--target_loss_positions=answer`) or over every position (`all`); the
non-target stream pins the delta path on (`δ ≡ 1`) in every masked
forward. A built-in task draws its batch inside the step, a pure function
of the step's key, as a toy does.
"""

from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from decompax.core.step_records import StreamSpec
from decompax.recipe import lm, terms, token_data
from decompax.recipe.config import TrainConfig, held_out_seed, setting
from decompax.targets import arithmetic

TARGET, NONTARGET = "target", "nontarget"
# Toys whose inputs are token ids (their vocabulary reads token files).
TOKEN_TOYS = ("induction", "addsub")


class Grid(NamedTuple):
  """A two-operand task's every prompt: `prompts()` returns them
  `[n_ops · n_a · n_b, t]`, operator-major, then `a`, then `b`; `shape`
  is `(n_ops, n_a, n_b)` and `operators` names each operator."""

  prompts: Callable[[], Any]
  shape: tuple[int, int, int]
  operators: tuple[str, ...]


class Task(NamedTuple):
  """A built-in generator of one stream's token batches.

  `sample(key, batch_size)` draws `[batch_size, seq_len]` token ids in the
  task model's vocabulary (`vocab_size` ids at least); `answer_positions`
  are the positions whose next-token prediction is the task's answer
  (None: the task has none); `grid` is a two-operand task's every prompt
  (None: the task has no operands).
  """

  sample: Callable[[jax.Array, int], Any]
  vocab_size: int
  answer_positions: Optional[tuple[int, ...]]
  grid: Optional[Grid] = None


def tasks() -> dict[str, Task]:
  """Return the built-in tasks by name."""
  config = arithmetic.ArithmeticConfig()
  return {
    "addsub": Task(
      lambda k, b: arithmetic.task_batch(k, config, b),
      config.model.vocab_size, (arithmetic.ANSWER_POSITION,),
      Grid(lambda: arithmetic.grid_prompts(config),
           (len(arithmetic.OPERATORS), config.modulus, config.modulus),
           arithmetic.OPERATORS)),
    "copy": Task(lambda k, b: arithmetic.other_batch(k, config, b),
                 config.model.vocab_size, None),
  }


def is_targeted(config: TrainConfig) -> bool:
  """Return whether `config` runs a targeted decomposition."""
  return bool(config.target_task or config.target_data_path
              or config.nontarget_task or config.nontarget_data_path)


def _source(config: TrainConfig, stream: str) -> tuple[str, Optional[str]]:
  return (getattr(config, f"{stream}_task"),
          getattr(config, f"{stream}_data_path"))


def check(config: TrainConfig) -> None:
  """Raise ValueError naming the first setting a targeted run refuses (or
  a non-target setting of a run that is not targeted)."""
  check_ab_grid(config)
  if not is_targeted(config):
    _check_untargeted(config)
    return
  known = tasks()
  for stream in (TARGET, NONTARGET):
    _check_source(config, stream, known)
  _check_targeted_settings(config, known)
  _check_recon_terms(config)


def _check_untargeted(config: TrainConfig) -> None:
  for name in ("nontarget_recon_coeff", "nontarget_unmasked_coeff",
               "nontarget_importance_coeff", "nontarget_pgd_coeff",
               "nontarget_merged_coeff", "ci_scaled_decay"):
    if getattr(config, name):
      raise ValueError(f"--{name} belongs to a targeted decomposition; "
                       "name its streams (--target_task or "
                       "--target_data_path, and --nontarget_task or "
                       "--nontarget_data_path) or drop it")


def _check_source(config: TrainConfig, stream: str,
                  known: dict[str, Task]) -> None:
  task, path = _source(config, stream)
  if bool(task) == bool(path):
    raise ValueError(
      f"the {stream} stream needs exactly one source: --{stream}_task "
      f"(one of {', '.join(known)}) or --{stream}_data_path")
  if task and task not in known:
    raise ValueError(f"--{stream}_task={task} is no built-in task; use "
                     f"one of {', '.join(known)}")
  if path and config.target not in (lm.HF, *TOKEN_TOYS):
    raise ValueError(f"--{stream}_data_path reads token ids, and "
                     f"--target={config.target} takes none; decompose a "
                     "language model")


def _check_targeted_settings(config: TrainConfig,
                             known: dict[str, Task]) -> None:
  if config.faithfulness_coeff or config.faithfulness_warmup_steps:
    raise ValueError(
      "a targeted decomposition has no faithfulness term and no warmup (the "
      "non-target stream's pinned delta carries what the target mechanism "
      "does not); set --faithfulness_coeff=0 and "
      "--faithfulness_warmup_steps=0")
  if config.target_loss_positions not in ("answer", "all"):
    raise ValueError(f"--target_loss_positions must be answer or all, got "
                     f"{config.target_loss_positions}")
  if config.nontarget_sources not in ("stochastic", "constant"):
    raise ValueError(f"--nontarget_sources must be stochastic or constant, "
                     f"got {config.nontarget_sources}")
  if config.target_data_path or config.nontarget_data_path:
    if config.data_path or config.eval_data_path:
      raise ValueError("a targeted run reads its streams' files "
                       "(--target_data_path, --nontarget_data_path); drop "
                       "--data_path and --eval_data_path")
  if config.target_task and config.target_task == config.nontarget_task:
    raise ValueError(f"both streams read --*_task={config.target_task}; the "
                     "non-target stream must be other data than the target")
  if config.target_loss_positions == "answer" and (
      not config.target_task
      or known[config.target_task].answer_positions is None):
    source = (f"--target_task={config.target_task}" if config.target_task
              else "a token-file target stream")
    raise ValueError(f"{source} has no answer positions; set "
                     "--target_loss_positions=all")


def _check_recon_terms(config: TrainConfig) -> None:
  target_recon = [t for t in terms.TERMS if t.recon and not t.stream]
  if not any(terms.coeff_of(config, t) for t in target_recon):
    raise ValueError("the target stream needs a reconstruction term: set "
                     "--stochastic_coeff (or another recon coefficient) "
                     "above 0")
  if not config.nontarget_recon_coeff:
    raise ValueError("the non-target stream needs its reconstruction: set "
                     "--nontarget_recon_coeff above 0")


def check_ab_grid(config: TrainConfig) -> None:
  """Raise ValueError for `--ab_grid=on` where the target stream is no
  two-operand task (`auto` draws the grid where there is one; `off`
  never)."""
  if config.ab_grid not in ("auto", "on", "off"):
    raise ValueError(f"--ab_grid must be auto, on or off, got "
                     f"{config.ab_grid}")
  if config.ab_grid != "on":
    return
  task = tasks().get(config.target_task) if is_targeted(config) else None
  if task is None or task.grid is None:
    source = (f"--target_task={config.target_task}" if config.target_task
              else "a token-file target stream" if is_targeted(config)
              else "a run without a target stream")
    raise ValueError(
      f"--ab_grid=on: the A/B grid lays a component's CI over a "
      f"two-operand task's operands, and {source} has none; use "
      "--target_task=addsub or --ab_grid=auto")


def batch_size(config: TrainConfig, stream: str) -> int:
  """Return a stream's batch size (its own, else `--batch_size`)."""
  return getattr(config, f"{stream}_batch_size") or config.batch_size


def specs(config: TrainConfig) -> tuple[StreamSpec, StreamSpec]:
  """Return the step's streams: the target's with its loss positions, the
  non-target's with the delta pinned on."""
  positions = None
  if config.target_loss_positions == "answer":
    positions = tasks()[config.target_task].answer_positions
  return (StreamSpec(TARGET, loss_positions=positions),
          StreamSpec(NONTARGET, delta_pin=True))


def vocab_size(config: TrainConfig) -> int:
  """Return the vocabulary the streams' tasks need (0: no task; token
  files are checked against the model's vocabulary when opened)."""
  known = tasks()
  return max((known[_source(config, s)[0]].vocab_size
              for s in (TARGET, NONTARGET) if _source(config, s)[0]),
             default=0)


def seq_len(config: TrainConfig, stream: str) -> int:
  """Return a token-file stream's sequence length (its own, else
  `--seq_len`)."""
  return getattr(config, f"{stream}_seq_len") or config.seq_len


def target_task(config: TrainConfig) -> Task | None:
  """Return the target stream's built-in task (None: a token file)."""
  return tasks().get(config.target_task)


def sampler(config: TrainConfig, wanted: tuple[str, ...] = (TARGET, NONTARGET)
            ) -> Callable[[jax.Array], dict[str, Any]]:
  """Return `sample(key) -> {stream: batch}` of the `wanted` task streams;
  stream `i` (target 0, non-target 1) draws from `fold_in(key, i)` whatever
  else is drawn."""
  known = tasks()
  draws = {s: (i, known[_source(config, s)[0]].sample, batch_size(config, s))
           for i, s in enumerate((TARGET, NONTARGET))
           if s in wanted and _source(config, s)[0]}

  def sample(key):
    return {s: fn(jax.random.fold_in(key, i), b)
            for s, (i, fn, b) in draws.items()}

  return sample


class StreamData(NamedTuple):
  """The token files of a targeted run's file streams, and the sampler of
  its task streams (jitted: the host draws their batches beside the
  files')."""

  files: dict[str, token_data.TokenData]
  sample_tasks: Callable[[jax.Array], dict[str, Any]]


def open_data(config: TrainConfig, vocab: int) -> StreamData | None:
  """Return the streams' token files (None: every stream is a task, and
  the step samples its own batches); ValueError as `token_data.open_data`
  for a bad file, naming the stream's flag."""
  files = {}
  for i, stream in enumerate((TARGET, NONTARGET)):
    path = _source(config, stream)[1]
    if not path:
      continue
    # Each stream reads its own window sequence, even from one file.
    offset = i << 40
    with setting(f"{stream}_data_path"):
      files[stream] = token_data.open_files(
        path, None, vocab, config.seed + offset,
        held_out_seed(config) + offset, batch_size(config, stream),
        seq_len(config, stream))
  if not files:
    return None
  return StreamData(files, jax.jit(sampler(config)))


def train_batches(data: StreamData, step: int, data_key: jax.Array,
                  shardings: dict[str, Any] | None = None) -> dict[str, Any]:
  """Return every stream's batch of `step`: the files' windows, the tasks'
  draws from `fold_in(data_key, step)` (as the in-step sampler draws),
  each on its stream's sharding when placed."""
  batches = dict(data.sample_tasks(jax.random.fold_in(data_key, step)))
  if shardings is not None:
    batches = {s: jax.device_put(b, shardings[s]) for s, b in batches.items()}
  for stream, files in data.files.items():
    batches[stream] = token_data.train_batch(
      files, step, None if shardings is None else shardings[stream])
  return batches


def eval_batches(data: StreamData, stream: str, n_batches: int,
                 sharding: Any = None) -> Any:
  """Return a file stream's held-out batches stacked `[n, B, T]` (None
  for a task stream: its evals draw their own)."""
  if stream not in data.files:
    return None
  return token_data.eval_batches(data.files[stream], n_batches, sharding)


def batch_shapes(config: TrainConfig) -> dict[str, Any]:
  """Return every stream's batch shape and dtype."""
  shapes = jax.eval_shape(sampler(config), jax.random.key(0))
  for stream in (TARGET, NONTARGET):
    if _source(config, stream)[1]:
      shapes[stream] = jax.ShapeDtypeStruct(
        (batch_size(config, stream), seq_len(config, stream)), jnp.int32)
  return shapes
