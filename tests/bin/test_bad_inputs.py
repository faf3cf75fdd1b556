"""Every bad input to the binaries: one line naming the problem and the fix.

One table, one row per case: the program, its arguments, what to prepare
first, the exit code and a fragment of the one-line message. All rows run
once per module, in parallel, through `run_binaries.py` (each program's
launcher in a forked child). Each row's stderr must hold exactly one line
starting with `<program>: error:` (exit 2; 3 for a diverged run) and no
traceback. A row marked `untouched` must leave its directory as its setup
made it (but for a run's `.lock`).

`{T}` in arguments and the working directory is the row's own temporary
directory, `{ROOT}` the repository (the default working directory). A row
with `harvested` finds a finished TMS run with a finished harvest at `{T}/r`
before its setup runs; a setup may instead copy one of the suite's finished
runs there with an empty harvest (`_run_copy`).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pytest
from absl import flags

from decompax.bin import train
from decompax.io import owned_dir, run_dir, tokens

ROOT = pathlib.Path(__file__).resolve().parents[2]
LLAMA = ("--flagfile={ROOT}/flags/tiny_llama.flags",)
OUT = "--output_dir={T}/o"
# A run of seconds: a row that regresses into training ends soon.
SHORT = ("--num_steps=4", "--save_every=2", "--log_every=2", "--batch_size=8",
         "--eval_every=0", "--slow_eval_every=0", "--figures_every=0")
RESTARTS = ("--restarts=2", "--num_steps=20", "--select_at=10",
            "--save_every=10", "--log_every=10", "--eval_every=10",
            "--slow_eval_every=10")
# The default target (TMS 5-2), trained: a copy of the suite's finished
# run's cache (`_tms_target`), so that a row that compiles a step does not
# train the toy first.
TMS_TARGET = "--target_path={T}/target.npz"
DIVERGE = ("--num_steps=10", "--save_every=5", "--log_every=5",
           "--batch_size=32", "--eval_every=0", "--slow_eval_every=0",
           "--figures_every=0", "--faithfulness_warmup_steps=5", "--lr=1e6",
           TMS_TARGET)


class Row(NamedTuple):
  id: str
  program: str
  argv: tuple[str, ...]
  fragment: str
  code: int = 2
  setup: Callable[[pathlib.Path], object] | None = None
  prelude: str = ""
  harvested: bool = False
  cwd: str = "{ROOT}"
  untouched: bool = False


# Setups: each gets the row's directory and may return a process to kill
# once the rows have run.

def _flagfile(text: str):
  def setup(t):
    (t / "f.flags").write_text(text + "\n")
  return setup


def _touch(t):
  (t / "afile").write_text("x")


def _model_copy(name: str, damage: Callable[[pathlib.Path], None]):
  def setup(t):
    shutil.copytree(ROOT / "tests" / "fixtures" / name, t / "m")
    damage(t / "m")
  return setup


def _cut(size: Callable[[int], int]):
  def damage(model):
    path = model / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:size(len(data))])
  return damage


def _drop_second_shard(model):
  (model / "model-00002-of-00002.safetensors").unlink()


def _config_json(**changes):
  def damage(model):
    path = model / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))
  return damage


def _config_text(text: str):
  def damage(model):
    (model / "config.json").write_text(text)
  return damage


def _widen_second_layer(model):
  """Give layer 1's up_proj one output row more than layer 0's."""
  from safetensors.numpy import load_file, save_file  # noqa: PLC0415
  path = model / "model.safetensors"
  tensors = load_file(path)
  name = "model.layers.1.mlp.up_proj.weight"
  tensors[name] = np.concatenate([tensors[name], tensors[name][:1]])
  save_file(tensors, path)


def _flags_txt(*args: str):
  """Leave {T}/r holding a run made with `args` (its flags.txt)."""

  def setup(t):
    out = t / "r"
    out.mkdir()
    flags.FLAGS.unparse_flags()
    try:
      flags.FLAGS(["train", *args, f"--output_dir={out}"])
      (out / "flags.txt").write_text(train.resolved_flags_text())
    finally:
      flags.FLAGS.unparse_flags()
      flags.FLAGS.mark_as_parsed()
  return setup


def _earlier_run(*args: str, checkpoints: bool = False,
                 figures: tuple[str, ...] = ()):
  """Leave {T}/r holding a run made with SHORT and `args` that logged 5
  records, without checkpoints (or with a file named `checkpoints`), and
  with `figures` in `figures/` that no run wrote."""

  def setup(t):
    _flags_txt(*SHORT, *args)(t)
    out = t / "r"
    (out / "metrics.jsonl").write_text(
      "".join(f'{{"step": {step}}}\n' for step in range(5)))
    if checkpoints:
      (out / "checkpoints").write_text("not a directory")
    for name in figures:
      (out / "figures").mkdir(exist_ok=True)
      (out / "figures" / name).write_bytes(b"mine")
  return setup


def _user_files(t):
  # A user's directory: notes and figures of their own, no run.
  out = t / "u"
  (out / "figures").mkdir(parents=True)
  (out / "figures" / "plot.png").write_bytes(b"mine")
  (out / "notes.txt").write_text("mine")
  (out / "metrics.jsonl").write_text('{"step": 1}\n')


def _forged_tokens(**header):
  """Leave {T}/f.bin, 1000 ids 0..999, whose header claims `header`."""

  def setup(t):
    tokens.write_tokens(t / "f.bin", [np.arange(1000)], 1000, 9, "t")
    path = pathlib.Path(tokens.header_path(t / "f.bin"))
    path.write_text(json.dumps(json.loads(path.read_text()) | header))
  return setup


def _good_tokens(t):
  tokens.write_tokens(t / "g.bin", [np.arange(100) % 50], 128, 1, "t")


def _both_tokens(t):
  _good_tokens(t)
  _forged_tokens(vocab_size=10)(t)


def _lock_holder(t, directory="o"):
  # Holders wait on stdin, not a timer: they hold until killed or until
  # this process exits, however long the rows set up before theirs take.
  (t / directory).mkdir(exist_ok=True)
  holder = subprocess.Popen(
    [sys.executable, "-P", "-c",
     "import sys; from decompax.io import run_dir; "
     "run_dir.lock_run_dir(sys.argv[1]); print('locked', flush=True); "
     "sys.stdin.read()", str(t / directory)],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline().strip() == "locked"
  return holder


def _port_holder(t):
  """Hold a listening port; leave {T}/port.flags naming it."""
  holder = subprocess.Popen(
    [sys.executable, "-P", "-c",
     "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); "
     "s.listen(); print(s.getsockname()[1], flush=True); sys.stdin.read()"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  (t / "port.flags").write_text(f"--port={holder.stdout.readline().strip()}\n")
  return holder


# `finished_run` of tests/conftest.py, which `results` puts here for the
# setups below.
_FINISHED = {}


def _run_copy(name: str, then: Callable[[pathlib.Path], object] = None):
  """Leave {T}/r holding a finished run of `name` (its harvest/ empty),
  then run `then`."""

  def setup(t):
    shutil.copytree(_FINISHED["run"](name), t / "r",
                    ignore=shutil.ignore_patterns("harvest"))
    (t / "r" / "harvest").mkdir()
    return then(t) if then else None
  return setup


def _tms_target(t):
  """Leave the finished TMS run's trained target at {T}/target.npz."""
  shutil.copy(os.path.join(_FINISHED["run"]("tms"), "target.npz"),
              t / "target.npz")


def _second_run(name: str):
  """Leave {T}/s holding a finished run of `name` beside {T}/r."""

  def setup(t):
    shutil.copytree(_FINISHED["run"](name), t / "s")
  return setup


def _tagged_without_tag_arrays(t):
  """Mark {T}/r's finished harvest as one with tag statistics, which it
  lacks the arrays of."""
  path = t / "r" / "harvest" / "manifest.json"
  manifest = json.loads(path.read_text())
  manifest["tags"] = {"tags": ["<eos>"], "classes": ["boundary"],
                      "coarse_of": [0], "groups": 1, "documents": ["d"],
                      "baselines": []}
  path.write_text(json.dumps(manifest))


def _tags_of_another_file(t):
  """Leave {T}/k.bin (21 ids) beside the tag stream of an earlier k.bin
  (11 ids)."""
  tokens.write_tagged_tokens(
    t / "k.bin", [tokens.TaggedDocument("d", np.arange(10), np.ones(10, int),
                                        np.asarray([0]))],
    ("<eos>", "nn"), "<eos>", 32, 31, "t")
  tokens.write_tokens(t / "k.bin", [np.arange(20)], 32, 31, "t")


def _manifest(text: str):
  def write(t):
    (t / "r" / "harvest" / "manifest.json").write_text(text)
  return write


def _garbled_flags(text: str):
  """Leave {T}/r a directory whose flags.txt reads `text`."""

  def setup(t):
    (t / "r").mkdir()
    (t / "r" / "flags.txt").write_text(text)
  return setup


def _choice_file(text: str):
  """Leave {T}/r holding a `--restarts` run (its flags.txt) whose
  restarts.json reads `text`."""
  made = _flags_txt(*RESTARTS)

  def setup(t):
    made(t)
    (t / "r" / "restarts.json").write_text(text)
  return setup


def _lock_not_a_file(t):
  (t / "o" / ".lock").mkdir(parents=True)


def _config_only_tokenizer(t):
  (t / "tok").mkdir()
  (t / "tok" / "config.json").write_text('{"model_type": "gpt2"}')
  _words(t)


def _words(t):
  (t / "w.txt").write_text(" ".join(["hello"] * 5000) + "\n")


def _broken_tokenizer(t):
  (t / "tok").mkdir()
  (t / "tok" / "tokenizer.json").write_text('{"a": 1}')
  _words(t)


def _word_level(t, words, eos, unk):
  import transformers  # noqa: PLC0415 (slow; only tokenizer rows need it)
  from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

  level = Tokenizer(models.WordLevel(
    {w: i for i, w in enumerate(words)}, unk_token=unk))
  level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=level, eos_token=eos, unk_token=unk,
  ).save_pretrained(t / "tok")


def _one_entry_tokenizer(t):
  _word_level(t, ["[EOS]"], "[EOS]", "[EOS]")
  _words(t)


def _eos_only_input(t):
  _word_level(t, ["[UNK]", "[EOS]", "the", "cat"], "[EOS]", "[UNK]")
  (t / "w.txt").write_text("the cat\n")
  (t / "b.jsonl").write_text('{"text": ""}\n\n{"text": " "}\n')


def _empty_input(t):
  (t / "empty.txt").write_text("")


def _input_file(t):
  (t / "in.txt").write_text("some words\n")


def _brown_corpus(damage: Callable[[pathlib.Path], None] = lambda c: None):
  """Leave {T}/c holding 500 one-sentence documents in Brown's format,
  then `damage` them."""

  def setup(t):
    from decompax.targets import brown  # noqa: PLC0415

    (t / "c").mkdir()
    for name in brown.document_names():
      (t / "c" / name).write_text("\n\n\tThe/at dog/nn ./.\n")
    damage(t / "c")
  return setup


def _lm_data(vocab_size: int, settings: dict | None = None):
  """Leave {T}/d holding token files of `vocab_size` and a tokenizer.json;
  with `settings`, {T}/o holding a train_lm run of them."""

  def setup(t):
    (t / "d").mkdir()
    for part in ("train", "held_out"):
      tokens.write_tokens(t / "d" / f"{part}.bin",
                          [np.arange(200) % vocab_size], vocab_size, 0, "t")
    (t / "d" / "tokenizer.json").write_text("{}")
    if settings is not None:
      (t / "o").mkdir()
      (t / "o" / owned_dir.MANIFEST_FILE).write_text(json.dumps(
        {"format": owned_dir.MANIFEST_FORMAT, "program": "train_lm",
         "settings": settings, "entries": ["train_lm.json"]}))
      (t / "o" / "train_lm.json").write_text(json.dumps(
        {"settings": settings}))
  return setup


def _output_as_input(t):
  (t / "o.bin").write_text("some words\n")


def _hardlinked_output(t):
  _input_file(t)
  os.link(t / "in.txt", t / "o.bin")


def _symlinked_output(t):
  _output_as_input(t)
  (t / "link.bin").symlink_to(t / "o.bin")


def _jsonl_without_text(t):
  _eos_only_input(t)
  (t / "d.jsonl").write_text('{"text": "the cat"}\n{"body": "a dog"}\n')


def _existing_output(t):
  _eos_only_input(t)
  (t / "o.bin").write_bytes(b"")


def _header_as_input(t):
  (t / "o.json").write_text('{"text": "some words"}\n')


def _directory_output(t):
  _input_file(t)
  (t / "o.bin").mkdir()


def _token_file_input(t):
  # Small ids as uint16: valid UTF-8, and every other byte a NUL.
  _word_level(t, ["[UNK]", "[EOS]", "the"], "[EOS]", "[UNK]")
  tokens.write_tokens(t / "ids.bin", [np.arange(40) % 3], 3, 1, "t")
  (t / "ids.jsonl").write_text('{"text": "the"}\n{"text": "the\0"}\n')


FULL_DISK = (
  "import errno, os\n"
  "def _full(fd):\n"
  "  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
  "os.fsync = _full\n")
# At most 8 GiB of address space: the oversized step below is refused
# the same on any machine, and never allocated even where it would fit.
ADDRESS_SPACE_8G = (
  "import resource\n"
  "resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))\n")
# An accelerator's allocator refusing the step's buffers, as XLA reports it.
DEVICE_OOM = (
  "import jax\n"
  "from decompax.bin import device_memory\n"
  "def _refused(*args):\n"
  "  raise jax.errors.JaxRuntimeError(\n"
  "    'RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.0G')\n"
  "device_memory.check_fits = _refused\n")
TOKENIZE = ("--tokenizer={T}/tok", "--input={T}/w.txt", "--output={T}/o.bin")
FIXTURE_TOKENIZER = "--tokenizer={ROOT}/tests/fixtures/tiny_llama"

ROWS = (
  # Never save or report garbage. Rows start two at a time in this order,
  # and the rows that compile a step are ordered so that each starts after
  # the row that compiles the same programs (its warmup, its step), which
  # it then reads from the compilation cache: `step_does_not_fit`, which
  # shares nothing, beside `diverged`.
  Row("diverged", "train", (*DIVERGE, OUT), "diverged at step 2 (first "
      "non-finite value: loss/", code=3, setup=_tms_target),
  # A step that cannot be allocated used to hang in the step-0 eval. It is
  # refused once compiled, after the setup wrote the run (so not in {T}/o).
  Row("step_does_not_fit", "train", (
    "--batch_size=100000000", "--num_steps=10", "--log_every=5",
    "--eval_every=5", "--slow_eval_every=0", "--figures_every=0",
    TMS_TARGET, "--output_dir={T}/run"),
    "the step (--batch_size=100000000) needs ", setup=_tms_target,
    prelude=ADDRESS_SPACE_8G),
  Row("skipped_too_many", "train", (*DIVERGE, "--on_nonfinite=skip", OUT),
      "diverged: 4 updates were not finite and skipped, more than "
      "--max_skipped_share=0.1 of the 10 steps", code=3, setup=_tms_target),
  # The settings of `diverged`: the step it compiled is in the cache.
  Row("device_out_of_memory", "train", (*DIVERGE, "--output_dir={T}/run"),
      "out of memory (RESOURCE_EXHAUSTED: Out of memory while trying to "
      "allocate 9.0G); lower --batch_size", setup=_tms_target,
      prelude=DEVICE_OOM),
  # The step of `skipped_too_many`, from the cache.
  Row("final_eval_not_finite", "train", (
    *DIVERGE, "--eval_every=5", "--on_nonfinite=skip",
    "--max_skipped_share=1", OUT),
    "diverged: the final eval (step 10) is not finite (eval/", code=3,
    setup=_tms_target),
  Row("skipped_share_zero", "train", ("--max_skipped_share=0", OUT),
      "--max_skipped_share must lie in (0, 1], got 0.0"),
  Row("token_ids_past_vocab", "train", (*LLAMA, "--data_path={T}/f.bin", OUT),
      "holds id 999, outside the vocab [0, 10)", setup=_forged_tokens(
        vocab_size=10)),
  Row("eval_token_ids_past_vocab", "train", (
    *LLAMA, "--data_path={T}/g.bin", "--eval_data_path={T}/f.bin", OUT),
    "holds id 999, outside the vocab [0, 10)", setup=_both_tokens),
  Row("token_eos_past_vocab", "train", (*LLAMA, "--data_path={T}/f.bin", OUT),
      "EOS id 5000 is outside", setup=_forged_tokens(eos_id=5000)),
  Row("token_vocab_not_a_count", "train", (
    *LLAMA, "--data_path={T}/f.bin", OUT), "must be non-negative integers",
    setup=_forged_tokens(vocab_size="50")),
  Row("tokenizer_config_only", "tokenize", TOKENIZE,
      "it holds no tokenizer.json", setup=_config_only_tokenizer,
      untouched=True),
  Row("tokenizer_dir_empty", "tokenize", TOKENIZE,
      "it holds no tokenizer.json", setup=lambda t: (
        (t / "tok").mkdir(), _words(t)), untouched=True),
  Row("tokenizer_json_broken", "tokenize", TOKENIZE,
      "(KeyError: 'added_tokens')", setup=_broken_tokenizer),
  Row("tokenizer_one_entry", "tokenize", TOKENIZE,
      "its vocabulary size is 1", setup=_one_entry_tokenizer),
  Row("tokenize_empty_input", "tokenize", (
    FIXTURE_TOKENIZER, "--input={T}/empty.txt", "--output={T}/o.bin"),
    "is empty; give a file holding text", setup=_empty_input, untouched=True),
  Row("tokenize_only_eos", "tokenize", (
    "--tokenizer={T}/tok", "--input={T}/w.txt", "--input={T}/b.jsonl",
    "--output={T}/o.bin"), "b.jsonl tokenizes to nothing but EOS",
    setup=_eos_only_input, untouched=True),
  # Never replace an input with its own tokens.
  Row("tokenize_input_is_output", "tokenize", (
    FIXTURE_TOKENIZER, "--input={T}/o.bin", "--output={T}/o.bin",
    "--overwrite"), "--input {T}/o.bin is the --output {T}/o.bin; writing "
    "it would replace the input", setup=_output_as_input, untouched=True),
  Row("tokenize_output_hardlinks_input", "tokenize", (
    FIXTURE_TOKENIZER, "--input={T}/in.txt", "--output={T}/o.bin",
    "--overwrite"), "--input {T}/in.txt is the --output {T}/o.bin",
    setup=_hardlinked_output, untouched=True),
  Row("tokenize_input_is_output_header", "tokenize", (
    FIXTURE_TOKENIZER, "--input={T}/o.json", "--output={T}/o.bin",
    "--overwrite"), "--input {T}/o.json is the header of --output "
    "{T}/o.bin", setup=_header_as_input),
  Row("tokenize_output_symlinks_input", "tokenize", (
    FIXTURE_TOKENIZER, "--input={T}/o.bin", "--output={T}/link.bin",
    "--overwrite"), "--input {T}/o.bin is the --output {T}/link.bin",
    setup=_symlinked_output, untouched=True),
  Row("tokenize_jsonl_line_without_text", "tokenize", (
    "--tokenizer={T}/tok", "--input={T}/d.jsonl", "--output={T}/o.bin"),
    "d.jsonl:2: no string field 'text'", setup=_jsonl_without_text,
    untouched=True),
  Row("tokenize_output_exists", "tokenize", TOKENIZE,
      "{T}/o.bin exists; pass --overwrite", setup=_existing_output),
  Row("tokenize_output_is_a_directory", "tokenize", (
    FIXTURE_TOKENIZER, "--input={T}/in.txt", "--output={T}/o.bin"),
    "--output: {T}/o.bin is a directory; name a file",
    setup=_directory_output),
  Row("tokenize_binary_input", "tokenize", (
    "--tokenizer={T}/tok", "--input={T}/ids.bin", "--output={T}/o.bin"),
    "--input {T}/ids.bin holds a NUL byte: it is binary, not text",
    setup=_token_file_input),
  Row("tokenize_binary_jsonl_line", "tokenize", (
    "--tokenizer={T}/tok", "--input={T}/ids.jsonl", "--output={T}/o.bin"),
    "--input {T}/ids.jsonl:2 holds a NUL byte", setup=_token_file_input),
  Row("lr_nan", "train", ("--lr=nan", OUT),
      "flag --lr=nan: must be a finite number; see --helpfull",
      untouched=True),
  Row("lr_inf", "train", ("--lr=inf", OUT),
      "flag --lr=inf: must be a finite number"),
  Row("flagfile_inf", "train", ("--flagfile={T}/f.flags", OUT),
      "--ci_lr=inf: must be a finite number", setup=_flagfile("--ci_lr=inf")),
  Row("list_nan", "train", ("--pgd_betas=nan,0.99", OUT),
      "'nan' is not a finite number"),
  Row("keyed_list_inf", "train", ("--nonlinearity_weights=relu:inf", OUT),
      "'inf' is not a finite number"),
  Row("tokenize_float_nan", "tokenize", (
    "--progress_seconds=nan", FIXTURE_TOKENIZER, "--input={T}/in.txt",
    "--output={T}/o.bin"), "--progress_seconds=nan: must be a finite"),
  # The Brown corpus and the language model trained on it.
  Row("brown_no_source", "prepare_brown", ("--data_dir={T}/d",),
      "install npm, or pass --brown_dir=",
      prelude="import os; os.environ['PATH'] = '/nonexistent'"),
  Row("brown_missing_document", "prepare_brown", (
    "--brown_dir={T}/c", "--data_dir={T}/d"),
    "lacks {T}/c/cm03 (499 of 500 documents present)",
    setup=_brown_corpus(lambda c: (c / "cm03").unlink())),
  Row("brown_garbled_token", "prepare_brown", (
    "--brown_dir={T}/c", "--data_dir={T}/d"),
    "{T}/c/cb07:3: token 'dog' is not word/tag",
    setup=_brown_corpus(lambda c: (c / "cb07").write_text(
      "\n\n\tThe/at dog ./.\n"))),
  Row("brown_vocab_too_small", "prepare_brown", (
    "--brown_dir={T}/c", "--vocab_sizes=4096,12"),
    "each must be in (257, 65536]"),
  Row("train_lm_no_data", "train_lm", (
    "--preset=tiny", "--data_dir={T}/none", "--output_dir={T}/o"),
    "--data_dir {T}/none does not exist; run ./dev data brown first"),
  Row("train_lm_vocab_mismatch", "train_lm", (
    "--preset=tiny", "--data_dir={T}/d", "--output_dir={T}/o"),
    "was tokenized for vocab 128, the preset tiny has 300",
    setup=_lm_data(128)),
  Row("train_lm_other_run", "train_lm", (
    "--preset=tiny", "--data_dir={T}/d", "--output_dir={T}/o"),
    "{T}/o holds train_lm output made with other settings (data.",
    setup=_lm_data(300, {"preset": {"name": "brown-s"}})),
  Row("train_lm_steps_not_positive", "train_lm", (
    "--preset=tiny", "--num_steps=0", "--data_dir={T}/d"),
    "--num_steps must be positive"),
  Row("train_lm_steps_past_int32", "train_lm", (
    "--preset=tiny", "--num_steps=1180591620717411303424", "--data_dir={T}/d"),
    "--num_steps=1180591620717411303424 is past 2147483647, the most steps "
    "a run counts"),
  # Killed by the kernel at 21 GB without a word, before: refused once
  # compiled, before the run directory is touched.
  Row("train_lm_step_does_not_fit", "train_lm", (
    "--preset=tiny", "--data_dir={T}/d", "--output_dir={T}/o",
    "--batch_size=1000000000"),
    "a step of --batch_size=1000000000 windows of 33 tokens needs ",
    setup=_lm_data(300), prelude=ADDRESS_SPACE_8G, untouched=True),
  Row("train_lm_eval_windows_not_positive", "train_lm", (
    "--preset=tiny", "--eval_windows=0", "--data_dir={T}/d"),
    "--eval_windows must be positive, got 0"),
  # One run directory, one writer.
  Row("run_dir_in_use", "train", (OUT,), "is in use by pid",
      setup=_lock_holder),
  Row("run_dir_in_use_overwrite", "train", (OUT, "--overwrite"),
      "is in use by pid", setup=_lock_holder),
  Row("lock_not_a_file", "train", (OUT,), "cannot lock output dir",
      setup=_lock_not_a_file),
  # A run directory is only ever a run's: nothing of a user's is replaced,
  # and nothing is touched before the launch is known to proceed.
  Row("output_dir_empty", "train", (*SHORT, "--output_dir="),
      "--output_dir='' names no directory; name the run directory",
      cwd="{T}", untouched=True, setup=_touch),
  Row("output_dir_blank", "train", (*SHORT, "--output_dir= ", "--overwrite"),
      "--output_dir=' ' names no directory", cwd="{T}", untouched=True,
      setup=_touch),
  Row("overwrite_user_files", "train", (
    *SHORT, "--output_dir={T}/u", "--overwrite"),
    "--output_dir: output dir {T}/u holds metrics.jsonl, figures but no "
    "flags.txt, so no run wrote them and they are not a run's to replace",
    setup=_user_files, untouched=True),
  Row("overwrite_a_figure_no_run_wrote", "train", (
    *SHORT, "--output_dir={T}/r", "--overwrite"),
    "holds figures/mine.png, which the run did not write (not in its "
    ".run_files), so replacing the run would delete it; move it away",
    setup=_earlier_run("--lr=0.002", figures=("mine.png",)), untouched=True),
  Row("checkpoints_is_a_file", "train", (*SHORT, "--output_dir={T}/r"),
      "holds checkpoints, which is not a directory as a run's checkpoints "
      "is, so no run wrote it; move it away or choose another directory",
      setup=_earlier_run(checkpoints=True), untouched=True),
  Row("checkpoints_deleted", "train", (*SHORT, "--output_dir={T}/r"),
      "holds a run that has trained (metrics.jsonl records up to step 4) but "
      "no checkpoint to resume it from; pass --overwrite to train it again "
      "from step 0, or choose another --output_dir",
      setup=_earlier_run(), untouched=True),
  # Seeds past what a JAX key holds, refused before any run directory.
  # One seed flag type (`cli.define_seed`) in every binary.
  Row("seed_past_32_bits", "train", (
    *SHORT, "--seed=1180591620717411303424", OUT),
    "--seed=1180591620717411303424: must lie in [0, 2**32)"),
  Row("target_seed_past_32_bits", "train", (
    *SHORT, "--target_seed=1180591620717411303424", OUT),
    "--target_seed=1180591620717411303424: must lie in [0, 2**32)"),
  Row("eval_seed_past_32_bits", "train", (
    *SHORT, "--eval_seed=1180591620717411303424", OUT),
    "--eval_seed=1180591620717411303424: must lie in [0, 2**32)"),
  Row("seed_negative", "train", (*SHORT, "--seed=-1", OUT),
      "--seed=-1: must lie in [0, 2**32)"),
  Row("train_lm_seed_past_32_bits", "train_lm", (
    "--preset=tiny", "--seed=1180591620717411303424", "--data_dir={T}/d"),
    "--seed=1180591620717411303424: must lie in [0, 2**32)"),
  Row("harvest_seed_past_32_bits", "harvest", (
    "--run_dir={T}/nowhere", "--seed=1180591620717411303424"),
    "--seed=1180591620717411303424: must lie in [0, 2**32)"),
  Row("match_seed_past_32_bits", "match", (
    "--run_a={T}/nowhere", "--run_b={T}/nowhere",
    "--seed=1180591620717411303424"),
    "--seed=1180591620717411303424: must lie in [0, 2**32)"),
  Row("cluster_seed_negative", "cluster", (
    "--run_dir={T}/nowhere", "--seed=-1"), "--seed=-1: must lie in [0, "
    "2**32)"),
  Row("train_task_model_seed_past_32_bits", "train_task_model", (
    "--output_dir={T}/o", "--seed=4294967296"),
    "--seed=4294967296: must lie in [0, 2**32)"),
  Row("candidate_seed_past_32_bits", "train", (
    "--seed=4294967000", "--restarts=2", "--num_steps=20", "--select_at=10",
    "--save_every=10", "--log_every=10", "--eval_every=10",
    "--slow_eval_every=10", OUT),
    "--restarts=2 gives candidate seeds up to 4294968000, past 2**32 - 1"),
  # The shipped TMS 5-2 recipe selects at 12k: a shorter schedule is told
  # how to run one candidate instead.
  Row("restarts_recipe_cut_short", "train", (
    "--flagfile={ROOT}/flags/tms_5-2.flags", "--num_steps=1000", OUT),
    "--restarts=3 needs --select_at in (0, --num_steps=1000), the step at "
    "which the candidates are compared; for one run, set --restarts=1 "
    "--select_at=0", untouched=True),
  Row("select_at_without_restarts", "train", ("--select_at=100", OUT),
      "--select_at=100 compares restart candidates; set --restarts above 1 "
      "or drop --select_at (--select_at=0)", untouched=True),
  Row("restarts_choice_not_json", "train", (*RESTARTS, "--output_dir={T}/r"),
      "restarts.json is not JSON", setup=_choice_file("{"), untouched=True),
  Row("restarts_choice_without_chosen", "train", (
    *RESTARTS, "--output_dir={T}/r"), "names no chosen candidate",
    setup=_choice_file('{"chosen": true}'), untouched=True),
  # One clear line instead of a traceback.
  Row("read_only_output", "train", ("--output_dir=/sys/decompax_run",),
      "--output_dir: cannot write to /sys: "),
  Row("output_under_a_file", "train", ("--output_dir=/etc/passwd/x",),
      "/etc/passwd is a file, not a directory"),
  Row("output_is_a_file", "train", ("--output_dir={T}/afile",),
      "is a file, not a directory", setup=_touch),
  Row("safetensors_under_8_bytes", "train", (
    *LLAMA, "--model_dir={T}/m", OUT), "is not a safetensors file: 4 bytes",
    setup=_model_copy("tiny_llama", _cut(lambda n: 4))),
  Row("safetensors_half", "train", (*LLAMA, "--model_dir={T}/m", OUT),
      "model.safetensors is truncated: ",
      setup=_model_copy("tiny_llama", _cut(lambda n: n // 2))),
  Row("missing_shard", "train", (
    "--flagfile={ROOT}/flags/tiny_llama.flags", "--model_dir={T}/m", OUT),
    "names model-00002-of-00002.safetensors, which is not in",
    setup=_model_copy("tiny_qwen3", _drop_second_shard)),
  Row("full_disk", "train", (OUT,), "No space left on device; free space "
      "there", prelude=FULL_DISK),
  Row("config_heads_do_not_divide", "train", (
    *LLAMA, "--model_dir={T}/m", OUT), "m/config.json: key "
    "'num_attention_heads': 3 heads do not divide hidden_size 64",
    setup=_model_copy("tiny_llama", _config_json(num_attention_heads=3,
                                                  head_dim=None))),
  Row("config_size_a_string", "train", (*LLAMA, "--model_dir={T}/m", OUT),
      "m/config.json: key 'hidden_size' must be a positive integer, got "
      "'64' (str)", setup=_model_copy("tiny_llama",
                                      _config_json(hidden_size="64"))),
  Row("gpt2_layer_scaled_attention", "train", (
    "--flagfile={ROOT}/flags/tiny_gpt2.flags", "--model_dir={T}/m", OUT),
    "scale_attn_by_inverse_layer_idx=True; only "
    "scale_attn_by_inverse_layer_idx=False is implemented",
    setup=_model_copy("tiny_gpt2", _config_json(
      scale_attn_by_inverse_layer_idx=True))),
  Row("gpt2_gate_site", "train", (
    "--flagfile={ROOT}/flags/tiny_gpt2.flags",
    "--sites=layers.1.mlp.gate_proj", OUT),
    "--sites entry 'layers.1.mlp.gate_proj' matches no site; sites are "
    "layers.<i>.self_attn.{q,k,v,o}_proj and layers.<i>.mlp.{up,down}_proj, "
    "i < 3"),
  Row("gemma_fused_attention", "train", (
    "--flagfile={ROOT}/flags/tiny_gemma2.flags", "--attention=xla", OUT),
    "attention 'xla' computes plain causal softmax(q·k/√hd); this gemma2 "
    "model's scores need its own scale, soft-cap or sliding windows: use "
    "--attention=reference"),
  Row("gemma3_bidirectional", "train", (
    "--flagfile={ROOT}/flags/tiny_gemma3.flags", "--model_dir={T}/m", OUT),
    "use_bidirectional_attention is set; only causal Gemma attention "
    "without biases is implemented",
    setup=_model_copy("tiny_gemma3", _config_json(
      use_bidirectional_attention=True))),
  Row("moe_dense_layers", "train", (*LLAMA, "--model_dir={T}/m", OUT),
      "dense MLP layers [1] (decoder_sparse_step 1, mlp_only_layers [1]); "
      "supported: every layer a routed mixture of SwiGLU experts",
      setup=_model_copy("tiny_qwen3moe", _config_json(mlp_only_layers=[1]))),
  Row("moe_expert_beyond", "train", (
    *LLAMA, "--model_dir={ROOT}/tests/fixtures/tiny_qwen3moe",
    "--sites=layers.1.mlp.experts.4.up_proj", OUT),
    "--sites entry 'layers.1.mlp.experts.4.up_proj' matches no site; sites "
    "are layers.<i>.self_attn.{q,k,v,o}_proj and "
    "layers.<i>.mlp.experts.<e>.{gate,up,down}_proj, e < 4, i < 3"),
  Row("config_not_json", "train", (*LLAMA, "--model_dir={T}/m", OUT),
      "m/config.json is not valid JSON (Expecting value",
      setup=_model_copy("tiny_llama", _config_text("{\"a\": }"))),
  Row("layer_shapes_differ", "train", (*LLAMA, "--model_dir={T}/m", OUT),
      "tensor model.layers.1.mlp.up_proj.weight in {T}/m/model.safetensors "
      "has shape (97, 64), but model.layers.0.mlp.up_proj.weight has "
      "(96, 64)", setup=_model_copy("tiny_llama", _widen_second_layer)),
  Row("other_flags", "train", ("--output_dir={T}/r", "--lr=0.002"),
      "--lr was 0.001, now 0.002); resume it with the same flags, replace "
      "it, or choose another directory (--overwrite replaces it)",
      setup=_flags_txt("--lr=0.001")),
  # Settings that would train something else than asked, silently.
  Row("lr_knot_negative", "train", ("--lr_knots=0:1,1:-0.5", OUT),
      "--lr_knots: knot 1:-0.5 has a negative fraction"),
  Row("lr_final_frac_negative", "train", ("--lr_final_frac=-0.5", OUT),
      "--lr_final_frac must be >= 0, got -0.5"),
  Row("p_start_zero", "train", ("--p_start=0", OUT),
      "--p_start must be positive, got 0.0: minimality raises CI to the "
      "power p, and at p = 0 it is a constant"),
  Row("alive_threshold_negative", "train", ("--ci_alive_threshold=-1", OUT),
      "--ci_alive_threshold must lie in [0, 1), the range of CI, got -1.0"),
  Row("harvest_threshold_negative", "harvest", (
    "--run_dir={T}/nowhere", "--threshold=-1"),
    "--threshold must lie in [0, 1), the range of CI, got -1.0"),
  Row("hidden_pass_point_twice", "train", (
    "--ci_roles=output,hidden",
    "--hidden_pass_points=linear2.out,linear1.out,linear2.out", OUT),
    "--hidden_pass_points lists linear2.out twice"),
  # Each message names its flag (or file).
  Row("ci_hidden_zero", "train", ("--ci_hidden=0", OUT),
      "--ci_hidden entries must be positive, got (0,)"),
  Row("pgd_lr_negative", "train", ("--pgd_coeff=1", "--pgd_lr=-0.5", OUT),
      "--pgd_lr must be positive, got -0.5"),
  Row("pgd_start_frac_one", "train", (
    "--pgd_coeff=1", "--pgd_start_frac=1", OUT),
    "--pgd_start_frac must lie in [0, 1), got 1.0"),
  Row("hidden_pass_point_unknown", "train", (
    *LLAMA, "--ci_roles=output,hidden", "--hidden_pass_points=bogus", OUT),
    "--hidden_pass_points: unknown tap key 'bogus'"),
  # Refusals that already worked.
  Row("unknown_flag", "train", ("--bogus=1", OUT),
      "Unknown command line flag 'bogus'"),
  Row("positional", "train", ("extra_arg", OUT),
      "unexpected argument 'extra_arg'"),
  Row("flagfile_no_dashes", "train", ("--flagfile={T}/f.flags", OUT),
      "unexpected argument 'target=tms_5-2'",
      setup=_flagfile("--c=5\ntarget=tms_5-2"), untouched=True),
  Row("flagfile_missing", "train", ("--flagfile={T}/none.flags", OUT),
      "cannot open flagfile {T}/none.flags: No such file or directory; "
      "check the --flagfile path"),
  Row("int_not_int", "train", ("--c=abc", OUT), "flag --c=abc: invalid"),
  Row("enum_unknown", "train", ("--attention=bogus", OUT),
      "value should be one of"),
  Row("c_zero", "train", ("--c=0", OUT), "--c must be positive, got 0"),
  Row("mesh_beyond_devices", "train", ("--fsdp=2", OUT),
      "spans 2 devices but 1 are present", untouched=True),
  Row("steps_zero", "train", ("--num_steps=0", OUT),
      "--num_steps must be positive, got 0"),
  Row("batch_negative", "train", ("--batch_size=-1", OUT),
      "--batch_size must be positive, got -1"),
  Row("lr_zero", "train", ("--lr=0", OUT), "--lr must be positive"),
  Row("weight_decay_negative", "train", ("--weight_decay=-1", OUT),
      "--weight_decay must be >= 0"),
  Row("ci_lr_zero", "train", ("--ci_lr=0", OUT), "--ci_lr must be positive"),
  Row("warmup_pct_one", "train", ("--lr_warmup_pct=1", OUT),
      "--lr_warmup_pct must lie in [0, 1), got 1.0"),
  Row("final_frac_constant", "train", (
    "--lr_schedule=constant", "--lr_final_frac=0.5", OUT),
    "has no effect with --lr_schedule=constant"),
  Row("p_final_frac_alone", "train", ("--p_final_frac=0.5", OUT),
      "--p_final_frac: a constant schedule needs final_frac = 1"),
  Row("ema_halflife_too_long", "train", (
    "--frequency_coeff=1e-3", "--ema_halflife_steps=2e6", OUT),
    "ema_halflife_steps must lie in (0, 1e6], got 2000000.0"),
  Row("no_recon_term", "train", (
    "--stochastic_coeff=0", "--per_site_coeff=0", OUT),
    "no reconstruction term"),
  Row("ema_without_frequency", "train", ("--ema_halflife_steps=10", OUT),
      "--ema_halflife_steps needs --frequency_coeff above 0"),
  Row("pgd_betas_one", "train", ("--pgd_betas=0.9", OUT),
      "--pgd_betas takes two values"),
  Row("groups_without_plan", "train", ("--groups_coeff=1", OUT),
      "a groups plan needs --recon_groups"),
  Row("groups_unknown_site", "train", (
    "--groups_coeff=1", "--recon_groups=nope", OUT),
    "plan group names unknown site 'nope'"),
  Row("tokens_for_a_toy", "train", ("--data_path={T}/x.bin", OUT),
      "read token files for --target=hf"),
  Row("site_twice", "train", ("--sites=linear1,linear1", OUT),
      "--sites lists a site twice"),
  Row("site_unknown", "train", ("--sites=nope", OUT),
      "unknown site 'nope' for target tms_5-2"),
  Row("target_unknown", "train", ("--target=nope", OUT),
      "unknown toy target 'nope'"),
  Row("eval_cadence", "train", ("--log_every=5", "--eval_every=7", OUT),
      "--eval_every=7 must be a multiple of --log_every=5"),
  Row("slow_eval_without_eval", "train", ("--eval_every=0", OUT),
      "--slow_eval_every needs --eval_every above 0"),
  Row("attention_eval_on_a_toy", "train", ("--eval_attention_kl", OUT),
      "--eval_attention_kl scores attention patterns, and --target=tms_5-2 "
      "has no attention; drop --eval_attention_kl or decompose a language "
      "model"),
  Row("attention_eval_without_query_or_key", "train", (
    *LLAMA, "--eval_attention_kl", OUT),
    "--eval_attention_kl scores blocks with a decomposed q_proj or k_proj, "
    "and --sites names none; add one"),
  Row("output_chunk_on_a_toy", "train", ("--output_chunk=64", OUT),
      "--output_chunk chunks an LM head, and --target=tms_5-2 has none"),
  Row("output_chunk_negative", "train", (*LLAMA, "--output_chunk=-1", OUT),
      "--output_chunk must be"),
  Row("figure_share_zero", "train", ("--figure_cpu_share=0", OUT),
      "--figure_cpu_share must lie in (0, 1]"),
  Row("ci_hidden_words", "train", ("--ci_hidden=a", OUT),
      "--ci_hidden must be comma-separated integers"),
  Row("ci_heads_zero", "train", (
    "--ci_fn=transformer", "--ci_n_heads=0", OUT),
    "--ci_n_heads must be positive, got 0"),
  Row("profile_steps_form", "train", ("--profile_steps=5", OUT),
      "--profile_steps must be START:END"),
  Row("init_from_form", "train", ("--init_from=bad", OUT),
      "--init_from must be <run_dir>/<step> or <run_dir>/latest"),
  Row("init_from_missing", "train", ("--init_from={T}/nowhere/latest", OUT),
      "no checkpoint in"),
  Row("hidden_alone", "train", ("--hidden_coeff=1", OUT),
      "the hidden-activation rider never stands alone"),
  Row("hidden_terms_off", "train", ("--hidden_terms=stochastic_recon", OUT),
      "--hidden_terms needs --hidden_coeff above 0"),
  Row("merged_fraction", "train", (
    "--merged_coeff=1", "--merged_adv_fraction=1.5", OUT),
    "--merged_adv_fraction must lie in [0, 1], got 1.5"),
  Row("save_every_zero", "train", ("--save_every=0", OUT),
      "--save_every must be positive, got 0"),
  Row("keep_last_zero", "train", ("--keep_last=0", OUT),
      "--keep_last must be positive, got 0"),
  Row("skip_limit_zero", "train", ("--max_skipped_in_a_row=0", OUT),
      "--max_skipped_in_a_row must be positive, got 0"),
  Row("eval_batches_zero", "train", ("--eval_batches=0", OUT),
      "--eval_batches must be positive, got 0"),
  Row("hf_without_model", "train", ("--target=hf", OUT),
      "--target=hf needs --model_dir"),
  Row("hf_no_config", "train", ("--target=hf", "--model_dir=/nonexistent",
                                OUT),
      "--model_dir: '/nonexistent' holds no config.json"),
  Row("seq_len_too_long", "train", (*LLAMA, "--seq_len=100000", OUT),
      "exceeds the model's max_position_embeddings 256"),
  Row("lm_sites_match_nothing", "train", (*LLAMA, "--sites=layers.9.*", OUT),
      "matches no site"),
  Row("lm_end_site_misspelt", "train", (*LLAMA, "--sites=lm_heads", OUT),
      "--sites entry 'lm_heads' matches no site; sites are "
      "layers.<i>.self_attn.{q,k,v,o}_proj and "
      "layers.<i>.mlp.{gate,up,down}_proj, i < 3, embed_tokens, lm_head"),
  Row("embed_site_transformer_ci", "train", (
    *LLAMA, "--sites=embed_tokens", OUT),
    "has no input for the embedding sites ['embed_tokens']; use an MLP CI "
    "function"),
  Row("head_site_output_chunk", "train", (
    *LLAMA, "--sites=lm_head", "--output_chunk=8", OUT),
    "cannot decompose lm_head; use --output_chunk=0"),
  Row("token_file_missing", "train", (*LLAMA, "--data_path={T}/missing.bin",
                                      OUT),
      "not found; create it with bin/tokenize"),
  Row("eval_data_alone", "train", (*LLAMA, "--eval_data_path={T}/x.bin", OUT),
      "--eval_data_path needs --data_path"),
  Row("output_parent_missing", "train", ("--output_dir={T}/missing/run",),
      "does not exist"),
  Row("mesh_axis_zero", "train", ("--fsdp=0", OUT),
      "--replicate/--fsdp/--tp: mesh axis fsdp must have a positive size, "
      "got 0"),
  Row("process_id_range", "train", (
    "--process_id=3", "--num_processes=2", OUT),
    "--process_id=3 must lie in [0, --num_processes=2)"),
  Row("cache_dir_is_file", "train", ("--compilation_cache_dir={T}/afile", OUT),
      "is a file; name a directory", setup=_touch),
  Row("compiler_unknown", "train", ("--compiler=bogus", OUT),
      "--compiler='bogus': use bare, cpu512, tuned-v1 or"),
  Row("place_form", "train", ("--place=bogus", OUT),
      "--place: override 'bogus' is not category:layout"),
  Row("report_no_run_dir", "report", (), "Flag --run_dir must have a value"),
  Row("report_not_a_run", "report", ("--run_dir={T}/nowhere",),
      "is not a run directory (no flags.txt)"),
  Row("report_flags_garbled", "report", ("--run_dir={T}/r",),
      "--run_dir: {T}/r/flags.txt is damaged: '--c=abc': invalid literal",
      setup=_garbled_flags("--bogus_flag=1\n--c=abc\n"), untouched=True),
  Row("report_flags_garbled_one_line", "report", ("--run_dir={T}/r",),
      "--run_dir: {T}/r/flags.txt is damaged: it sets no flag of bin/train, "
      "only --bogus_flag", setup=_garbled_flags("--bogus_flag=1 --c=abc\n"),
      untouched=True),
  Row("report_positional", "report", ("--run_dir={T}", "extra"),
      "unexpected argument 'extra'"),
  Row("report_tagged_harvest_array_deleted", "report", ("--run_dir={T}/r",),
      "a harvest array cannot be read", setup=_tagged_without_tag_arrays,
      harvested=True),
  Row("harvest_no_run_dir", "harvest", (), "Flag --run_dir must have a value"),
  Row("harvest_not_a_run", "harvest", ("--run_dir={T}/nowhere",),
      "has no flags.txt: pass the output directory of a bin/train run"),
  Row("harvest_positional", "harvest", ("--run_dir={T}", "extra"),
      "unexpected argument 'extra'"),
  Row("harvest_save_every_negative", "harvest", (
    "--run_dir={T}/nowhere", "--save_every_s=-1"),
    "--save_every_s=-1.0 must be 0 or more"),
  Row("harvest_ablation_chunk_zero", "harvest", (
    "--run_dir={T}/nowhere", "--ablation_chunk=0"),
    "--ablation_chunk=0 must be positive"),
  Row("harvest_window_past_the_sequence", "harvest", (
    "--run_dir={T}/r", "--window_before=100000000"),
    "--window_before=100000000 reaches past the sequence: a window of "
    "seq_len=32 holds at most 31", setup=_run_copy("induction")),
  Row("harvest_tags_of_another_token_file", "harvest", (
    "--run_dir={T}/r", "--data_path={T}/k.bin", "--seq_len=8"),
    "--data_path: tag header {T}/k.tags.json describes 11 tokens, but "
    "{T}/k.bin holds 21; write both again",
    setup=_run_copy("induction", _tags_of_another_file)),
  Row("harvest_token_file_short_of_a_batch", "harvest", (
    "--run_dir={T}/r", "--data_path={T}/s.bin", "--seq_len=8",
    "--batch_size=4"),
    "--data_path: {T}/s.bin holds 21 tokens, fewer than one batch of "
    "batch_size=4 windows of seq_len=8; lower batch_size or seq_len",
    setup=_run_copy("induction", lambda t: tokens.write_tokens(
      t / "s.bin", [np.arange(20)], 32, 31, "t"))),
  Row("harvest_manifest_lacks_settings", "harvest", ("--run_dir={T}/r",),
      "{T}/r/harvest/manifest.json lacks the key 'settings'; delete "
      "{T}/r/harvest or overwrite it to harvest again (--overwrite)",
      setup=_run_copy("tms", _manifest('{"sites": {}}'))),
  # Sizes past memory or past the batches' numbering, refused before a
  # batch is drawn or compiled (an 8 GiB address space: the same on every
  # host).
  Row("harvest_batch_does_not_fit", "harvest", (
    "--run_dir={T}/r", "--batch_size=2000000000"),
    "a batch of --batch_size=2000000000 x 1 positions and 16 ablated "
    "forwards of it: at least ", setup=_run_copy("tms"),
    prelude=ADDRESS_SPACE_8G, untouched=True),
  Row("harvest_ablation_chunk_does_not_fit", "harvest", (
    "--run_dir={T}/r", "--ablation_chunk=2000000000"),
    "and 2000000000 ablated forwards of it: at least ",
    setup=_run_copy("tms"), prelude=ADDRESS_SPACE_8G, untouched=True),
  Row("harvest_positions_past_32_bits", "harvest", (
    "--run_dir={T}/r", "--positions=100000000000000000000"),
    "takes 1562500000000000000 batches of 64 positions, more than the "
    "2147483647 a harvest numbers", setup=_run_copy("tms"), untouched=True),
  Row("harvest_in_use", "harvest", ("--run_dir={T}/r",),
      "harvest {T}/r/harvest is in use by pid",
      setup=_run_copy("tms", lambda t: _lock_holder(t, "r/harvest"))),
  Row("browse_no_run_dir", "browse", (),
      "--run_dir must name at least one run directory with a finished"),
  Row("browse_not_a_run", "browse", ("--run_dir={T}/nowhere", "--port=0"),
      "has no flags.txt: pass the output directory of a bin/train run"),
  Row("browse_port_too_big", "browse", (
    "--run_dir={T}/nowhere", "--port=70000"),
    "flag --port=70000: 70000 is not an integer in the range [0, 65535]"),
  Row("browse_port_negative", "browse", ("--run_dir={T}/nowhere", "--port=-1"),
      "flag --port=-1: -1 is not an integer in the range [0, 65535]"),
  Row("browse_port_in_use", "browse", (
    "--run_dir={T}/nowhere", "--flagfile={T}/port.flags"),
    "is in use by another program; stop it or choose another --port",
    setup=_port_holder),
  Row("browse_host_empty", "browse", ("--run_dir={T}/nowhere", "--host= "),
      "--host is empty; give the address to serve on"),
  Row("browse_host_not_here", "browse", (
    "--run_dir={T}/nowhere", "--host=192.0.2.1", "--port=0"),
    "--host=192.0.2.1 is not an address of this machine"),
  Row("browse_host_unresolvable", "browse", (
    "--run_dir={T}/nowhere", f"--host={'a' * 64}.example", "--port=0"),
    ".example: cannot resolve it"),
  # Warns that it serves on every interface, then fails on the run.
  Row("browse_every_interface", "browse", (
    "--run_dir={T}/nowhere", "--host=0.0.0.0", "--port=0"),
    "has no flags.txt"),
  Row("browse_harvest_array_deleted", "browse", ("--run_dir={T}/r",
                                                 "--port=0"),
      "rerun bin/harvest --run_dir={T}/r --overwrite to harvest again",
      setup=lambda t: shutil.rmtree(t / "r/harvest/linear1/fired"),
      harvested=True),
  Row("browse_context_batches_zero", "browse", (
    "--run_dir={T}/r", "--context_batches=0"), "--context_batches=0",
    harvested=True),
  Row("gallery_no_run_dir", "gallery", (), "Flag --run_dir must have a value"),
  Row("gallery_not_a_run", "gallery", ("--run_dir={T}/nowhere",),
      "has no flags.txt: pass the output directory of a bin/train run"),
  Row("gallery_positional", "gallery", ("--run_dir={T}", "extra"),
      "unexpected argument 'extra'"),
  Row("gallery_harvest_without_tags", "gallery", ("--run_dir={T}/r",),
      "the harvest has no tag statistics: harvest a token file with a tag "
      "stream", harvested=True, untouched=True),
  Row("gallery_count_zero", "gallery", ("--run_dir={T}/r", "--count=0"),
      "--count=0", harvested=True),
  Row("gallery_active_nan", "gallery", ("--run_dir={T}/nowhere",
                                        "--active=nan"),
      "flag --active=nan: must be a finite number"),
  Row("gallery_active_inf", "gallery", ("--run_dir={T}/nowhere",
                                        "--active=inf"),
      "flag --active=inf: must be a finite number"),
  Row("gallery_active_negative", "gallery", ("--run_dir={T}/nowhere",
                                             "--active=-1"),
      "flag --active=-1: -1.0 is not a non-negative number"),
  Row("match_no_run_a", "match", ("--run_b={T}/nowhere",),
      "Flag --run_a must have a value"),
  Row("match_positional", "match", (
    "--run_a={T}/r", "--run_b={T}/r", "extra"), "unexpected argument 'extra'"),
  Row("match_run_a_not_a_run", "match", (
    "--run_a={T}/nowhere", "--run_b={T}/nowhere"),
    "--run_a: {T}/nowhere has no flags.txt: pass the output directory"),
  Row("match_run_b_not_a_run", "match", (
    "--run_a={T}/r", "--run_b={T}/nowhere"),
    "--run_b: {T}/nowhere has no flags.txt: pass the output directory",
    setup=_run_copy("tms")),
  Row("match_threshold_beyond_one", "match", (
    "--run_a={T}/nowhere", "--run_b={T}/nowhere", "--threshold=1.5"),
    "--threshold=1.5 is no similarity; give one in [-1, 1]"),
  Row("match_batch_does_not_fit", "match", (
    "--run_a={T}/r", "--run_b={T}/r", "--batch_size=2000000000"),
    "the CI of --batch_size=2000000000 inputs needs ",
    setup=_run_copy("tms"), prelude=ADDRESS_SPACE_8G),
  Row("match_batch_past_int32", "match", (
    "--run_a={T}/nowhere", "--run_b={T}/nowhere",
    "--batch_size=1180591620717411303424"),
    "is not an integer in the range [1, 2147483647]"),
  Row("match_different_targets", "match", (
    "--run_a={T}/r", "--run_b={T}/s"),
    "the runs decompose different targets (tms_5-2 and ",
    setup=_run_copy("tms", _second_run("induction")), untouched=True),
  Row("cluster_batch_does_not_fit", "cluster", (
    "--run_dir={T}/r", "--batch_size=2000000000"),
    "the ablation effects on --batch_size=2000000000 inputs (16 forwards of "
    "them at a time): at least ", harvested=True, prelude=ADDRESS_SPACE_8G),
  Row("cluster_no_run_dir", "cluster", (), "Flag --run_dir must have a value"),
  Row("cluster_positional", "cluster", ("--run_dir={T}/r", "extra"),
      "unexpected argument 'extra'"),
  Row("cluster_not_a_run", "cluster", ("--run_dir={T}/nowhere",),
      "{T}/nowhere has no finished harvest; run bin/harvest"),
  Row("cluster_not_harvested", "cluster", ("--run_dir={T}/r",),
      "{T}/r has no finished harvest; run bin/harvest --run_dir={T}/r",
      setup=_run_copy("tms"), untouched=True),
  Row("cluster_batch_size_zero", "cluster", (
    "--run_dir={T}/r", "--batch_size=0"), "--batch_size", untouched=True),
  Row("cluster_harvest_array_deleted", "cluster", ("--run_dir={T}/r",),
      "rerun bin/harvest --run_dir={T}/r --overwrite to harvest again",
      setup=lambda t: shutil.rmtree(t / "r/harvest/linear1/coactive"),
      harvested=True),
  Row("transcoder_no_run_dir", "train_transcoder", (),
      "Flag --run_dir must have a value"),
  Row("transcoder_positional", "train_transcoder", (
    "--run_dir={T}/r", "extra"), "unexpected argument 'extra'"),
  Row("transcoder_not_a_run", "train_transcoder", (
    "--run_dir={T}/nowhere",), "--run_dir: {T}/nowhere has no flags.txt"),
  Row("transcoder_toy_run", "train_transcoder", ("--run_dir={T}/r",),
      "decomposes the toy 'tms_5-2'; a transcoder needs a language "
      "model's MLPs", setup=_run_copy("tms"), untouched=True),
  Row("transcoder_no_ci_l0", "train_transcoder", ("--run_dir={T}/r",),
      "records no CI-L0: it has no finished harvest and no evaluation in "
      "metrics.jsonl; run bin/harvest on it, or pass --k",
      setup=_run_copy("tiny_llama"), untouched=True),
  Row("transcoder_k_per_layer", "train_transcoder", (
    "--run_dir={T}/r", "--k=2,3"), "--k gives 2 values for the run's 1 "
    "MLP layers [1]", setup=_run_copy("tiny_llama"), untouched=True),
  Row("transcoder_k_zero", "train_transcoder", (
    "--run_dir={T}/r", "--k=0"), "k=0 of layer 1 must lie in [1, "
    "n_latents=24]", setup=_run_copy("tiny_llama"), untouched=True),
  Row("transcoder_k_not_integer", "train_transcoder", (
    "--run_dir={T}/r", "--k=two"), "--k=two must be integers",
      setup=_run_copy("tiny_llama"), untouched=True),
  Row("transcoder_lr_nan", "train_transcoder", (
    "--run_dir={T}/r", "--lr=nan"), "--lr"),
  Row("transcoder_steps_zero", "train_transcoder", (
    "--run_dir={T}/r", "--num_steps=0"), "--num_steps"),
  Row("graph_no_tokens", "graph", ("--run_dir={T}/r",),
      "Flag --tokens must have a value"),
  Row("graph_positional", "graph", ("--run_dir={T}/r", "--tokens=1", "x"),
      "unexpected argument 'x'"),
  Row("graph_not_a_run", "graph", ("--run_dir={T}/nowhere", "--tokens=1"),
      "{T}/nowhere"),
  Row("graph_bad_token_id", "graph", ("--run_dir={T}/r", "--tokens=1,x,2"),
      "--tokens: 'x' is no token id; give integers separated by commas"),
  Row("graph_toy_without_tokens", "graph", ("--run_dir={T}/r",
      "--tokens=0,1", "--output={T}/g.png"), "not a language model",
      setup=_run_copy("tms"), untouched=True),
  Row("graph_position_beyond_prompt", "graph", ("--run_dir={T}/r",
      "--tokens=0,1", "--position=5", "--output={T}/g.png"), "position 5",
      setup=_run_copy("induction"), untouched=True),
  Row("graph_share_zero", "graph", ("--run_dir={T}/r", "--tokens=0,1",
      "--share=0", "--output={T}/g.png"), "share",
      setup=_run_copy("induction"), untouched=True),
  Row("graph_token_negative", "graph", ("--run_dir={T}/r", "--tokens=-1,3",
      "--output={T}/g.png"),
      "--tokens: token id -1 is outside the vocabulary [0, 32)",
      setup=_run_copy("induction"), untouched=True),
  Row("graph_token_past_vocab", "graph", ("--run_dir={T}/r", "--tokens=32,3",
      "--output={T}/g.png"),
      "--tokens: token id 32 is outside the vocabulary [0, 32)",
      setup=_run_copy("induction"), untouched=True),
  Row("graph_logit_token_past_vocab", "graph", ("--run_dir={T}/r",
      "--tokens=1,3", "--token=32", "--output={T}/g.png"),
      "--token=32 is outside the vocabulary [0, 32)",
      setup=_run_copy("induction"), untouched=True),
  # The induction toy's 64 rotary positions: a longer prompt was answered.
  Row("graph_prompt_past_positions", "graph", ("--run_dir={T}/r",
      "--tokens=" + ",".join(["1"] * 65), "--output={T}/g.png"),
      "--tokens: the prompt has 65 tokens, more than the model's 64 "
      "positions; give at most 64", setup=_run_copy("induction"),
      untouched=True),
  Row("graph_output_is_a_directory", "graph", ("--run_dir={T}/nowhere",
      "--tokens=0,1", "--output={T}"),
      "--output={T} is a directory; name a file in it, e.g. "
      "{T}/attribution_graph.png", untouched=True),
  Row("graph_output_directory_missing", "graph", ("--run_dir={T}/r",
      "--tokens=0,1", "--output={T}/no/g.png"),
      "cannot write {T}/no/g.png: its directory {T}/no does not exist"),
  Row("tensorboard_not_a_run", "tensorboard", ("--run_dir={T}/nowhere",),
      "holds no metrics.jsonl; pass the output directory of a bin/train run"),
  Row("tokenizer_not_a_dir", "tokenize", (
    "--tokenizer={T}/nowhere", "--input={T}/in.txt", "--output={T}/o.bin"),
    "--tokenizer {T}/nowhere is not a directory", setup=_input_file),
  Row("tokenize_input_fifo", "tokenize", (
    FIXTURE_TOKENIZER, "--input={T}/pipe", "--output={T}/o.bin"),
    "--input {T}/pipe is a FIFO (named pipe), not a regular file",
    setup=lambda t: os.mkfifo(t / "pipe")),
  Row("tokenize_input_device", "tokenize", (
    FIXTURE_TOKENIZER, "--input=/dev/zero", "--output={T}/o.bin"),
    "--input /dev/zero is a character device, not a regular file"),
  Row("tokenize_eos_past_vocab", "tokenize", (
    "--tokenizer={T}/tok", "--input={T}/w.txt", "--output={T}/o.bin",
    "--eos_id=4"), "--eos_id=4 is outside the tokenizer's vocabulary [0, 4)",
    setup=_eos_only_input),
  Row("tokenize_input_missing", "tokenize", (
    FIXTURE_TOKENIZER, "--input={T}/missing.txt", "--output={T}/o.bin"),
    "--input {T}/missing.txt not found", untouched=True),
  Row("tokenize_output_suffix", "tokenize", (
    FIXTURE_TOKENIZER, "--input={T}/in.txt", "--output={T}/o.txt"),
    "must end in .bin", setup=_input_file),
  Row("tokenize_output_parent", "tokenize", (
    FIXTURE_TOKENIZER, "--input={T}/in.txt", "--output={T}/missing/o.bin"),
    "--output directory {T}/missing does not exist", setup=_input_file),
  Row("tokenize_fixture_without_tokenizer", "tokenize", (
    FIXTURE_TOKENIZER, "--input={T}/in.txt", "--output={T}/o.bin"),
    "it holds no tokenizer.json", setup=_input_file),
)


def _fill(text: str, t: pathlib.Path) -> str:
  return text.replace("{T}", str(t)).replace("{ROOT}", str(ROOT))


def _listing(directory: pathlib.Path) -> dict[str, str | None]:
  """Return every entry under `directory` but run locks: a file's text,
  None for a directory."""
  return {str(p.relative_to(directory)):
          p.read_text(errors="replace") if p.is_file() else None
          for p in sorted(directory.rglob("*"))
          if p.name != run_dir.LOCK_FILE}


class Result(NamedTuple):
  code: int
  stdout: str
  stderr: str
  directory: pathlib.Path


@pytest.fixture(scope="module")
def results(tmp_path_factory, harvested_tms, finished_run) -> dict[str, Result]:
  """Run every row once; return its exit code, output and directory."""
  _FINISHED["run"] = finished_run
  base = tmp_path_factory.mktemp("bad_inputs")
  logs = base / "logs"
  logs.mkdir()
  holders, specs = [], []
  try:
    for row in ROWS:
      t = base / row.id
      t.mkdir()
      if row.harvested:
        shutil.copytree(harvested_tms, t / "r")
      made = row.setup(t) if row.setup else None
      if isinstance(made, subprocess.Popen):
        holders.append(made)
      if row.untouched:
        (logs / f"{row.id}.before").write_text(json.dumps(_listing(t)))
      specs.append({
        "id": row.id, "program": row.program,
        "argv": [_fill(a, t) for a in row.argv], "cwd": _fill(row.cwd, t),
        "env": {"JAX_PLATFORMS": "cpu"}, "prelude": row.prelude,
        "out": str(logs)})
    runner = subprocess.run(
      [sys.executable, "-P", str(pathlib.Path(__file__).with_name(
        "run_binaries.py"))], input=json.dumps(specs), capture_output=True,
      text=True, timeout=1200, cwd=ROOT)
    assert runner.returncode == 0, runner.stderr
    codes = json.loads(runner.stdout)
  finally:
    for holder in holders:
      holder.kill()
      holder.wait()
  return {row.id: Result(codes[row.id],
                         (logs / f"{row.id}.stdout").read_text(),
                         (logs / f"{row.id}.stderr").read_text(),
                         base / row.id) for row in ROWS}


def test_the_table_covers_every_case_once():
  ids = [row.id for row in ROWS]
  assert len(ids) == len(set(ids))
  assert len(ids) >= 60


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_a_bad_input_is_one_line_naming_the_fix(results, row):
  result = results[row.id]
  lines = [line for line in result.stderr.splitlines()
           if line.startswith(f"{row.program}: error: ")]
  assert result.code == row.code, result.stderr
  assert len(lines) == 1, result.stderr
  assert _fill(row.fragment, result.directory) in lines[0]
  # Ours is the only error prefix: no library's own (absl's `ERROR::`).
  assert "ERROR" not in lines[0], lines[0]


def test_no_traceback_reaches_stderr(results):
  leaked = [row_id for row_id, result in results.items()
            if "Traceback" in result.stderr]
  assert leaked == []


def test_browse_beyond_loopback_warns_it_serves_every_interface(results):
  assert ("browse: warning: --host=0.0.0.0 serves on every interface"
          in results["browse_every_interface"].stderr)


def test_browse_names_the_deleted_harvest_array(results):
  result = results["browse_harvest_array_deleted"]
  assert f"{result.directory}/r/harvest/linear1/fired" in result.stderr


@pytest.mark.parametrize("row", [r for r in ROWS if r.untouched],
                         ids=[r.id for r in ROWS if r.untouched])
def test_a_refusal_leaves_what_was_there(results, row):
  result = results[row.id]
  before = json.loads(
    (result.directory.parent / "logs" / f"{row.id}.before").read_text())
  assert _listing(result.directory) == before


def test_refusals_write_no_run(results):
  # Every refusal of bin/train that comes before its setup writes leaves
  # no run files: only what the row itself prepared.
  for row in ROWS:
    if row.program != "train" or row.code != 2:
      continue
    output = results[row.id].directory / "o"
    entries = set(os.listdir(output)) if output.is_dir() else set()
    assert entries <= {".lock"}, (row.id, entries)

