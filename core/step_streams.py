"""A step's streams, passes and terms as its settings declare them: the
streams (SPEC §6.6) and the clean taps each needs, the (stream, role)
passes each term scores, and the checks `make_train_step` runs before it
builds anything (unique term names, known streams and roles).
"""

from typing import Any


from decompax.core.ci_fns import OUTPUT, CIFn
from decompax.core.target import TargetFns
from decompax.core import step_records


def clean_tap_keys(
  ci_fn: CIFn, target: TargetFns, terms: tuple[step_records.LossTerm, ...]
) -> tuple[str, ...]:
  """Return, in first-seen order, every tap the step's clean forward keeps."""
  keys = [*ci_fn.input_taps, *target.start_taps]
  for term in terms:
    keys.extend(term.clean_taps)
  return tuple(dict.fromkeys(keys))


def stream_specs(config: step_records.StepConfig
                 ) -> tuple[step_records.StreamSpec, ...]:
  """Return the step's streams: the configured ones, or the one unnamed."""
  return config.streams or (step_records.StreamSpec(""),)


def check_streams(config: step_records.StepConfig) -> None:
  """Raise ValueError unless a multi-stream step's streams have distinct,
  non-empty names."""
  names = [s.name for s in config.streams]
  if any(not n for n in names) or len(set(names)) != len(names):
    raise ValueError(f"a multi-stream step needs distinct non-empty stream "
                     f"names, got {names}")


def term_streams(terms: tuple[step_records.LossTerm, ...],
                 config: step_records.StepConfig) -> tuple[int, ...]:
  """Return the index of the stream each term scores; raise ValueError for a
  term naming a stream the step does not have."""
  names = [s.name for s in config.streams] or [""]
  out = []
  for term in terms:
    if term.stream not in names:
      raise ValueError(f"loss term {term.name} scores stream "
                       f"{term.stream!r}, but the step's streams are "
                       f"{names}")
    out.append(names.index(term.stream))
  return tuple(out)


def role_index(term: step_records.LossTerm, roles: tuple[str, ...],
               hidden_points: tuple[str, ...]) -> int:
  """Return the index in `roles` of the CI role `term` reads; raise
  ValueError for a role the CI function does not read out, or a hidden
  role without hidden points to reconstruct."""
  if term.role not in roles:
    raise ValueError(f"loss term {term.name} reads the {term.role!r} CI "
                     f"role, but the CI function's roles are {roles}")
  if term.role != OUTPUT and not hidden_points:
    raise ValueError(f"loss term {term.name} runs in a hidden pass, and "
                     "the step names no hidden points to reconstruct")
  return roles.index(term.role)


def term_passes(terms: tuple[step_records.LossTerm, ...],
                config: step_records.StepConfig,
                roles: tuple[str, ...]) -> tuple[int, ...]:
  """Return the pass each term scores: `stream · len(roles) + role`, its
  stream's index and its role's (`role_index`)."""
  return tuple(
    k * len(roles) + role_index(term, roles, config.hidden_points)
    for term, k in zip(terms, term_streams(terms, config)))


def by_stream(config: step_records.StepConfig, value: Any) -> dict[str, Any]:
  """Return a per-stream value keyed by stream name: a multi-stream step's
  dict as it is, a one-stream step's value under the name ""."""
  return value if config.streams else {"": value}


def check_term_names(terms: tuple[step_records.LossTerm, ...]) -> None:
  """Raise ValueError unless term names are unique: a term's state (an
  adversary's source bundle) is keyed by its name, so a name given to two
  streams or roles would share one bundle between them (I22, I45)."""
  seen: dict[str, step_records.LossTerm] = {}
  for term in terms:
    first = seen.setdefault(term.name, term)
    if first is term:
      continue
    if (first.stream, first.role) != (term.stream, term.role):
      raise ValueError(
        f"loss term {term.name} is given to stream/role "
        f"{first.stream or '-'}/{first.role} and "
        f"{term.stream or '-'}/{term.role}; its state (a source bundle) "
        "would be shared between them: build one term per stream and role, "
        "each with its own name")
    raise ValueError(f"loss term names must be unique, got "
                     f"{[t.name for t in terms]}")


def check_step(terms: tuple[step_records.LossTerm, ...],
               config: step_records.StepConfig) -> None:
  """Raise ValueError for settings no step can run: an unknown non-finite
  policy, clashing term names, a finish without a state, a negative decay,
  or streams without distinct names."""
  if config.on_nonfinite not in ("stop", "skip"):
    raise ValueError(f"on_nonfinite must be stop or skip, got "
                     f"{config.on_nonfinite!r}")
  check_term_names(terms)
  for term in terms:
    if term.finish is not None and term.init_state is None:
      raise ValueError(f"loss term {term.name} has a finish but no "
                       "init_state; finish returns the term's state")
  if config.ci_scaled_decay < 0:
    raise ValueError(f"the CI-scaled decay must be >= 0, got "
                     f"{config.ci_scaled_decay}")
  check_streams(config)


def stream_clean_taps(
  target: TargetFns, ci_fn: CIFn, terms: tuple[step_records.LossTerm, ...],
  config: step_records.StepConfig,
) -> tuple[tuple[str, ...], ...]:
  """Return per stream the taps its clean forward keeps: its terms' and the
  CI's, and the hidden points where one of its terms runs a hidden pass."""
  owners = term_streams(terms, config)
  wanted = []
  for k in range(len(stream_specs(config))):
    own_terms = tuple(t for t, i in zip(terms, owners) if i == k)
    hidden = any(t.role != OUTPUT for t in own_terms)
    wanted.append(tuple(dict.fromkeys((
      *clean_tap_keys(ci_fn, target, own_terms),
      *(config.hidden_points if hidden else ())))))
  return tuple(wanted)
