"""Restore a training state from checkpoints (SPEC §12).

`restore_state` resumes a run from its own newest usable checkpoint: one
written for the same sites, C and CI function (`structure_mismatch`), read
leaf by leaf onto the run's shardings, never one holding NaN or infinity.
A step whose term states were stored by position (`term_states/<j>/...`,
the layout written while they were a tuple over every loss term) is read
by name. `restore_decomposition` reads only the decomposition item of a
step, for a new run that starts from another's decomposition.

Messages are one line and name checkpoints, never the options that chose
them: the caller adds those.
"""

import os
from collections.abc import Callable, Mapping
from typing import Any

from decompax.core import ci_fns, sites as sites_lib, slots
from decompax.io import checkpoint, decomposition

# State fields newer than the checkpoint format's first version: a
# checkpoint without them resumes with their initial values.
ADDED_STATE_FIELDS = ("health/",)


def _difference(path: str, parent: Any, here: Any) -> str | None:
  if isinstance(parent, dict) and isinstance(here, dict):
    for key in sorted(set(parent) | set(here)):
      found = _difference(f"{path}.{key}", parent.get(key), here.get(key))
      if found:
        return found
    return None
  if parent != here:
    return f"{path} is {parent} in the parent, {here} here"
  return None


def structure_mismatch(
  metadata: dict, sites: tuple[sites_lib.SiteSpec, ...],
  ci_config: ci_fns.CIConfig,
) -> str | None:
  """Return the first difference in sites, C or CI function between a
  checkpoint's decomposition `metadata` (the parent) and a run, or None."""
  stored = metadata.get("sites", [])
  names = [s.get("name") for s in stored]
  if names != [s.name for s in sites]:
    return (f"sites are {','.join(map(str, names))} in the parent, "
            f"{','.join(s.name for s in sites)} here")
  for entry, site in zip(stored, sites):
    found = _difference(f"site {site.name}", entry, decomposition.to_json(site))
    if found:
      return found
  return _difference("ci_config", metadata.get("ci_config"),
                     decomposition.to_json(ci_config))


def positional_term_states(stored: tuple[str, ...]) -> list[int]:
  """Return the term positions a checkpoint stores term states under, in
  ascending order: `term_states/<j>/...`, the layout written while
  `TrainState.term_states` was a tuple over every loss term (empty for a
  checkpoint keyed by term name)."""
  return sorted({int(parts[1]) for parts in (k.split("/") for k in stored)
                 if len(parts) > 1 and parts[0] == "term_states"
                 and parts[1].isdigit()})


def term_state_renames(
  positions: list[int], stateful: tuple[str, ...], where: str,
) -> dict[str, str]:
  """Return `{term_states/<j>: term_states/<name>}` reading a positional
  checkpoint by name.

  `positions` ascend in term order, as `stateful`, the names of this run's
  stateful terms in term order, do; the state records kept the old dicts'
  keys as field names, so the rename is the whole migration. Raises
  CheckpointError when the counts differ.
  """
  if len(positions) != len(stateful):
    raise checkpoint.CheckpointError(
      f"{where} stores {len(positions)} term states by position, this run "
      f"has {len(stateful)} stateful terms ({', '.join(stateful) or 'none'})"
      "; it was written for another structure")
  return {f"term_states/{j}": f"term_states/{name}"
          for j, name in zip(positions, stateful)}


def _renames(path: str, stateful: tuple[str, ...],
             report: Callable[[str], None]) -> dict[str, str]:
  """Return the renames reading `path`'s term states by name (none for a
  checkpoint that stores them so)."""
  positions = positional_term_states(
    checkpoint.item_paths(path, checkpoint.TRAINING))
  if not positions:
    return {}
  renamed = term_state_renames(positions, stateful, f"checkpoint {path}")
  report(f"{os.path.basename(path)}: term states stored by position, read "
         "by name (" + ", ".join(f"{k.split('/')[1]}: {v.split('/')[1]}"
                                 for k, v in renamed.items()) + ")")
  return renamed


def _reader(template: Any, shardings: Any, sites, ci_config,
            term_names: tuple[str, ...], report: Callable[[str], None]
            ) -> Callable[[str], dict[str, Any]]:
  """Return `read(path)`: a step's items, each leaf read onto its sharding
  (this process's shards only)."""
  items = checkpoint.split_state(template)
  placed = (dict.fromkeys(items) if shardings is None
            else checkpoint.split_state(shardings))
  # In term order: a state's dict of term states is sorted by name.
  stateful = tuple(n for n in term_names if n in template.term_states)
  real_shape = slots.real_shape_of(sites)

  def read(path: str) -> dict[str, Any]:
    metadata = checkpoint.item_metadata(path, checkpoint.DECOMPOSITION)
    mismatch = structure_mismatch(metadata, sites, ci_config)
    if mismatch:
      raise checkpoint.CheckpointError(
        f"checkpoint {path} belongs to another run: {mismatch}")
    renamed = _renames(path, stateful, report)
    return {
      name: checkpoint.restore_item(
        path, name, tree, placed[name], added=ADDED_STATE_FIELDS,
        renamed=renamed if name == checkpoint.TRAINING else None,
        real_shape=real_shape)
      for name, tree in items.items()}

  return read


def _check_finite(path: str, restored: Mapping[str, Any]) -> None:
  # A diverged state must never be trained on again: fall back past it.
  for name, tree in restored.items():
    checkpoint.check_finite(path, name, tree)


def restore_state(
  directory: str, template: Any, sites: tuple[sites_lib.SiteSpec, ...],
  ci_config: ci_fns.CIConfig, term_names: tuple[str, ...] = (),
  shardings: Any = None, report: Callable[[str], None] = print,
) -> tuple[int, Any]:
  """Return `(step, state)` of the newest usable checkpoint in `directory`.

  `template` is the run's initial state; `shardings` (a matching tree of
  `Sharding`s, or None: the template's own placement) is where each leaf
  is read to, shard by shard, so a placed run never holds a whole copy of
  its state on one device. `term_names` are the run's loss terms in order
  (they read term states stored by position). Damaged and non-finite steps
  are reported and skipped, the same ones by every process
  (`checkpoint.restore_latest`). Raises CheckpointError when no step is
  usable or the newest belongs to another run.
  """
  read = _reader(template, shardings, sites, ci_config, term_names, report)
  found = checkpoint.restore_latest(directory, read, report,
                                    check=_check_finite)
  if found is None:
    raise checkpoint.CheckpointError(
      f"{directory}: its checkpoints vanished during the launch")
  step, restored = found
  return step, checkpoint.join_state(template, restored)


def restore_decomposition(path: str, template: Any, shardings: Any = None,
                          sites: tuple[sites_lib.SiteSpec, ...] = ()
                          ) -> dict[str, Any]:
  """Return the components and CI parameters of the step directory `path`,
  shaped like `template`'s (with its pad slots, for the run's `sites`) and
  read onto `shardings` (see `restore_state`)."""
  name = checkpoint.DECOMPOSITION
  return checkpoint.restore_item(
    path, name, checkpoint.split_state(template)[name],
    None if shardings is None else checkpoint.split_state(shardings)[name],
    real_shape=slots.real_shape_of(sites))
