"""Scale-out wiring of `bin/train` and `bin/harvest`: processes, compiler,
mesh and placement.

`config_from_flags` validates the placement flags (`placement_flags`, which
each binary defines for itself) up front; `start` runs before JAX touches a
device (simulated CPU devices, compilation cache, `jax.distributed`);
`make_placement` builds the mesh over every device of every process and
checks it; `fallback_lines` reports where the preset's layouts keep what
does not tile replicated, and `flag_named` names the flag of a placement
error (`recipe.assembly.plan` places a run, `analysis.harvesting` a harvest).
Only process 0 writes files (`is_writer`).
"""

import contextlib
import dataclasses
import os
from typing import Any

import jax
from absl import flags
from jax.sharding import AxisType, Mesh

from decompax.core import slots
from decompax.placement import compiler as compiler_lib
from decompax.placement import mesh as mesh_lib
from decompax.placement import shardings
from decompax.placement import table as table_lib

# Flags that describe one process's launch, not the run: left out of the
# run directory's resolved flags, so every process of a run (and a resume
# launched differently) sees the same record.
# The compile options are among them: they change how fast the step runs,
# and its floating-point rounding, not what it computes.
LAUNCH_FLAGS = ("coordinator_address", "num_processes", "process_id",
                "local_device_count", "compiler", "compilation_cache_dir")

@dataclasses.dataclass(frozen=True)
class PlacementConfig:
  """The scale-out flags, validated."""

  replicate: int | None = None
  fsdp: int | None = None
  tp: int | None = None
  placement: str = "ddp"
  place: tuple[str, ...] = ()
  local_device_count: int | None = None
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  compiler: str = compiler_lib.DEFAULT
  compilation_cache_dir: str | None = None

  @property
  def table(self) -> table_lib.PlacementTable:
    """Return the placement table of the preset and overrides."""
    with flag_named():
      return table_lib.make_table(self.placement, self.place)

  @property
  def distributed(self) -> bool:
    """Return whether this launch joins a multi-process run."""
    return (self.coordinator_address is not None
            or self.num_processes is not None or self.process_id is not None)


def check_compiler_options(options: dict[str, Any]) -> None:
  """Raise ValueError unless XLA knows every option (a tiny compile)."""
  if not options:
    return
  try:
    jax.jit(lambda x: x + 1).lower(1.0).compile(options)
  except Exception as e:  # XLA reports unknown options as runtime errors.
    first = str(e).strip().splitlines()[0]
    raise ValueError(f"--compiler: {first}") from None


def config_from_flags(
  flag_values: flags.FlagValues = flags.FLAGS,
) -> PlacementConfig:
  """Return the validated placement config of the parsed `flag_values`
  (which `placement_flags.define` gave the scale-out flags)."""
  values = {f.name: flag_values[f.name].value
            for f in dataclasses.fields(PlacementConfig)}
  values["place"] = tuple(values["place"])
  config = PlacementConfig(**values)
  config.table  # noqa: B018  (unknown categories and layouts fail here)
  compiler_lib.options(config.compiler)
  for name in ("local_device_count", "num_processes"):
    value = getattr(config, name)
    if value is not None and value < 1:
      raise ValueError(f"--{name} must be positive, got {value}")
  if config.process_id is not None and config.num_processes is not None:
    if not 0 <= config.process_id < config.num_processes:
      raise ValueError(f"--process_id={config.process_id} must lie in "
                       f"[0, --num_processes={config.num_processes})")
  cache = config.compilation_cache_dir
  if cache is not None and os.path.exists(cache) and not os.path.isdir(cache):
    raise ValueError(f"--compilation_cache_dir {cache} is a file; name a "
                     "directory")
  return config


def start(config: PlacementConfig) -> None:
  """Configure JAX before its first device use: CPU device count, the
  persistent compilation cache and `jax.distributed` (one call per process)."""
  if config.local_device_count is not None:
    # Simulated CPU devices; accelerators are checked in `make_placement`.
    jax.config.update("jax_num_cpu_devices", config.local_device_count)
  if config.compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir",
                      config.compilation_cache_dir)
  if config.distributed:
    address = config.coordinator_address
    # `auto` leaves every setting to the cluster environment JAX detects.
    jax.distributed.initialize(
      coordinator_address=None if address == "auto" else address,
      num_processes=config.num_processes, process_id=config.process_id)
  check_compiler_options(compiler_lib.options(config.compiler))


def is_writer() -> bool:
  """Return whether this process writes logs, figures and results."""
  return jax.process_index() == 0


def build_mesh(shape: mesh_lib.MeshShape, devices=None) -> Mesh:
  """Return the `(replicate, fsdp, tp)` mesh over `devices` (default: all)."""
  devices = jax.devices() if devices is None else list(devices)
  return jax.make_mesh(
    tuple(shape.sizes.values()), table_lib.MESH_AXES,
    axis_types=(AxisType.Auto,) * len(table_lib.MESH_AXES), devices=devices)


def make_placement(
  config: PlacementConfig, lead_shape: tuple[int, ...],
  batch_flag: str = "--batch_size",
  more: tuple[tuple[str, tuple[int, ...]], ...] = (),
) -> shardings.Placement:
  """Return the run's mesh, table and compiler options, checked against the
  devices present and the batch's lead shape (it must split evenly), and
  against each `(flag, lead shape)` of `more` (a targeted run's other
  stream)."""
  local = jax.local_devices()
  with flag_named("--local_device_count"):
    mesh_lib.check_local_devices(config.local_device_count, len(local),
                                 local[0].platform)
  with flag_named("--replicate/--fsdp/--tp"):
    shape = mesh_lib.mesh_shape(jax.device_count(), config.replicate,
                                config.fsdp, config.tp)
  table = config.table
  for flag, lead in ((batch_flag, lead_shape), *more):
    with flag_named(flag):
      table_lib.partition_spec(table.layout("inputs"),
                               ("batch", "seq")[:len(lead)], lead,
                               shape.sizes)
  return shardings.Placement(build_mesh(shape), table,
                            compiler_lib.options(config.compiler))


def fallback_lines(
  found: tuple[shardings.Fallback, ...], sizes: dict[str, int]
) -> list[str]:
  """Return one `[placement]` line per category with preset fallbacks."""
  by_category: dict[str, list[shardings.Fallback]] = {}
  for fallback in found:
    by_category.setdefault(fallback.category, []).append(fallback)
  lines = []
  for category, group in by_category.items():
    leaves = list(dict.fromkeys(f.leaf for f in group))
    meshes = dict.fromkeys(table_lib.mesh_text(f.shortfall.wanted, sizes)
                           for f in group)
    first = group[0]
    shape = ",".join(map(str, first.shape))
    lines.append(
      f"[placement] {category}: {len(leaves)} "
      f"lea{'f keeps' if len(leaves) == 1 else 'ves keep'} dims replicated "
      f"that do not tile {' or '.join(meshes)} (e.g. {first.leaf} [{shape}])")
  return lines


def pad_line(components, sites) -> str:
  """Return the `[placement]` line naming the kinds held with pad slots
  (`core.slots`), or "" when none is."""
  padded = [f"{kind} {n}x{c} as {held_n}x{held_c}" for kind, ((n, c), (
    held_n, held_c)) in slots.padded_kinds(components, sites).items()]
  if not padded:
    return ""
  return ("[placement] optimizer: V/U masters held with zero pad slots "
          f"(layers x C): {', '.join(padded)}; the step never computes on "
          "them")


@contextlib.contextmanager
def flag_named(flag: str = ""):
  """Re-raise the placement library's ValueErrors naming their flag: an
  override's error names `--place`, others `flag` (none when empty)."""
  try:
    yield
  except table_lib.LayoutError as e:
    if e.entry:
      raise ValueError(f"--place: {e}") from None
    raise ValueError(f"{flag}: {e}" if flag else str(e)) from None
  except ValueError as e:
    raise ValueError(f"{flag}: {e}" if flag else str(e)) from None
