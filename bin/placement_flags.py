"""The scale-out flags every sharded binary takes (`bin/train`, `bin/harvest`).

`define(module_name, flag_values)` adds them to one binary's `FlagValues`
as flags of that binary's module: `bin/train` records its own module's
flags in a run's `flags.txt`, and `--helpfull` lists them under it. Each
binary calls it once, at import, for its own `FlagValues`, so every flag is
defined once there however the binaries' modules are imported together.
`bin/placement_setup.config_from_flags` reads them back by name.

They are not `recipe.config.TrainConfig` settings: they say how a launch
places and compiles a run, not what it computes; `bin/harvest` takes them
for a run it only reads, and a library caller places a run with a
`placement.shardings.Placement`, never by these names. Their refusals are
`bin/placement_setup`'s, which also names those a resume may change
(`LAUNCH_FLAGS`). `bin/train --helpfull` lists them after the settings'
topics.
"""

from absl import flags

from decompax.placement import compiler

NAMES = ("replicate", "fsdp", "tp", "placement", "place", "local_device_count",
         "coordinator_address", "num_processes", "process_id", "compiler",
         "compilation_cache_dir")


def define(module_name: str,
           flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Define the scale-out flags (`NAMES`) on `flag_values`, as flags of
  `module_name` (named, not found from the call stack, which a wrapper
  such as the tests' type checker would claim)."""
  fv = {"flag_values": flag_values, "module_name": module_name}
  flags.DEFINE_integer(
    "replicate", None, "Size of the `replicate` mesh axis (node groups; "
    "default 1).", **fv)
  flags.DEFINE_integer(
    "fsdp", None, "Size of the `fsdp` mesh axis (data shards; default: every "
    "device the other axes leave).", **fv)
  flags.DEFINE_integer(
    "tp", None, "Size of the `tp` mesh axis (the C axis of V/U and CI; "
    "default 1). replicate x fsdp x tp must equal the device count.", **fv)
  flags.DEFINE_enum(
    "placement", "ddp", ["ddp", "zero1", "owner"],
    "Placement preset: ddp (state replicated, batch over every device), zero1 "
    "(V/U masters and moments sharded over the whole mesh), owner (stacks "
    "over replicate, matrix dims over fsdp, C over tp; a stack or C that does "
    "not tile is held with zero pad slots, never computed on and never "
    "reported).", **fv)
  flags.DEFINE_list(
    "place", [], "Per-category overrides of the preset, category:layout, e.g. "
    "optimizer:fsdp,frozen:replicated; a layout is a name (replicated, data, "
    "batch, fsdp, fsdp_tp, tp, zero1, owner, stacked) or "
    "axis=mesh[+mesh];...", **fv)
  flags.DEFINE_integer(
    "local_device_count", None, "Devices this process drives, as launched "
    "(CPU: simulated devices; default: all it sees).", **fv)
  flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 of a multi-process "
    "run (jax.distributed); auto: take everything from the cluster "
    "environment.", **fv)
  flags.DEFINE_integer(
    "num_processes", None, "Processes of a multi-process run.", **fv)
  flags.DEFINE_integer(
    "process_id", None, "This process's index, 0 .. num_processes-1 (0 writes "
    "logs and figures).", **fv)
  flags.DEFINE_string(
    "compiler", compiler.DEFAULT, "XLA options of the step's compile: bare "
    "(none), cpu512 (512-bit vector loops where the CPU has AVX-512; other "
    "platforms ignore it), tuned-v1 (GPU collective scheduling) or "
    "xla_option=value pairs, comma-separated. How this launch compiles, not "
    "part of the run: a resume may change it.", **fv)
  flags.DEFINE_string(
    "compilation_cache_dir", None, "Directory of JAX's persistent "
    "compilation cache (default: none).", **fv)
