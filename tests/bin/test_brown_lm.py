"""The Brown pipeline end to end on a synthetic corpus in Brown's format:
`bin/prepare_brown --brown_dir=`, then `bin/train_lm --preset=tiny`; the
written model read back through `--target=hf`; a stopped run resumed.

The launches after the corpus and the model are made run once per module,
all at once, from one warm process (`run_binaries.py` forks each program's
launcher): importing JAX and the tokenizers costs seconds per process, most
of a refusal's run. The launches that continue one of those (a resume, a
replacement after a refusal) run in a second such batch. Each test checks
its own launches' exit codes and output, and what they left in their
directory.
"""

import hashlib
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.io import brown_files as brown_io
from decompax.io import run_dir, tokens, tree_npz
from decompax.recipe import flagfiles
from decompax.recipe import lm
from decompax.targets import brown, text_lm

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Each word has one tag, so a token's tag can be checked from its text.
LEXICON = {"the": "at", "dog": "nn", "cat": "nn", "runs": "vbz",
           "quickly": "rb", "big": "jj", "John's": "np$", "1/2": "cd",
           "and": "cc", "saw": "vbd", "house": "nn", "Fulton": "np-tl",
           ".": "."}


def write_corpus(directory: pathlib.Path, seed: str = "") -> None:
  """Write 500 short documents of random lexicon sentences."""
  directory.mkdir()
  words = sorted(LEXICON)
  for name in brown.document_names():
    rng = random.Random(seed + name)
    lines = []
    for _ in range(rng.randint(2, 5)):
      sentence = [rng.choice(words) for _ in range(rng.randint(3, 10))]
      lines.append("\t" + " ".join(f"{w}/{LEXICON[w]}"
                                   for w in [*sentence, "."]))
    (directory / name).write_text("\n\n" + "\n\n".join(lines) + "\n")


def run(program: str, *args: str, env: dict | None = None):
  return subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / program), *args],
    capture_output=True, text=True, cwd=ROOT, timeout=600,
    env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  base = tmp_path_factory.mktemp("brown")
  write_corpus(base / "src")
  done = run("prepare_brown", f"--brown_dir={base / 'src'}",
             f"--data_dir={base / 'data'}", "--vocab_sizes=300")
  assert done.returncode == 0, done.stderr
  return base / "data", done.stdout


@pytest.fixture(scope="module")
def model(data, tmp_path_factory):
  out = tmp_path_factory.mktemp("model") / "tiny"
  args = ("--preset=tiny", f"--data_dir={data[0] / 'bpe-300'}",
          f"--output_dir={out}")
  done = run("train_lm", *args)
  assert done.returncode == 0, done.stderr
  return out, args, done.stdout


def test_prepare_writes_corpus_split_and_token_files(data):
  path, stdout = data
  assert len(os.listdir(path / "corpus")) == 500
  train, held_out = brown_io.read_split(str(path / "split.json"))
  assert train + held_out and not set(train) & set(held_out)
  assert (tuple(train), tuple(held_out)) == brown.split_documents(
    brown.document_names())
  assert f"split {len(train)} train / {len(held_out)} held out" in stdout
  assert sorted(os.listdir(path / "bpe-300")) == sorted([
    *(f"{part}.{ext}"
      for part in ("train", "held_out", "fit", "validation")
      for ext in ("bin", "json", "tags.bin", "tags.json", "sentences.bin")),
    "tokenizer.json", "tokenizer_config.json"])
  bpe = path / "bpe-300"
  fit, validation, train_file = (
    tokens.open_tokens(bpe / f"{part}.bin").header
    for part in ("fit", "validation", "train"))
  # The carve holds the training part's documents, no more and no fewer.
  assert fit.num_tokens + validation.num_tokens == train_file.num_tokens
  assert fit.num_documents + validation.num_documents == len(train)


def test_every_token_carries_its_words_tag(data):
  path = data[0] / "bpe-300"
  from decompax.io import hf_checkpoint  # noqa: PLC0415

  tokenizer = hf_checkpoint.read_tokenizer(str(path))
  opened = tokens.open_tokens(path / "held_out.bin")
  stream = tokens.open_tags(opened)
  _, held_out = brown_io.read_split(str(data[0] / "split.json"))
  assert [d["name"] for d in stream.documents] == held_out
  eos = tokenizer.eos_token_id
  checked = 0
  for token_id, tag_id in zip(opened.ids, stream.ids):
    tag = stream.tags[tag_id]
    text = tokenizer.decode([int(token_id)])
    if token_id == eos:
      assert tag == brown.EOS_TAG
    elif text == "\n":
      assert tag == brown.SEPARATOR
    elif text.strip() == "":
      # A lone space belongs to the word after it.
      assert text == " " and tag in LEXICON.values()
    elif text.strip() in LEXICON:
      assert tag == LEXICON[text.strip()], text
      checked += 1
  assert checked > len(opened.ids) // 3
  # Each sentence starts on a document's first token or after a newline.
  starts = {d["start"] for d in stream.documents}
  for offset in stream.sentence_starts:
    assert offset in starts or tokenizer.decode(
      [int(opened.ids[offset - 1])]) == "\n"
  assert len(stream.sentence_starts) == sum(
    len(brown_io.read_document(str(data[0] / "corpus" / n)))
    for n in held_out)


def test_bpe_decodes_the_token_file_back_to_the_corpus_text(data):
  path = data[0] / "bpe-300"
  from decompax.io import hf_checkpoint  # noqa: PLC0415

  tokenizer = hf_checkpoint.read_tokenizer(str(path))
  opened = tokens.open_tokens(path / "held_out.bin")
  stream = tokens.open_tags(opened)
  first = stream.documents[0]
  ids = opened.ids[first["start"]:first["start"] + first["num_tokens"] - 1]
  doc = brown_io.read_document(str(data[0] / "corpus" / first["name"]))
  assert tokenizer.decode([int(i) for i in ids]) == \
    brown.document_text(doc).text


def test_train_lm_reports_model_and_baselines(model):
  out, _, stdout = model
  record = json.loads((out / "train_lm.json").read_text())
  results = record["results"]
  assert record["settings"]["preset"]["name"] == "tiny"
  assert 0 < results["bigram_ce"] < results["unigram_ce"] < np.log(300)
  assert 0 < results["model_ce"] < np.log(300)
  assert "held-out cross entropy" in stdout and "ETA" in stdout
  lines = (out / "metrics.jsonl").read_text().splitlines()
  last = json.loads(lines[-1])
  assert last["step"] == 40 and 0 < last["held_out_ce"] < np.log(300)
  assert {"config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json"} <= set(os.listdir(out))


def _trained_weights(out):
  preset = text_lm.PRESETS["tiny"]
  template = jax.eval_shape(
    lambda: text_lm.init_state(jax.random.key(0), preset))
  state, meta = tree_npz.load_tree(out / "train_state.npz", template)
  assert meta["step"] == preset.num_steps
  return state.weights


def test_hf_directory_reproduces_the_trainers_logits(model, data):
  out = model[0]
  weights = jax.tree.map(jnp.asarray, _trained_weights(out))
  preset = text_lm.PRESETS["tiny"]
  run_config = flagfiles.read_args([
    "--target=hf", f"--model_dir={out}", "--compute_dtype=float32",
    f"--seq_len={preset.seq_len}"])
  record, fns, load = lm.hf_target(run_config)
  assert record.token_model == text_lm.model_config(preset)
  opened = tokens.open_tokens(data[0] / "bpe-300" / "held_out.bin")
  batch = jnp.asarray(tokens.read_batch(opened, 1, 0, 4, preset.seq_len))
  got = jax.jit(lambda w: fns.clean_forward(w, batch, ())[0])(load())
  want = jax.jit(lambda w: text_lm.logits(w, batch, record.token_model))(weights)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _copy(model_dir: pathlib.Path, destination: pathlib.Path
          ) -> pathlib.Path:
  shutil.copytree(model_dir, destination)
  (destination / run_dir.LOCK_FILE).unlink(missing_ok=True)
  return destination


def _without_output(args) -> list[str]:
  return [a for a in args if not a.startswith("--output_dir")]


def _steps(out: pathlib.Path) -> list[int]:
  return [json.loads(line)["step"] for line in
          (out / "metrics.jsonl").read_text().splitlines()]


class Launched(NamedTuple):
  """One launch: its exit code, its output, and the sha256 of every file
  its directory held when its batch ended (before any later launch)."""
  returncode: int
  stdout: str
  stderr: str
  digests: dict[str, str]


def _digests(directory: pathlib.Path) -> dict[str, str]:
  return {str(p.relative_to(directory)): hashlib.sha256(
    p.read_bytes()).hexdigest()
    for p in sorted(directory.rglob("*")) if p.is_file()}


def _launch_batch(launches: dict, base: pathlib.Path) -> dict[str, Launched]:
  """Run `launches` (id -> its directory, program, arguments, extra
  environment and prelude) from one warm process, each forked; return
  each one's `Launched`."""
  logs = base / "logs"
  logs.mkdir(exist_ok=True)
  specs = [{"id": name, "program": program, "argv": list(args),
            "cwd": str(ROOT), "env": {"JAX_PLATFORMS": "cpu", **env},
            "prelude": prelude, "out": str(logs)}
           for name, (_, program, args, env, prelude) in launches.items()]
  runner = subprocess.run(
    [sys.executable, "-P", str(ROOT / "tests" / "bin" / "run_binaries.py")],
    input=json.dumps(specs), capture_output=True, text=True, timeout=1200,
    cwd=ROOT)
  assert runner.returncode == 0, runner.stderr[-3000:]
  codes = json.loads(runner.stdout)
  return {name: Launched(codes[name], (logs / f"{name}.stdout").read_text(),
                         (logs / f"{name}.stderr").read_text(),
                         _digests(launches[name][0]))
          for name in launches}


# The first batch's launches: each prepares its own directory `t` from the
# finished corpus and model, and names its launch.

def _stopped(t, data, model):
  return ("train_lm", [*_without_output(model[1]), f"--output_dir={t / 'm'}"],
          {"DECOMPAX_FAULT": "sigterm_after_step=17"}, None)


def _never_saved(t, data, model):
  m = _copy(model[0], t / "m")
  (m / "train_state.npz").unlink()
  (m / "metrics.jsonl").write_text('{"step": 99}\n')
  return ("train_lm", [*_without_output(model[1]), f"--output_dir={m}"], {},
          None)


def _overwritten(t, data, model):
  m = _copy(model[0], t / "m")
  (m / "notes.txt").write_text("keep me")
  return ("train_lm", [*_without_output(model[1]), f"--output_dir={m}",
                       "--overwrite", "--num_steps=2",
                       "--eval_every_steps=0"], {}, None)


def _another_runs(t, data, model):
  return ("train_lm", [*model[1], "--num_steps=5"], {}, None)


def _not_train_lms(t, data, model):
  # A user's Hugging Face model: every file of it one train_lm writes.
  m = t / "hf"
  shutil.copytree(ROOT / "tests" / "fixtures" / "tiny_llama", m)
  (m / "metrics.jsonl").write_text('{"step": 1}\n')
  return ("train_lm", [*_without_output(model[1]), f"--output_dir={m}",
                       "--overwrite"], {}, None)


def _another_data_dir(t, data, model):
  other = t / "other"
  shutil.copytree(data[0] / "bpe-300", other)
  opened = tokens.open_tokens(other / "train.bin")
  tokens.write_tokens(other / "train.bin", [np.asarray(opened.ids)[::-1]],
                      opened.header.vocab_size, opened.header.eos_id, "t")
  m = _copy(model[0], t / "m")
  return ("train_lm", ["--preset=tiny", f"--data_dir={other}",
                       f"--output_dir={m}"], {}, None)


def _truncated(t, data, model):
  m = _copy(model[0], t / "m")
  state = m / "train_state.npz"
  state.write_bytes(state.read_bytes()[:1000])
  return ("train_lm", [*_without_output(model[1]), f"--output_dir={m}"], {},
          None)


def _corpus_args(t):
  return (f"--brown_dir={t / 'src2'}", f"--data_dir={t / 'data'}",
          "--vocab_sizes=300")


def _another_corpus(t, data, model):
  _copy(data[0], t / "data")
  write_corpus(t / "src2", seed="another")
  return ("prepare_brown", list(_corpus_args(t)), {}, None)


def _no_validation_carve(t, data, model):
  path = _copy(data[0], t / "data")
  for name in ("validation.json", "validation.bin"):
    (path / "bpe-300" / name).unlink()
  return ("prepare_brown", [f"--brown_dir={data[0] / 'corpus'}",
                            f"--data_dir={path}", "--vocab_sizes=300"], {},
          None)


def _unfillable_vocab(t, data, model):
  return ("prepare_brown", [f"--brown_dir={data[0] / 'corpus'}",
                            f"--data_dir={t / 'd'}", "--vocab_sizes=20000"],
          {}, None)


def _stop_signal(t, data, model):
  # The signal arrives while the tokenizer trains.
  prelude = (
    "import os, signal\n"
    "from decompax.targets import brown\n"
    "train = brown.train_bpe\n"
    "def stopped(*args):\n"
    "  os.kill(os.getpid(), signal.SIGINT)\n"
    "  return train(*args)\n"
    "brown.train_bpe = stopped\n")
  return ("prepare_brown", [f"--brown_dir={data[0] / 'corpus'}",
                            f"--data_dir={t / 'd'}", "--vocab_sizes=300"],
          {}, prelude)


FIRST = (_stopped, _never_saved, _overwritten, _another_runs, _not_train_lms,
         _another_data_dir, _truncated, _another_corpus,
         _no_validation_carve, _unfillable_vocab, _stop_signal)


@pytest.fixture(scope="module")
def launched(data, model, tmp_path_factory):
  """Return each first-batch launch's `Launched` and its directory."""
  base = tmp_path_factory.mktemp("launched")
  launches = {}
  for setup in FIRST:
    t = base / setup.__name__.lstrip("_")
    t.mkdir()
    launches[t.name] = (t, *setup(t, data, model))
  results = _launch_batch(launches, base)
  return {name: (results[name], launches[name][0]) for name in launches}


@pytest.fixture(scope="module")
def relaunched(launched, model, tmp_path_factory):
  """Return the second batch's launches: the stopped run resumed (after a
  record a killed attempt logged past its last save), and the refused
  corpus replaced with --overwrite."""
  stopped = launched["stopped"][1]
  # A record a killed attempt logged after its last save (step 17).
  run_dir.append_metrics(stopped / "m" / "metrics.jsonl", {"step": 30})
  corpus = launched["another_corpus"][1]
  launches = {
    "resumed": (stopped, "train_lm", [*_without_output(model[1]),
                                      f"--output_dir={stopped / 'm'}"],
                {}, None),
    "replaced": (corpus, "prepare_brown",
                 [*_corpus_args(corpus), "--overwrite"], {}, None)}
  return _launch_batch(launches, tmp_path_factory.mktemp("relaunched"))


def test_a_stopped_run_resumes_onto_the_same_weights(model, launched,
                                                     relaunched):
  out = model[0]
  stopped, t = launched["stopped"]
  assert stopped.returncode == 75, stopped.stderr
  assert "saved step 17" in stopped.stdout
  assert "m/model.safetensors" not in stopped.digests
  assert "m/train_state.npz" in stopped.digests
  resumed = relaunched["resumed"]
  assert resumed.returncode == 0, resumed.stderr
  assert "resuming" in resumed.stdout and "at step 17" in resumed.stdout
  jax.tree.map(np.testing.assert_array_equal,
               _trained_weights(t / "m"), _trained_weights(out))
  a = json.loads((t / "m" / "train_lm.json").read_text())["results"]
  b = json.loads((out / "train_lm.json").read_text())["results"]
  assert a == b
  # Records past the resumed step are cut, not repeated.
  assert _steps(t / "m") == _steps(out) == [40]


def test_a_run_that_never_saved_starts_over(model, launched):
  done, t = launched["never_saved"]
  assert done.returncode == 0, done.stderr
  assert "resuming" not in done.stdout
  jax.tree.map(np.testing.assert_array_equal,
               _trained_weights(t / "m"), _trained_weights(model[0]))
  assert _steps(t / "m") == [40]


def test_overwrite_removes_only_what_a_run_writes(launched):
  done, t = launched["overwritten"]
  assert done.returncode == 0, done.stderr
  assert (t / "m" / "notes.txt").read_text() == "keep me"
  record = json.loads((t / "m" / "train_lm.json").read_text())
  assert record["settings"]["preset"]["num_steps"] == 2


def test_another_runs_directory_is_refused(model, launched):
  out = model[0]
  done, _ = launched["another_runs"]
  assert done.returncode == 2
  assert done.stderr.splitlines() == [
    f"train_lm: error: --output_dir {out} holds train_lm output made with "
    "other settings (preset.num_steps was 40, now 5); rerun with those "
    "settings to reuse it, pass --overwrite to replace it, or choose another "
    "directory"]


def test_overwrite_refuses_a_model_train_lm_did_not_write(launched):
  done, t = launched["not_train_lms"]
  assert done.returncode == 2, done.stderr
  assert "which no train_lm run wrote" in done.stderr
  assert len(done.stderr.splitlines()) == 1
  before = _digests(ROOT / "tests" / "fixtures" / "tiny_llama")
  after = {k.removeprefix("hf/"): v for k, v in done.digests.items()}
  assert after.pop("metrics.jsonl") == hashlib.sha256(
    b'{"step": 1}\n').hexdigest()
  assert after == before


def test_another_data_dir_is_refused_not_resumed(launched):
  done, _ = launched["another_data_dir"]
  assert done.returncode == 2, done.stderr
  assert "other settings (data.train.bin.sha256 was" in done.stderr
  assert "resuming" not in done.stdout


def test_a_truncated_saved_state_is_one_line(launched):
  done, t = launched["truncated"]
  state = t / "m" / "train_state.npz"
  assert done.returncode == 2, done.stderr
  assert done.stderr.splitlines() == [
    f"train_lm: error: cannot read saved state {state} (File is not a zip "
    "file); delete it to start over"]


def test_another_corpus_is_refused_then_replaced_whole(data, launched,
                                                       relaunched):
  refused, t = launched["another_corpus"]
  old = _digests(data[0])["bpe-300/train.bin"]
  assert refused.returncode == 2, refused.stderr
  assert "other settings (corpus.sha256 was" in refused.stderr
  assert "--overwrite" in refused.stderr
  assert refused.digests["data/bpe-300/train.bin"] == old
  replaced = relaunched["replaced"]
  assert replaced.returncode == 0, replaced.stderr
  assert "reusing" not in replaced.stdout
  assert replaced.digests["data/bpe-300/train.bin"] != old


def test_a_token_folder_missing_its_validation_carve_is_built_again(
    launched):
  done, t = launched["no_validation_carve"]
  assert done.returncode == 0, done.stderr
  assert "reusing" not in done.stdout
  assert (t / "data" / "bpe-300" / "validation.json").is_file()


def test_a_vocab_the_corpus_cannot_fill_is_refused(launched):
  done, t = launched["unfillable_vocab"]
  assert done.returncode == 2, done.stderr
  assert "--vocab_sizes=20000: the training split fills only" in done.stderr
  assert not (t / "d" / "bpe-20000").exists()


def test_a_stop_signal_exits_75_without_a_traceback(launched):
  done, t = launched["stop_signal"]
  assert done.returncode == 75, done.stderr
  assert "Traceback" not in done.stderr
  assert "stop signal (SIGINT)" in done.stdout
  assert not (t / "d" / "bpe-300").exists()
  assert not [n for n in os.listdir(t / "d") if n.startswith(".bpe")]
