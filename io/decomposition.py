"""A trained decomposition as consumers read it from a checkpoint.

`load_decomposition(path)` is the one call a downstream tool needs: it reads
only the `decomposition` item of a step (I37) and rebuilds its pytree from
the site specs and CI config stored beside it, so it needs no knowledge of
how the run was trained. `load_npz` does the same for a finished run's
`decomposition.npz`. Configs travel as JSON through `to_json` and
`from_json`.
"""

import dataclasses
import json
import os
import types
import typing
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
from jaxtyping import PyTree

from decompax.core import ci_fns, sites as sites_lib
from decompax.io import checkpoint, run_dir
from decompax.io.checkpoint import DECOMPOSITION, CheckpointError
from decompax.io.run_dir import Path


def to_json(config: Any) -> Any:
  """Return a frozen dataclass as JSON-ready dicts and lists."""
  return json.loads(json.dumps(dataclasses.asdict(config)))


def _from_json(kind: Any, value: Any) -> Any:
  if dataclasses.is_dataclass(kind):
    return from_json(kind, value)
  origin, args = typing.get_origin(kind), typing.get_args(kind)
  if origin in (typing.Union, types.UnionType):
    if value is None:
      return None
    return _from_json(next(a for a in args if a is not type(None)), value)
  if origin is tuple and isinstance(value, list):
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_from_json(args[0], v) for v in value)
    return tuple(_from_json(a, v) for a, v in zip(args, value))
  return value


def from_json(cls: type, data: Mapping) -> Any:
  """Return the frozen dataclass `cls` rebuilt from `to_json` output.

  Fields absent from `data` take their defaults.
  """
  hints = typing.get_type_hints(cls)
  return cls(**{f.name: _from_json(hints[f.name], data[f.name])
                for f in dataclasses.fields(cls) if f.name in data})


def decomposition_metadata(
  sites: tuple[sites_lib.SiteSpec, ...], ci_config: ci_fns.CIConfig,
  **extra: Any,
) -> dict:
  """Return the metadata that lets `load_decomposition` rebuild the item."""
  return {"sites": [to_json(s) for s in sites],
          "ci_config": to_json(ci_config), **extra}


class Decomposition(NamedTuple):
  """A trained decomposition as consumers see it."""

  components: sites_lib.Components
  ci_params: Any
  sites: tuple[sites_lib.SiteSpec, ...]
  ci_config: ci_fns.CIConfig
  step: int
  metadata: dict


def decomposition_template(
  sites: tuple[sites_lib.SiteSpec, ...], ci_config: ci_fns.CIConfig
) -> dict[str, PyTree]:
  """Return the shapes of the decomposition item for `sites` and `ci_config`."""
  ci_fn = ci_fns.make_ci_fn(ci_config, sites)

  def build(key):
    vu_key, ci_key = jax.random.split(key)
    return {"components": sites_lib.init_components(vu_key, sites),
            "ci_params": ci_fn.init(ci_key)}

  return jax.eval_shape(build, jax.random.key(0))


def _structure(metadata: Mapping, where: str) -> tuple[
    tuple[sites_lib.SiteSpec, ...], ci_fns.CIConfig, dict[str, PyTree]]:
  """Return the sites, CI config and item template `metadata` describes;
  CheckpointError naming `where` when it cannot."""
  try:
    sites = tuple(from_json(sites_lib.SiteSpec, s) for s in metadata["sites"])
    ci_config = from_json(ci_fns.CIConfig, metadata["ci_config"])
    return sites, ci_config, decomposition_template(sites, ci_config)
  except (KeyError, TypeError, ValueError) as e:
    raise CheckpointError(
      f"{where}: cannot rebuild the decomposition from its metadata "
      f"({type(e).__name__}: {e})") from None


def _decomposition(item: Mapping, sites, ci_config, step: int,
                   metadata: Mapping) -> Decomposition:
  rest = {k: v for k, v in metadata.items() if k not in ("sites", "ci_config")}
  return Decomposition(item["components"], item["ci_params"], sites,
                       ci_config, step, rest)


def _load_step(step_dir: str, sharding: Any, strict: bool = False
               ) -> Decomposition:
  metadata = checkpoint.item_metadata(step_dir, DECOMPOSITION)
  sites, ci_config, template = _structure(metadata, f"checkpoint {step_dir}")
  item = checkpoint.restore_item(step_dir, DECOMPOSITION, template, sharding)
  try:
    checkpoint.check_finite(step_dir, DECOMPOSITION, item)
  except checkpoint.NonfiniteCheckpoint as e:
    if strict:
      raise
    warnings.warn(f"{e}; its components are not a usable decomposition")
  step = int(checkpoint.read_index(step_dir)["step"])
  return _decomposition(item, sites, ci_config, step, metadata)


def load_decomposition(path: Path, sharding: Any = None) -> Decomposition:
  """Return the decomposition saved at `path`, without its training item.

  `path` is a step directory, a checkpoint directory or a run directory
  (then its newest readable, finite step; damaged or non-finite newer ones
  are skipped with a warning; a `--restarts` run's is its chosen
  candidate's). A step directory named directly is loaded
  even when it holds NaN or infinity, with a warning. Arrays are placed
  with `sharding` (one Sharding or a tree like the item), else on the first
  device. Raises CheckpointError.
  """
  path = run_dir.chosen_run(path)
  if os.path.isfile(os.path.join(path, checkpoint.INDEX_FILE)):
    return _load_step(path, sharding)
  for directory in (os.path.join(path, checkpoint.CHECKPOINT_DIR), path):
    # A consumer may read alone, so no other process is asked to agree.
    found = checkpoint.restore_latest(
      directory, lambda p: _load_step(p, sharding, strict=True),
      warnings.warn, agree=checkpoint.this_process_only)
    if found is not None:
      return found[1]
  raise CheckpointError(f"no checkpoint at {path}")


def load_npz(path: Path) -> Decomposition:
  """Return the decomposition a finished run wrote to `decomposition.npz`.

  The file's metadata holds the site specs and the whole CI config, so the
  CI function is `ci_fns.make_ci_fn(d.ci_config, d.sites)`. Raises
  CheckpointError for a file written before it carried its CI config.
  """
  path = os.fspath(path)
  arrays, metadata = run_dir.load_arrays(path)
  if "ci_config" not in metadata:
    raise CheckpointError(
      f"{path} predates decomposition files that carry their CI config; "
      "load the run's checkpoints with load_decomposition instead")
  sites, ci_config, template = _structure(metadata, path)
  try:
    tree = run_dir.unflatten_into(template, arrays)
  except ValueError as e:
    raise CheckpointError(
      f"{path}: cannot rebuild the decomposition (ValueError: {e})") from None
  return _decomposition(jax.device_put(tree), sites, ci_config,
                        int(metadata.get("step", -1)), metadata)
