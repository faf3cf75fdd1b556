"""Write a README gallery of a run's components: `bin/gallery --run_dir=D`.

Picks components from the run's tagged harvest by the rule of
`analysis/gallery_picks.py` (stated at the gallery's head) and prints each as a
markdown entry: its label (top coarse class and tag, purity, lift) and
three top contexts as text, decoded by the run's tokenizer. `--output`
writes the markdown to a file instead, claimed as `io/owned_dir.py` says
for a file: its path named, one writer at a time (the lock of
`.NAME.lock` beside it), and `.NAME.written.json` beside it records the
settings that chose it (the harvest by its manifest's bytes, and the
gallery's flags). The same settings write it again; other settings are
refused unless `--overwrite`, and a file no gallery run wrote is never
replaced.
"""

import contextlib
import os
from collections.abc import Iterator

from absl import flags, logging

from decompax.analysis import explore
from decompax.analysis import gallery_picks as gallery_lib
from decompax.analysis import harvesting as harvest_lib
from decompax.bin import cli, tokens_text
from decompax.io import harvest_store, owned_dir, run_dir

_RUN_DIR = flags.DEFINE_string(
  "run_dir", None, "Run directory with a finished harvest of a token file "
  "with a tag stream (bin/harvest).", required=True)
_OUTPUT = flags.DEFINE_string(
  "output", None, "Write the markdown here (default: print it).")
_COUNT = flags.DEFINE_integer("count", gallery_lib.COUNT,
                              "Components in the gallery.", lower_bound=1)
_PER_CLASS = flags.DEFINE_integer(
  "per_class", gallery_lib.PER_CLASS,
  "At most this many components of one coarse class.", lower_bound=1)
_ACTIVE = cli.define_float(
  "active", gallery_lib.ACTIVE, "Candidates hold at least this multiple of "
  "their site's mean share of its CI (finite, >= 0).", __name__,
  lower_bound=0.0)
_CONTEXTS = flags.DEFINE_integer("contexts", gallery_lib.CONTEXTS,
                                 "Top contexts per entry.", lower_bound=1)
_OVERWRITE = flags.DEFINE_bool(
  "overwrite", False, "Replace an --output that a gallery of other "
  "settings wrote.")


def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  cli.fail("gallery", message)


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; use --run_dir=DIR")
  path = _RUN_DIR.value
  if _OUTPUT.value is not None:
    try:
      owned_dir.check_file(_OUTPUT.value, "output")
    except ValueError as e:
      fail(str(e))
  try:
    # The flags first: a directory that is no run is said as such.
    model_dir = explore.run_config(path).model_dir
    harvest = harvest_lib.load_harvest(path)
  except (OSError, ValueError) as e:
    fail(f"--run_dir: {e}")
  decode = tokens_text.token_decoder(model_dir) if model_dir else str
  if _OUTPUT.value is None:
    print(markdown(harvest, path, decode), end="")
    return
  with claimed(settings(path)):
    text = markdown(harvest, path, decode)
    try:
      run_dir.atomic_write(_OUTPUT.value,
                           lambda f: f.write(text.encode("utf-8")))
    except OSError as e:
      fail(f"--output: {owned_dir.refusal(e, _OUTPUT.value)}")
  print(f"[gallery] wrote {_OUTPUT.value}")


def markdown(harvest: harvest_lib.Harvest, path: str, decode) -> str:
  """Return the gallery of `harvest` as markdown (`gallery_picks`)."""
  try:
    return gallery_lib.gallery_markdown(
      harvest, os.path.basename(os.path.abspath(path)), decode,
      _COUNT.value, _PER_CLASS.value, _ACTIVE.value, _CONTEXTS.value)
  except ValueError as e:
    fail(f"--run_dir: {e}")


def settings(run_path: str) -> dict:
  """Return what decides the gallery: the harvest (its manifest's size
  and hash; where it lies is recorded, not compared) and the flags that
  choose and show its entries."""
  manifest = os.path.join(run_path, harvest_store.HARVEST_DIR,
                          harvest_store.MANIFEST)
  return {"harvest": owned_dir.file_identity(manifest),
          "count": _COUNT.value, "per_class": _PER_CLASS.value,
          "active": _ACTIVE.value, "contexts": _CONTEXTS.value}


@contextlib.contextmanager
def claimed(chosen: dict) -> Iterator[None]:
  """Hold --output for this gallery for the block, which writes it
  (`owned_dir.claimed_output`: refused on one line where it may not)."""
  with contextlib.ExitStack() as stack:
    try:
      stack.enter_context(owned_dir.claimed_output(
        _OUTPUT.value, "output", "gallery", chosen, _OVERWRITE.value,
        "gallery"))
    except ValueError as e:
      fail(str(e))
    yield


def entry() -> None:
  """Launch the absl app (used by the `bin/gallery` launcher)."""
  cli.launch("gallery", main)


if __name__ == "__main__":
  entry()
