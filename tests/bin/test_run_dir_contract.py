"""Every binary that writes, through each case of the one contract of what
it writes (`io/owned_dir.py`; `bin/train`'s run directory keeps its own
`flags.txt` and `.run_files` as its manifest, `io/run_dir.py`).

One table: a row per binary, a column per case. A cell is the arguments
of one launch, what to prepare first and what must follow: a refusal is
exit 2 and exactly one line `<program>: error:` holding the fragment (and,
where marked, the directory left as it was, but for locks); the `written`
case is a launch that succeeds over a stale lock of a dead holder and
leaves its manifest. A case that cannot arise for a binary names why
instead. All cells launch at once through `run_binaries.py`.

`{T}` in arguments is the cell's own temporary directory, `{ROOT}` the
repository.
"""

import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pytest

from decompax.io import owned_dir, run_dir, tokens

ROOT = pathlib.Path(__file__).resolve().parents[2]
CASES = ("blank", "in_use", "written", "other_settings", "overwrite_foreign",
         "under_a_file", "full_disk", "read_only")
# The first write of every binary is an atomic one (fsync, then rename):
# a disk that fills refuses the fsync; a read-only mount, the temporary.
FULL_DISK = (
  "import errno, os\n"
  "def _full(fd):\n"
  "  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
  "os.fsync = _full\n")
READ_ONLY = (
  "import errno, os, tempfile\n"
  "def _read_only(*args, dir=None, **kwargs):\n"
  "  raise OSError(errno.EROFS, os.strerror(errno.EROFS), dir)\n"
  "tempfile.mkstemp = _read_only\n")
DEAD_PID = 999_999_999


class Cell(NamedTuple):
  argv: tuple[str, ...]
  fragment: str = ""
  code: int = 2
  setup: Callable[[pathlib.Path], object] | None = None
  prelude: str = ""
  untouched: bool = False
  check: Callable[[pathlib.Path], None] | None = None


class Inapplicable(NamedTuple):
  why: str


# Setups: each gets the cell's directory; a process it returns is killed
# once the cells have run.

def _all(*setups):
  def setup(t):
    made = [s(t) for s in setups]
    return next((m for m in made if isinstance(m, subprocess.Popen)), None)
  return setup


def _holder(relative: str, file: bool = False):
  """Hold the lock of {T}/relative (a directory, or with `file` a file's)
  from a live process."""

  def setup(t):
    path = t / relative
    if not file:
      path.mkdir(parents=True, exist_ok=True)
    # Kept in a name: the lock lives as long as its context.
    take = (f"held = run_dir.locked_file({str(path)!r}, 'x', 'w'); "
            "held.__enter__()"
            if file else f"run_dir.lock_dir({str(path)!r}, 'x', 'w')")
    holder = subprocess.Popen(
      [sys.executable, "-P", "-c",
       "import sys; from decompax.io import run_dir; "
       f"{take}; print('locked', flush=True); sys.stdin.read()"],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder
  return setup


def _stale(relative: str):
  """Leave {T}/relative a lock file of a dead holder on this host."""

  def setup(t):
    path = t / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"pid {DEAD_PID} on {socket.gethostname()}\n")
  return setup


def _user_files(relative: str):
  """Leave {T}/relative a folder of a user's files, no manifest."""

  def setup(t):
    (t / relative).mkdir(parents=True, exist_ok=True)
    (t / relative / "model.safetensors").write_text("a user's")
    (t / relative / "notes.txt").write_text("a user's")
  return setup


def _file(relative: str):
  def setup(t):
    (t / relative).parent.mkdir(parents=True, exist_ok=True)
    (t / relative).write_text("a regular file")
  return setup


def _mkdir(relative: str):
  def setup(t):
    (t / relative).mkdir(parents=True, exist_ok=True)
  return setup


def _manifest(relative: str, program: str):
  """Leave {T}/relative `program`'s output made with other settings."""

  def setup(t):
    (t / relative).mkdir(parents=True, exist_ok=True)
    (t / relative / owned_dir.MANIFEST_FILE).write_text(json.dumps({
      "format": owned_dir.MANIFEST_FORMAT, "program": program,
      "settings": {"data": {"sha256": "0" * 64}}, "entries": []}))
  return setup


# Inputs.

_FINISHED = {}
# Made-up nouns enough for a BPE vocabulary of 300.
WORDS = ["".join(random.Random(i).choices("abcdefghijklmnop", k=6)) + "/nn"
         for i in range(200)]


def _corpus(t):
  """Leave {T}/c, 500 documents in Brown's format."""
  from decompax.targets import brown  # noqa: PLC0415

  (t / "c").mkdir()
  for name in brown.document_names():
    rng = random.Random(name)
    words = [rng.choice(WORDS) for _ in range(12)]
    (t / "c" / name).write_text("\n\n\t" + " ".join(words) + " ./.\n")


def _lm_data(t):
  """Leave {T}/d, token files of the tiny preset's vocabulary."""
  (t / "d").mkdir()
  for part in ("train", "held_out"):
    tokens.write_tokens(t / "d" / f"{part}.bin", [np.arange(400) % 300],
                        300, 0, "t")
  (t / "d" / "tokenizer.json").write_text("{}")


def _tokenizer(t):
  """Leave {T}/tok, a word-level tokenizer, and {T}/w.txt to tokenize."""
  import transformers  # noqa: PLC0415 (slow; only tokenizer cells need it)
  from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

  words = ["[UNK]", "[EOS]", "the", "cat"]
  level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                     unk_token="[UNK]"))
  level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=level, eos_token="[EOS]", unk_token="[UNK]",
  ).save_pretrained(t / "tok")
  (t / "w.txt").write_text("the cat " * 50 + "\n")


def _run_copy(name: str, harvest: bool = False):
  """Leave {T}/r a finished run of `name` (with its harvest, or an empty
  harvest/)."""

  def setup(t):
    source = _FINISHED["harvested" if harvest else "run"](name)
    shutil.copytree(source, t / "r", ignore=None if harvest else
                    shutil.ignore_patterns("harvest"))
    (t / "r" / "harvest").mkdir(exist_ok=True)
    (t / "r" / "harvest" / run_dir.LOCK_FILE).unlink(missing_ok=True)
  return setup


def _tms_target(t):
  shutil.copy(os.path.join(_FINISHED["run"]("tms"), "target.npz"),
              t / "target.npz")


def _harvest_manifest(t):
  """Give {T}/r's harvest the manifest a harvest of this version writes."""
  os.close(owned_dir.claim(t / "r" / "harvest", "harvest", {"data": None},
                           False, "harvest", lambda path, e: e).lock)


def _file_output(relative: str, program: str):
  """Leave {T}/relative a file `program` wrote with other settings (its
  manifest beside it)."""

  def setup(t):
    (t / relative).write_text(f"a {program} output")
    (pathlib.Path(owned_dir.file_manifest(t / relative))).write_text(
      json.dumps({"format": owned_dir.MANIFEST_FORMAT, "program": program,
                  "settings": {"run": {"sha256": "0" * 64}},
                  "entries": [pathlib.Path(relative).name]}))
  return setup


def _train_run_with_other_flags(t):
  (t / "r").mkdir()
  (t / "r" / "flags.txt").write_text("--lr=0.5\n")


# Checks of the `written` cells.

def _lock_taken_over(path: pathlib.Path) -> None:
  if path.exists():
    assert f"pid {DEAD_PID} " not in path.read_text()


def _manifest_lists(relative: str, program: str, *entries: str):
  def check(t):
    manifest = owned_dir.read_manifest(t / relative)
    assert manifest["program"] == program
    assert set(entries) <= set(manifest["entries"]), manifest["entries"]
    for entry in entries:
      assert (t / relative / entry).exists(), entry
    _lock_taken_over(t / relative / run_dir.LOCK_FILE)
  return check


def _train_written(t):
  assert (t / "o" / "flags.txt").is_file()
  assert (t / "o" / "checkpoints").is_dir()
  _lock_taken_over(t / "o" / run_dir.LOCK_FILE)


def _tokens_written(t):
  assert tokens.open_tokens(t / "o.bin").header.num_tokens == 101
  assert sorted(os.listdir(t)) == ["o.bin", "o.json", "tok", "w.txt"]


def _graph_written(t):
  assert (t / "g.png").read_bytes()[:4] == b"\x89PNG"
  manifest = json.loads(pathlib.Path(
    owned_dir.file_manifest(t / "g.png")).read_text())
  assert manifest["program"] == "graph"
  assert manifest["entries"] == ["g.png"]
  assert manifest["settings"]["tokens"] == [0, 1]
  assert len(manifest["settings"]["run"]["sha256"]) == 64
  assert not (t / ".g.png.lock").exists()


# Stopped after its first save: what it writes of its directory is written
# by then, and its final figures and report (seconds of plotting) are other
# tests' (tests/bin/test_train.py's short run).
TRAIN = ("--num_steps=4", "--save_every=2", "--stop_after_step=2",
         "--log_every=2", "--batch_size=8", "--eval_every=0",
         "--slow_eval_every=0", "--figures_every=0",
         "--target_path={T}/target.npz")
TRAIN_LM = ("--preset=tiny", "--data_dir={T}/d", "--num_steps=2",
            "--eval_every_steps=0", "--max_eval_windows=2")
BROWN = ("--brown_dir={T}/c", "--vocab_sizes=300")
HARVEST = ("--run_dir={T}/r", "--positions=512", "--batch_size=64",
           "--top_k=3", "--ablation_batches=1")
TOKENIZE = ("--tokenizer={T}/tok", "--input={T}/w.txt")
GRAPH = ("--run_dir={T}/r", "--tokens=0,1")
# A transcoder of two steps on the tiny Llama's run, judged on a few
# positions of its own token file (no harvest: `--k` given).
TRANSCODER = ("--run_dir={T}/r", "--k=2", "--num_steps=2", "--batch_size=2",
              "--seq_len=8", "--eval_positions=32", "--eval_batch_size=2",
              "--decomposition_ce=false")
GALLERY = ("--run_dir={T}/r", "--output={T}/g.md")
FOREIGN = "which no {program} run wrote"

TABLE: dict[str, dict[str, Cell | Inapplicable]] = {
  "train": {
    "blank": Cell((*TRAIN, "--output_dir= "), "names no directory",
                  untouched=True),
    "in_use": Cell((*TRAIN, "--output_dir={T}/o"), "is in use by pid",
                   setup=_all(_tms_target, _holder("o"))),
    "written": Cell((*TRAIN, "--output_dir={T}/o"), code=0,
                    setup=_all(_tms_target, _stale("o/.lock")),
                    check=_train_written),
    "other_settings": Cell(
      (*TRAIN, "--output_dir={T}/r"), "holds a run with other flags (",
      setup=_all(_tms_target, _train_run_with_other_flags), untouched=True),
    "overwrite_foreign": Cell(
      (*TRAIN, "--output_dir={T}/u", "--overwrite"), "no run wrote them",
      setup=_all(_tms_target, _user_files("u"), _file("u/metrics.jsonl")),
      untouched=True),
    "under_a_file": Cell((*TRAIN, "--output_dir={T}/f/o"), "is a file",
                         setup=_all(_tms_target, _file("f")), untouched=True),
    "full_disk": Cell((*TRAIN, "--output_dir={T}/o"), "No space left",
                      setup=_tms_target, prelude=FULL_DISK),
    "read_only": Cell((*TRAIN, "--output_dir={T}/o"), "Read-only file system",
                      setup=_all(_tms_target, _mkdir("o")),
                      prelude=READ_ONLY),
  },
  "train_lm": {
    "blank": Cell((*TRAIN_LM, "--output_dir= ", "--overwrite"),
                  "--output_dir=' ' names no path", setup=_lm_data,
                  untouched=True),
    "in_use": Cell((*TRAIN_LM, "--output_dir={T}/o"), "is in use by pid",
                   setup=_all(_lm_data, _holder("o"))),
    "written": Cell((*TRAIN_LM, "--output_dir={T}/o"), code=0,
                    setup=_all(_lm_data, _stale("o/.lock")),
                    check=_manifest_lists(
                      "o", "train_lm", "train_state.npz", "train_lm.json",
                      "model.safetensors", "config.json", "tokenizer.json")),
    "other_settings": Cell(
      (*TRAIN_LM, "--output_dir={T}/o"), "made with other settings (data",
      setup=_all(_lm_data, _manifest("o", "train_lm")), untouched=True),
    "overwrite_foreign": Cell(
      (*TRAIN_LM, "--output_dir={T}/u", "--overwrite"),
      FOREIGN.format(program="train_lm"), setup=_all(_lm_data,
                                                      _user_files("u")),
      untouched=True),
    "under_a_file": Cell((*TRAIN_LM, "--output_dir={T}/f/o"),
                         "{T}/f is a file, not a directory",
                         setup=_all(_lm_data, _file("f")), untouched=True),
    "full_disk": Cell((*TRAIN_LM, "--output_dir={T}/o"),
                      "No space left on device", setup=_lm_data,
                      prelude=FULL_DISK, untouched=True),
    "read_only": Cell((*TRAIN_LM, "--output_dir={T}/o"),
                      "Read-only file system",
                      setup=_all(_lm_data, _mkdir("o")), prelude=READ_ONLY,
                      untouched=True),
  },
  "prepare_brown": {
    "blank": Cell((*BROWN, "--data_dir= "), "--data_dir=' ' names no path",
                  untouched=True),
    "in_use": Cell((*BROWN, "--data_dir={T}/d"), "is in use by pid",
                   setup=_all(_corpus, _holder("d"))),
    "written": Cell((*BROWN, "--data_dir={T}/d"), code=0,
                    setup=_all(_corpus, _stale("d/.lock")),
                    check=_manifest_lists("d", "prepare_brown", "corpus",
                                          "split.json", "bpe-300")),
    "other_settings": Cell(
      (*BROWN, "--data_dir={T}/d"), "made with other settings (corpus",
      setup=_all(_corpus, _manifest("d", "prepare_brown")), untouched=True),
    "overwrite_foreign": Cell(
      (*BROWN, "--data_dir={T}/u", "--overwrite"),
      FOREIGN.format(program="prepare_brown"),
      setup=_all(_corpus, _user_files("u")), untouched=True),
    "under_a_file": Cell((*BROWN, "--data_dir={T}/f/d"),
                         "{T}/f is a file, not a directory",
                         setup=_all(_corpus, _file("f")), untouched=True),
    "full_disk": Cell((*BROWN, "--data_dir={T}/d"), "No space left on device",
                      setup=_corpus, prelude=FULL_DISK, untouched=True),
    "read_only": Cell((*BROWN, "--data_dir={T}/d"), "Read-only file system",
                      setup=_all(_corpus, _mkdir("d")), prelude=READ_ONLY,
                      untouched=True),
  },
  "harvest": {
    "blank": Cell(("--run_dir= ",), "--run_dir=' ' names no path",
                  untouched=True),
    "in_use": Cell(HARVEST, "harvest {T}/r/harvest is in use by pid",
                   setup=_all(_run_copy("tms"), _holder("r/harvest"))),
    "written": Cell(HARVEST, code=0, setup=_all(
      _run_copy("tms", harvest=True), _stale("r/harvest/.lock")),
      check=_manifest_lists("r/harvest", "harvest", "manifest.json")),
    "other_settings": Cell(
      HARVEST, "made with other settings (data", setup=_all(
        _run_copy("tms"), _manifest("r/harvest", "harvest")),
      untouched=True),
    "overwrite_foreign": Cell(
      (*HARVEST, "--overwrite"), FOREIGN.format(program="harvest"),
      setup=_all(_run_copy("tms"), _user_files("r/harvest")),
      untouched=True),
    "under_a_file": Cell(HARVEST, "{T}/r/harvest is a file, not a directory",
                         setup=_all(_run_copy("tms"), lambda t: (
                           (t / "r" / "harvest").rmdir(),
                           _file("r/harvest")(t))), untouched=True),
    "full_disk": Cell(HARVEST, "No space left on device",
                      setup=_run_copy("tms"), prelude=FULL_DISK),
    "read_only": Cell(HARVEST, "Read-only file system",
                      setup=_run_copy("tms"), prelude=READ_ONLY),
  },
  "cluster": {
    "blank": Cell(("--run_dir= ",), "--run_dir=' ' names no path",
                  untouched=True),
    "in_use": Cell(("--run_dir={T}/r",), "harvest {T}/r/harvest is in use",
                   setup=_all(_run_copy("tms", harvest=True),
                              _holder("r/harvest"))),
    "written": Cell(("--run_dir={T}/r",), code=0, setup=_all(
      _run_copy("tms", harvest=True), _harvest_manifest,
      _stale("r/harvest/.lock")),
      check=_manifest_lists("r/harvest", "harvest", "clusters.json")),
    "other_settings": Inapplicable(
      "it adds clusters.json to a harvest, recomputed whole each time from "
      "the harvest it reads: it has no settings of its own to resume"),
    "overwrite_foreign": Inapplicable(
      "it has no --overwrite: its one file is replaced atomically, and a "
      "directory not a harvest's is refused (`owned_dir.enter`)"),
    "under_a_file": Inapplicable(
      "it writes into the harvest's existing directory, which it reads "
      "first (a file there is 'no finished harvest')"),
    "full_disk": Cell(("--run_dir={T}/r",), "No space left on device",
                      setup=_run_copy("tms", harvest=True),
                      prelude=FULL_DISK),
    "read_only": Cell(("--run_dir={T}/r",), "Read-only file system",
                      setup=_run_copy("tms", harvest=True),
                      prelude=READ_ONLY),
  },
  "train_transcoder": {
    "blank": Cell((*TRANSCODER, "--output_dir= "),
                  "--output_dir=' ' names no path", untouched=True),
    "in_use": Cell((*TRANSCODER, "--output_dir={T}/o"), "is in use by pid",
                   setup=_all(_run_copy("tiny_llama"), _holder("o"))),
    "written": Cell((*TRANSCODER, "--output_dir={T}/o"), code=0,
                    setup=_all(_run_copy("tiny_llama"), _stale("o/.lock")),
                    check=_manifest_lists(
                      "o", "train_transcoder", "transcoders.npz",
                      "results.json", "results.md")),
    "other_settings": Cell(
      (*TRANSCODER, "--output_dir={T}/o"), "made with other settings (",
      setup=_all(_run_copy("tiny_llama"), _manifest("o", "train_transcoder")),
      untouched=True),
    "overwrite_foreign": Cell(
      (*TRANSCODER, "--output_dir={T}/u", "--overwrite"),
      FOREIGN.format(program="train_transcoder"),
      setup=_all(_run_copy("tiny_llama"), _user_files("u")), untouched=True),
    "under_a_file": Cell((*TRANSCODER, "--output_dir={T}/f/o"),
                         "{T}/f is a file, not a directory",
                         setup=_all(_run_copy("tiny_llama"), _file("f")),
                         untouched=True),
    "full_disk": Cell((*TRANSCODER, "--output_dir={T}/o"),
                      "No space left on device",
                      setup=_run_copy("tiny_llama"), prelude=FULL_DISK,
                      untouched=True),
    "read_only": Cell((*TRANSCODER, "--output_dir={T}/o"),
                      "Read-only file system",
                      setup=_all(_run_copy("tiny_llama"), _mkdir("o")),
                      prelude=READ_ONLY, untouched=True),
  },
  "tokenize": {
    "blank": Cell((*TOKENIZE, "--output= "), "--output=' ' names no path",
                  setup=_tokenizer, untouched=True),
    "in_use": Cell((*TOKENIZE, "--output={T}/o.bin"),
                   "token file {T}/o.bin is in use by pid",
                   setup=_all(_tokenizer, _holder("o.bin", file=True))),
    "written": Cell((*TOKENIZE, "--output={T}/o.bin"), code=0,
                    setup=_all(_tokenizer, _stale(".o.bin.lock")),
                    check=_tokens_written),
    "other_settings": Cell(
      (*TOKENIZE, "--output={T}/o.bin"), "exists; pass --overwrite",
      setup=_all(_tokenizer, _file("o.bin")), untouched=True),
    "overwrite_foreign": Cell(
      (*TOKENIZE, "--output={T}/o.bin", "--overwrite"),
      "is no token file of bin/tokenize", setup=_all(_tokenizer,
                                                     _file("o.bin")),
      untouched=True),
    "under_a_file": Cell((*TOKENIZE, "--output={T}/f/o.bin"), "{T}/f",
                         setup=_all(_tokenizer, _file("f")), untouched=True),
    "full_disk": Cell((*TOKENIZE, "--output={T}/o.bin"),
                      "No space left on device", setup=_tokenizer,
                      prelude=FULL_DISK, untouched=True),
    "read_only": Cell((*TOKENIZE, "--output={T}/o.bin"),
                      "Read-only file system", setup=_tokenizer,
                      prelude=READ_ONLY, untouched=True),
  },
  "graph": {
    "blank": Cell((*GRAPH, "--output= "), "--output=' ' names no path",
                  untouched=True),
    "in_use": Cell((*GRAPH, "--output={T}/g.png"),
                   "--output: figure {T}/g.png is in use by pid",
                   setup=_all(_run_copy("induction"),
                              _holder("g.png", file=True))),
    "written": Cell((*GRAPH, "--output={T}/g.png"), code=0,
                    setup=_all(_run_copy("induction"), _stale(".g.png.lock")),
                    check=_graph_written),
    "other_settings": Cell(
      (*GRAPH, "--output={T}/g.png"),
      "{T}/g.png holds graph output made with other settings (",
      setup=_all(_run_copy("induction"), _file_output("g.png", "graph")),
      untouched=True),
    "overwrite_foreign": Cell(
      (*GRAPH, "--output={T}/g.png", "--overwrite"),
      "{T}/g.png exists and no graph run wrote it",
      setup=_all(_run_copy("induction"), _file("g.png")), untouched=True),
    "under_a_file": Cell((*GRAPH, "--output={T}/f/g.png"), "{T}/f",
                         setup=_file("f"), untouched=True),
    "full_disk": Cell((*GRAPH, "--output={T}/g.png"),
                      "No space left on device",
                      setup=_run_copy("induction"), prelude=FULL_DISK,
                      untouched=True),
    "read_only": Cell((*GRAPH, "--output={T}/g.png"),
                      "Read-only file system", setup=_run_copy("induction"),
                      prelude=READ_ONLY, untouched=True),
  },
  # Its claim comes before the gallery is chosen, so a harvest without the
  # tag statistics a gallery needs (the suite's) meets every refusal.
  "gallery": {
    "blank": Cell(("--run_dir={T}/r", "--output= "),
                  "--output=' ' names no path", untouched=True),
    "in_use": Cell(GALLERY, "--output: gallery {T}/g.md is in use by pid",
                   setup=_all(_run_copy("tms", harvest=True),
                              _holder("g.md", file=True))),
    "written": Inapplicable(
      "it needs a tagged harvest of a language model, which the suite's "
      "short runs lack (tests/analysis/test_gallery_picks.py checks the "
      "markdown it writes; the other cells, its claim)"),
    "other_settings": Cell(
      GALLERY, "{T}/g.md holds gallery output made with other settings (",
      setup=_all(_run_copy("tms", harvest=True),
                 _file_output("g.md", "gallery")), untouched=True),
    "overwrite_foreign": Cell(
      (*GALLERY, "--overwrite"), "{T}/g.md exists and no gallery run wrote "
      "it", setup=_all(_run_copy("tms", harvest=True), _file("g.md")),
      untouched=True),
    "under_a_file": Cell(("--run_dir={T}/r", "--output={T}/f/g.md"),
                         "{T}/f", setup=_file("f"), untouched=True),
    "full_disk": Cell(GALLERY, "No space left on device",
                      setup=_run_copy("tms", harvest=True),
                      prelude=FULL_DISK, untouched=True),
    "read_only": Cell(GALLERY, "Read-only file system",
                      setup=_run_copy("tms", harvest=True),
                      prelude=READ_ONLY, untouched=True),
  },
}
# Defects of the binaries' own that the cases above do not name, each a
# launch as a cell is.
DEFECTS: dict[str, tuple[str, Cell]] = {
  # 2: an empty --output_dir meant models/<preset>, replaced with --overwrite.
  "train_lm_output_dir_empty": ("train_lm", Cell(
    (*TRAIN_LM, "--output_dir=", "--overwrite"),
    "--output_dir='' names no path", setup=_lm_data, untouched=True)),
  # 14: tracebacks of train_lm's output directory.
  "train_lm_output_dir_in_proc": ("train_lm", Cell(
    (*TRAIN_LM, "--output_dir=/proc/x"), "/proc/x", setup=_lm_data)),
  # 19: a --brown_dir that is a file "does not exist"; a --data_dir that
  # is one, a bare "[Errno 17] File exists".
  "brown_dir_is_a_file": ("prepare_brown", Cell(
    ("--brown_dir={T}/f", "--data_dir={T}/d"),
    "corpus directory {T}/f is a file, not a directory", setup=_file("f"),
    untouched=True)),
  "brown_data_dir_is_a_file": ("prepare_brown", Cell(
    (*BROWN, "--data_dir={T}/f"),
    "--data_dir {T}/f is a file, not a directory; choose another",
    setup=_all(_corpus, _file("f")), untouched=True)),
}
PROGRAMS = {"tokenize": "tokenize"}
CELLS = [(program, case) for program in TABLE for case in CASES]


def _fill(text: str, t: pathlib.Path) -> str:
  return text.replace("{T}", str(t)).replace("{ROOT}", str(ROOT))


def _listing(directory: pathlib.Path) -> dict[str, str | None]:
  """Return every entry under `directory` but locks: a file's text, None
  for a directory."""
  return {str(p.relative_to(directory)):
          p.read_text(errors="replace") if p.is_file() else None
          for p in sorted(directory.rglob("*"))
          if not p.name.endswith(".lock")}


class Result(NamedTuple):
  code: int
  stderr: str
  directory: pathlib.Path
  before: dict | None


def _launch(specs: list[dict]) -> dict[str, int]:
  runner = subprocess.run(
    [sys.executable, "-P", str(pathlib.Path(__file__).with_name(
      "run_binaries.py"))], input=json.dumps(specs), capture_output=True,
    text=True, timeout=1200, cwd=ROOT)
  assert runner.returncode == 0, runner.stderr
  return json.loads(runner.stdout)


def _spec(t: pathlib.Path, program: str, cell: Cell,
          logs: pathlib.Path) -> dict:
  return {"id": t.name, "program": program,
          "argv": [_fill(a, t) for a in cell.argv], "cwd": str(t),
          "env": {"JAX_PLATFORMS": "cpu"}, "prelude": cell.prelude,
          "out": str(logs)}


@pytest.fixture(scope="module")
def results(tmp_path_factory, finished_run, harvested_tms):
  """Launch every applicable cell once; return its result by cell."""
  _FINISHED["run"] = finished_run
  _FINISHED["harvested"] = lambda name: harvested_tms
  base = tmp_path_factory.mktemp("contract")
  logs = base / "logs"
  logs.mkdir()
  holders, specs, before = [], [], {}
  try:
    for program, case in CELLS:
      cell = TABLE[program][case]
      if isinstance(cell, Inapplicable):
        continue
      t = base / f"{program}-{case}"
      t.mkdir()
      made = cell.setup(t) if cell.setup else None
      if isinstance(made, subprocess.Popen):
        holders.append(made)
      before[t.name] = _listing(t) if cell.untouched else None
      specs.append(_spec(t, program, cell, logs))
    for name, (program, cell) in DEFECTS.items():
      t = base / name
      t.mkdir()
      if cell.setup:
        cell.setup(t)
      before[name] = _listing(t) if cell.untouched else None
      specs.append(_spec(t, program, cell, logs))
    codes = _launch(specs)
  finally:
    for holder in holders:
      holder.kill()
      holder.wait()
  return {name: Result(codes[name], (logs / f"{name}.stderr").read_text(),
                       base / name, before[name]) for name in codes}


def test_the_table_holds_every_case_of_every_writing_binary():
  assert set(TABLE) == {"train", "train_lm", "prepare_brown", "harvest",
                        "cluster", "train_transcoder", "tokenize", "graph",
                        "gallery"}
  for program, cells in TABLE.items():
    assert tuple(cells) == CASES, program
    # The cases every binary that writes a directory takes, and those that
    # claim their files before they compute them.
    if program in ("train", "train_lm", "prepare_brown", "harvest",
                   "train_transcoder", "graph"):
      assert not any(isinstance(c, Inapplicable) for c in cells.values())


@pytest.mark.parametrize("program,case", CELLS,
                         ids=[f"{p}-{c}" for p, c in CELLS])
def test_every_writing_binary_keeps_the_contract(results, program, case):
  cell = TABLE[program][case]
  if isinstance(cell, Inapplicable):
    pytest.skip(f"{program} {case}: {cell.why}")
  _check(results[f"{program}-{case}"], program, cell)


@pytest.mark.parametrize("name", sorted(DEFECTS))
def test_a_defect_of_the_output_is_one_line(results, name):
  program, cell = DEFECTS[name]
  _check(results[name], program, cell)


def _check(result: Result, program: str, cell: Cell) -> None:
  t = result.directory
  assert "Traceback" not in result.stderr, result.stderr
  assert result.code == cell.code, result.stderr
  if cell.code:
    lines = result.stderr.splitlines()
    errors = [line for line in lines
              if line.startswith(f"{PROGRAMS.get(program, program)}: error: ")]
    assert len(errors) == 1, result.stderr
    assert _fill(cell.fragment, t) in errors[0]
  if cell.check:
    cell.check(t)
  if result.before is not None:
    assert _listing(t) == result.before
