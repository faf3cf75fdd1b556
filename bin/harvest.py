"""Harvest a finished run's components: `bin/harvest --run_dir=DIR`.

Writes `<run_dir>/harvest/` (see `analysis/harvesting.py`): per component its
firing density, mean CI, CI histogram, co-activations, top contexts and
ablation effect. Rerun the same command to resume an interrupted harvest:
SIGTERM or SIGINT saves at the next batch boundary and exits with
`cli.REQUEUE_EXIT_CODE` (a second SIGINT stops at once, from the last
save). One harvest at a time writes a run's store, claimed as
`io/owned_dir.py` says: it holds the lock of `harvest/.lock`, and
`harvest/.written.json` records the token file's size and hash (a harvest
of a file since rewritten is refused, or replaced with `--overwrite`) and
every entry the harvest wrote.

Shards over the devices of one process with `bin/train`'s scale-out flags
(`--replicate`, `--fsdp`, `--tp`, `--placement`, `--place`,
`--local_device_count`, ...): each batch splits over the mesh's batch axes
(`--batch_size` must divide over them) and the decomposition is placed as
the table says (replicated under the default `ddp`).

The flags live in their own `HARVEST_FLAGS`, not absl's global `FLAGS`:
`--batch_size`, `--seed`, `--seq_len`, `--data_path` and `--overwrite` mean
other things to `bin/train`, whose flags share a process with these
wherever both modules are imported (the tests). `entry` adds them to
absl's flags, which the launch parses.
"""

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from absl import flags, logging

from decompax.analysis import (
  explore, harvest_batches, harvest_settings, tag_summary)
from decompax.analysis import harvesting as harvest_lib
from decompax.bin import cli, device_memory, placement_flags, placement_setup
from decompax.io import harvest_store, owned_dir, run_dir
from decompax.placement import shardings
from decompax.placement import table as table_lib

HARVEST_FLAGS = flags.FlagValues()


def _define_float(name: str, default: float | None,
                  help_text: str) -> flags.FlagHolder:
  # `cli.define_float` defines on absl's global flags; these are our own.
  return flags.DEFINE(cli.FiniteFloatParser(), name, default, help_text,
                      flag_values=HARVEST_FLAGS,
                      serializer=flags.ArgumentSerializer())


_D = harvest_settings.Request()
_RUN_DIR = flags.DEFINE_string(
  "run_dir", None, "Run directory (the --output_dir of bin/train).",
  required=True, flag_values=HARVEST_FLAGS)
_DATA_PATH = flags.DEFINE_string(
  "data_path", None, "Token file to harvest (language models; "
  "default: the run's --data_path).", flag_values=HARVEST_FLAGS)
_POSITIONS = flags.DEFINE_integer(
  "positions", _D.positions, "Positions to harvest (tokens for language "
  "models, inputs for toys); rounded up to whole batches. A token file's "
  "windows tile it without overlap, spread evenly over it, so at most "
  "the whole file is harvested, each position once.",
  flag_values=HARVEST_FLAGS)
_BATCH_SIZE = flags.DEFINE_integer(
  "batch_size", _D.batch_size, "Sequences (or toy inputs) per batch.",
  flag_values=HARVEST_FLAGS)
_SEQ_LEN = flags.DEFINE_integer(
  "seq_len", _D.seq_len, "Tokens per sequence (default: the run's "
  "--seq_len).", flag_values=HARVEST_FLAGS)
_TOP_K = flags.DEFINE_integer("top_k", _D.top_k, "Contexts kept per "
                              "component.", flag_values=HARVEST_FLAGS)
_BEFORE = flags.DEFINE_integer(
  "window_before", _D.window_before, "Tokens kept before a top position "
  f"(default: {harvest_settings.WINDOW_BEFORE}, fewer in shorter sequences; at "
  "most --seq_len - 1).", flag_values=HARVEST_FLAGS)
_AFTER = flags.DEFINE_integer(
  "window_after", _D.window_after, "Tokens kept after a top position "
  f"(default: {harvest_settings.WINDOW_AFTER}, fewer in shorter sequences; at "
  "most --seq_len - 1).", flag_values=HARVEST_FLAGS)
_THRESHOLD = _define_float(
  "threshold", _D.threshold, "CI above which a component fires "
  "(default: the run's --ci_alive_threshold).")
_ABLATION_BATCHES = flags.DEFINE_integer(
  "ablation_batches", _D.ablation_batches, "First batches on which each "
  "component that fired in the batch is ablated in turn, one forward of "
  "the whole batch each, with a progress line every "
  f"{harvest_settings.ABLATION_PROGRESS_S:g} s (0: no ablation effects; "
  f"default: {harvest_settings.TOY_ABLATION_BATCHES} for a toy, "
  f"{harvest_settings.LM_ABLATION_BATCHES} for a language model, where they "
  "cost hours: brown_s's 3072 components take about 20 minutes per batch "
  "of 8 x 64 tokens on two CPU cores).", flag_values=HARVEST_FLAGS)
_ABLATION_CHUNK = flags.DEFINE_integer(
  "ablation_chunk", 16, "Ablated forwards run at once, one compiled call "
  "(memory: that many forwards of one batch).", flag_values=HARVEST_FLAGS)
_SEED = cli.define_seed("seed", _D.seed, "Seed of the harvested batches.",
                       __name__, HARVEST_FLAGS)
_SAVE_EVERY_S = _define_float(
  "save_every_s", 60.0, "Seconds between resumable saves (0: after every "
  "batch).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a "
                               "harvest made with other settings.",
                               flag_values=HARVEST_FLAGS)
placement_flags.define(__name__, HARVEST_FLAGS)


def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  cli.fail("harvest", message)


def _flagged(message: str) -> str:
  """Return a library message with its leading setting named as a flag."""
  name, sep, rest = message.partition("=")
  if not sep or " " in name:
    name, sep, rest = message.partition(":")
    if not sep or " " in name:
      return message
  return f"--{name}{sep}{rest}"


def request() -> harvest_settings.Request:
  """Return the harvest the flags ask for."""
  return harvest_settings.Request(
    positions=_POSITIONS.value, batch_size=_BATCH_SIZE.value,
    seq_len=_SEQ_LEN.value, top_k=_TOP_K.value,
    window_before=_BEFORE.value, window_after=_AFTER.value,
    threshold=_THRESHOLD.value, ablation_batches=_ABLATION_BATCHES.value,
    seed=_SEED.value, data_path=_DATA_PATH.value)


def make_placement() -> shardings.Placement:
  """Return the mesh and table the flags ask for, JAX configured first;
  ValueError (one line, naming the flag) for a mesh the devices or the
  batch size do not fit."""
  config = placement_setup.config_from_flags(HARVEST_FLAGS)
  if config.distributed:
    raise ValueError("--coordinator_address/--num_processes/--process_id: "
                     "bin/harvest runs in one process; shard it over that "
                     "process's devices")
  placement_setup.start(config)
  # The batch axis alone, before the run is read: a token run's sequence
  # axis is checked by the harvest itself.
  return placement_setup.make_placement(config, (_BATCH_SIZE.value,))


def _stop_on_signals() -> threading.Event:
  """Return the event SIGTERM and SIGINT set; a second SIGINT raises
  KeyboardInterrupt at once."""
  stop = threading.Event()

  def handle(signum: int, frame: Any) -> None:
    del frame
    if stop.is_set() and signum == signal.SIGINT:
      raise KeyboardInterrupt
    stop.set()

  for signum in cli.STOP_SIGNALS:
    signal.signal(signum, handle)
  return stop


def _exit_stopped(message: str) -> None:
  print(f"[harvest] stop signal: {message}; exiting with "
        f"{cli.REQUEUE_EXIT_CODE}, rerun the same command to resume",
        flush=True)
  sys.exit(cli.REQUEUE_EXIT_CODE)


def main(argv: list[str]) -> None:
  stop = _stop_on_signals()
  try:
    _main(argv, stop)
  except harvest_lib.Stopped as e:
    _exit_stopped(f"{e}, saved" if e.done else
                  "stopped before the first batch, nothing to save")
  except KeyboardInterrupt:
    _exit_stopped("interrupted again, stopped at once (the last save "
                  "stands)")


def _say_whole_file(settings: harvest_settings.Settings) -> None:
  """Say so when the token file holds fewer positions than asked: the
  harvest reads each of its windows once rather than any twice."""
  held = settings.n_batches * settings.batch_size * settings.seq_len
  if settings.data_path and held < _POSITIONS.value:
    print(f"[harvest] {settings.data_path} holds {held} positions in whole "
          f"batches of {settings.batch_size} x {settings.seq_len}, fewer "
          f"than --positions={_POSITIONS.value}; harvesting each once",
          flush=True)


def check_memory(run: explore.LoadedRun,
                 settings: harvest_settings.Settings) -> None:
  """Raise `device_memory.DoesNotFit`, before anything is written or
  compiled, for a harvest whose batch (and its ablated forwards) cannot
  fit in the memory free to it (`harvest_lib.memory_floor`)."""
  chunk = _ABLATION_CHUNK.value
  ablating = f" and {chunk} ablated forwards of it" if (
    settings.ablation_batches) else ""
  device_memory.check_bytes(
    harvest_batches.memory_floor(run, settings, chunk),
    f"a batch of --batch_size={settings.batch_size} x {settings.seq_len} "
    f"positions{ablating}",
    "lower --batch_size" + (" or --ablation_chunk" if ablating else ""))


def _legacy(path: str, entries: list[str]) -> list[str]:
  # An older version's harvest (its state or manifest, before the
  # directory's own manifest): those, the clusters and the arrays' folders.
  files = (harvest_store.STATE_FILE, harvest_store.MANIFEST,
           harvest_store.CLUSTERS)
  if not set(files[:2]) & set(entries):
    return []
  return [e for e in entries
          if e in files or os.path.isdir(os.path.join(path, e))]


def claim_store(out: str, run: explore.LoadedRun,
                settings: harvest_settings.Settings) -> None:
  """Claim the harvest's directory (`io/owned_dir.py`), its lock held until
  the process ends: the token file's bytes recorded and compared (a
  harvest of a file since rewritten is not resumed), the harvest's own
  settings compared by `harvest_store.resume`."""
  data = (owned_dir.file_identity(settings.data_path)
          if settings.data_path else None)
  owned_dir.claim(out, "harvest", {"data": data}, _OVERWRITE.value,
                  "harvest", _legacy)
  owned_dir.record(out, harvest_store.STATE_FILE, harvest_store.MANIFEST,
                   *(site.name for site in run.target.sites))


def _checked_run():
  """Return the run the flags name and the placement to harvest it with,
  or fail on one line naming the flag at fault."""
  threshold = _THRESHOLD.value
  if threshold is not None and not 0.0 <= threshold < 1.0:
    # CI lies in [0, 1]: below 0 every component fires, at 1 none does.
    fail(f"--threshold must lie in [0, 1), the range of CI, got {threshold}")
  try:
    harvest_settings.check_request(request())
    harvest_settings.check_cadence(_SAVE_EVERY_S.value, _ABLATION_CHUNK.value)
  except ValueError as e:
    fail(_flagged(str(e)))
  try:
    placement = make_placement()
  except ValueError as e:
    fail(str(e))
  try:
    owned_dir.named(_RUN_DIR.value, "run_dir")
  except ValueError as e:
    fail(str(e))
  try:
    run = explore.load_run(_RUN_DIR.value)
  except (OSError, ValueError) as e:
    fail(f"--run_dir: {e}")
  return run, placement


def _harvest(run, placement, out: str, stop: threading.Event):
  """Return the harvest's settings and record (empty when stopped before
  its end), writing it into `out`; fail on one line where it cannot."""
  try:
    settings = harvest_settings.resolve(run, request())
    _say_whole_file(settings)
    if _ABLATION_BATCHES.value is None and not settings.ablation_batches:
      print("[harvest] no ablation effects, a language model's default "
            "(each batch costs a forward of it per component that fired); "
            "--ablation_batches=N measures them on N batches", flush=True)
    check_memory(run, settings)
    claim_store(out, run, settings)
    return settings, harvest_lib.harvest(
      run, settings, out, _SAVE_EVERY_S.value, _ABLATION_CHUNK.value,
      _OVERWRITE.value, say=lambda line: print(line, flush=True),
      placement=placement, stop=stop.is_set)
  except (owned_dir.OwnedConflict, device_memory.DoesNotFit) as e:
    fail(str(e))
  except harvest_store.HarvestConflict as e:
    fail(f"{e} (--overwrite)")
  except table_lib.LayoutError as e:
    fail(f"--place: {e}")
  except ValueError as e:
    fail(_flagged(str(e)))
  except OSError as e:
    fail(owned_dir.refusal(e, out))


def _record(out: str, run, settings, record: dict,
            stop: threading.Event) -> None:
  """Record a finished harvest: its entries, its manifest and, for a
  tagged harvest, the run's report with the comparison to the neurons."""
  # Every entry the harvest wrote (a language model's baselines too).
  owned_dir.record(out, *sorted(set(os.listdir(out)) - {
    run_dir.LOCK_FILE, owned_dir.MANIFEST_FILE}))
  path = harvest_lib.write_manifest(out, _RUN_DIR.value, run, settings,
                                    record)
  if "ratio_to_clean" in record:
    print(f"[harvest] throughput {record['ratio_to_clean']:.2f}x a clean "
          f"forward ({record['harvest_batches_per_s']:.1f} against "
          f"{record['clean_batches_per_s']:.1f} batches/s)")
  print(f"[harvest] wrote {path}")
  if "tags" in record:
    _rebuild_report(stop)


def _main(argv: list[str], stop: threading.Event) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; use --run_dir=DIR")
  run, placement = _checked_run()
  out = os.path.join(_RUN_DIR.value, harvest_store.HARVEST_DIR)
  settings, record = _harvest(run, placement, out, stop)
  if record:
    _record(out, run, settings, record, stop)


class _ReportStopped(Exception):
  """A stop signal arrived while the report's comparisons ran."""


def _stopping(map_fn: Callable, stop: threading.Event) -> Callable:
  """Return `map_fn` whose every item first checks `stop`: the report's
  comparisons take minutes on a large harvest, longer than a stop signal
  should wait."""

  def mapped(fn: Callable, items: Any) -> Any:
    def checked(item: Any) -> Any:
      if stop.is_set():
        raise _ReportStopped
      return fn(item)

    return map_fn(checked, items)

  return mapped


def _rebuild_report(stop: threading.Event) -> None:
  """Add the comparison with the neurons to the run's report, or, stopped
  on the way, exit for a requeue with the harvest whole and the report as
  it was (its pages are written atomically)."""
  try:
    with cli.thread_map() as map_fn:
      page = tag_summary.rebuild_report(
        _RUN_DIR.value, map_fn=_stopping(map_fn, stop)).page
  except ValueError as e:
    fail(f"--run_dir: {e}")
  except _ReportStopped:
    print(f"[harvest] stop signal: the harvest is complete and saved, its "
          f"report not rebuilt; `./dev report --run_dir={_RUN_DIR.value}` "
          f"rebuilds it; exiting with {cli.REQUEUE_EXIT_CODE}", flush=True)
    sys.exit(cli.REQUEUE_EXIT_CODE)
  print(f"[harvest] wrote {page}")


def _share_with_absl() -> None:
  """Add the harvest's flags to absl's, under the modules defining them
  (`--helpfull` lists flags by module)."""
  flags.FLAGS.append_flag_values(HARVEST_FLAGS)
  for module, module_flags in HARVEST_FLAGS.flags_by_module_dict().items():
    for flag in module_flags:
      flags.FLAGS.register_flag_by_module(module, flag)


def _main_after_launch(argv: list[str]) -> None:
  # absl parsed its own flags, which are these same flag objects; reading
  # them through HARVEST_FLAGS needs it marked too.
  HARVEST_FLAGS.mark_as_parsed()
  main(argv)


def entry() -> None:
  """Launch the absl app (used by the `bin/harvest` launcher)."""
  _share_with_absl()
  cli.launch("harvest", _main_after_launch)


if __name__ == "__main__":
  entry()
