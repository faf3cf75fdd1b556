"""The runnable code blocks of the README and of docs/*.md run as written.

A fenced block whose info string is `sh runnable` or `python runnable` is
run from the repository root (`sh runnable slow`: only under
`./dev test-slow`, for a block that stays long when shortened): an `sh` block by bash (errexit, pipefail), a
`python` block as `./dev run python <file>`. The paths a block names stand
for what the documents' commands make, so they are replaced before it runs
(STAND_INS): `runs/<name>` by a copy of one of the session's 4-step
finished runs (a block naming `runs/induction` runs once on the induction
toy and once on the tiny Llama, the toy and the Hugging Face path of the
same functions), its input files by small ones made here. A long command
gets flags that shorten it and move its output (SHORTENED). A block naming
`runs/`, `data/` or `models/` with no stand-in fails, so no block writes
into the repository.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
from collections.abc import Callable
from typing import NamedTuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The README and the pages it hands its topics to: their blocks are one set.
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
FENCE = re.compile(r"^```(\w+) runnable( slow)?\n(.*?)^```$",
                   re.MULTILINE | re.DOTALL)
LANGUAGES = ("sh", "python")

# `runs/<name>` in a block: the finished runs (tests/conftest.py) it runs on.
RUNS = {"runs/tms_5-2": ("tms",), "runs/induction": ("induction",
                                                      "tiny_llama")}
# The finished runs' recipe sizes, so a shortened run reuses their
# compiled programs from the session's cache.
SHORT = ("--num_steps=4", "--log_every=2", "--eval_every=0",
         "--slow_eval_every=0", "--save_every=4",
         "--faithfulness_warmup_steps=0")
# Flags appended to a command that starts with the key; `{T}` is the test's
# own directory.
SHORTENED = {
  "./dev train": ("--c=8", *SHORT, "--output_dir={T}/train"),
  "./dev harvest": ("--positions=2048", "--batch_size=16",
                    "--ablation_batches=1"),
}
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


class Block(NamedTuple):
  document: str  # relative to the repository root
  line: int
  language: str
  slow: bool
  text: str


def runnable_blocks() -> list[Block]:
  """Return every block marked runnable in DOCUMENTS, with its document and
  first line."""
  blocks = []
  for path in DOCUMENTS:
    text = path.read_text()
    blocks += [Block(str(path.relative_to(ROOT)),
                     text.count("\n", 0, m.start()) + 1, m.group(1),
                     bool(m.group(2)), m.group(3))
               for m in FENCE.finditer(text)]
  return blocks


# Input files a block reads: path in the block -> maker of its stand-in in
# the test's directory `t`, which returns the stand-in's path.

def _tokenizer(t: pathlib.Path) -> pathlib.Path:
  """A word-level Hugging Face tokenizer directory (nothing downloaded)."""
  import transformers  # noqa: PLC0415 (slow import; only this block's)
  from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
  words = ["[UNK]", "[EOS]", "the", "cat", "sat", "on", "a", "mat", "."]
  word_level = Tokenizer(models.WordLevel(
    {w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=word_level, eos_token="[EOS]", unk_token="[UNK]",
  ).save_pretrained(t / "tokenizer")
  return t / "tokenizer"


def _jsonl(t: pathlib.Path) -> pathlib.Path:
  path = t / "shard0.jsonl"
  path.write_text("".join(json.dumps({"text": text}) + "\n" for text in (
    "the cat sat on a mat .", "a cat sat .")))
  return path


def _text(t: pathlib.Path) -> pathlib.Path:
  path = t / "notes.txt"
  path.write_text("the mat sat on the cat .\n")
  return path


def _data_dir(t: pathlib.Path) -> pathlib.Path:
  (t / "data").mkdir()
  return t / "data"


def _models_dir(t: pathlib.Path) -> pathlib.Path:
  (t / "models").mkdir()
  return t / "models"


INPUTS: dict[str, Callable[[pathlib.Path], pathlib.Path]] = {
  "/models/Llama-3.1-8B": _tokenizer,
  "shard0.jsonl": _jsonl,
  "notes.txt": _text,
  "data": _data_dir,
  "models": _models_dir,
}
UNREPLACED = re.compile(r"(?<![\w./-])(runs|data|models)/")


def _path_pattern(path: str) -> re.Pattern:
  """Match `path` as a whole path or a path's leading part."""
  return re.compile(rf"(?<![\w./-]){re.escape(path)}(?![\w.-])")


def _shortened(script: str, t: pathlib.Path) -> str:
  """Append SHORTENED's flags to each command they belong to, before its
  comment; a command continued over lines with `\\` is one."""
  script = script.replace("\\\n", " ")
  lines = []
  for line in script.splitlines():
    command, hash_, comment = line.partition(" #")
    for start, extra in SHORTENED.items():
      if command == start or command.startswith(start + " "):
        command += " " + " ".join(e.replace("{T}", str(t)) for e in extra)
    lines.append(command + hash_ + comment)
  return "\n".join(lines) + "\n"


def _cases() -> list:
  cases = []
  for block in runnable_blocks():
    named = [path for path in RUNS if _path_pattern(path).search(block.text)]
    assert len(named) <= 1, (
      f"{block.document} line {block.line} names {named}: one run")
    for run in (RUNS[named[0]] if named else ("",)):
      case_id = (f"{pathlib.Path(block.document).stem}-line{block.line}-"
                 f"{block.language}" + (f"-{run}" if run else ""))
      cases.append(pytest.param(
        block, named[0] if named else "", run, id=case_id,
        marks=[pytest.mark.slow] if block.slow else []))
  return cases


def test_the_documents_mark_blocks_runnable():
  blocks = runnable_blocks()
  assert {b.language for b in blocks} == set(LANGUAGES)
  # The README's tour and the pages it links both carry runnable blocks.
  assert {b.document for b in blocks} >= {"README.md", "docs/analysis.md"}
  assert any(not b.slow for b in blocks)
  # Toy and language-model exploration both run.
  loads = [b for b in blocks if "explore.load_run" in b.text]
  assert {path for b in loads for path in RUNS
          if _path_pattern(path).search(b.text)} == set(RUNS)


@pytest.mark.parametrize("block, run_path, run", _cases())
def test_a_runnable_block_runs_as_written(block, run_path, run, finished_run,
                                          tmp_path):
  assert block.language in LANGUAGES, (
    f"{block.document} line {block.line}: runnable blocks are {LANGUAGES}")
  text = block.text
  if run:
    # A copy of its own: the block may write into the run (a harvest, a
    # report) that other tests read as it was.
    stand_in = tmp_path / "runs" / run
    # As the default command leaves it: another test of this process may
    # have harvested its copy of the run with other settings.
    shutil.copytree(finished_run(run), stand_in,
                    ignore=shutil.ignore_patterns("harvest"))
    text = _path_pattern(run_path).sub(str(stand_in), text)
  for path, make in INPUTS.items():
    if _path_pattern(path).search(text):
      text = _path_pattern(path).sub(str(make(tmp_path)), text)
  unreplaced = UNREPLACED.search(text)
  assert unreplaced is None, (
    f"{block.document} line {block.line} names {unreplaced.group(0)!r}, "
    "which tests/test_readme.py has no stand-in for")
  if block.language == "sh":
    command = ["bash", "-euo", "pipefail", "-c", _shortened(text, tmp_path)]
  else:
    script = tmp_path / "block.py"
    script.write_text(text)
    command = [str(ROOT / "dev"), "run", "python", str(script)]
  done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True,
                        text=True, timeout=900)
  assert done.returncode == 0, (
    f"{block.document} line {block.line}:\n{done.stdout[-3000:]}\n"
    f"{done.stderr[-3000:]}")
  assert "Traceback" not in done.stderr
