"""Test-wide setup: CPU with eight simulated devices, absl flags parsed."""

import contextlib
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile

import pytest

# Must precede the first JAX backend initialisation.
os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402
from absl import flags  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
flags.FLAGS.mark_as_parsed()


# The session's shared directories this process made (the controller's, or
# a lone process's), removed when it ends; workers inherit them.
_OWNED_DIRS: list[str] = []


def _session_dir(variable: str, prefix: str) -> str:
  """Return the directory named by environment `variable`, making it (and
  owning it) where no parent process has."""
  if variable not in os.environ:
    os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
    _OWNED_DIRS.append(os.environ[variable])
  return os.environ[variable]


def _share_compiled_programs() -> None:
  """Point every test process at one persistent compilation cache.

  Many tests build the same step (the same recipe, rebuilt as new closures,
  or relaunched as a `bin/train` child), and each rebuild would compile it
  again. The controller makes the directory; xdist workers and the binaries
  tests launch inherit it through the environment. Bounding the cache's
  size turns on its file lock, which keeps concurrent processes from
  reading an entry another is still writing. A test that studies the cache
  sets its own directory and restores this one.
  """
  cache_dir = _session_dir("JAX_COMPILATION_CACHE_DIR", "decompax-test-xla-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
  jax.config.update("jax_compilation_cache_max_size",
                    int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))


_share_compiled_programs()
# One directory of finished runs (`finished_run` below), made before the
# workers start: a run one xdist worker trained, the others copy instead of
# training it again.
SHARED_RUNS = "DECOMPAX_TEST_SHARED_RUNS"
_session_dir(SHARED_RUNS, "decompax-test-runs-")


# The modules that take longest, longest first. The first seven were
# measured again in a full run on two cores beside other heavy load (load
# average 8 to 17), so their seconds of test time are relative, not what a
# quiet machine takes: 863, 530 (786 before its token-file resume became
# slow), 400, 386, 349, 267, 222.
# The others keep their order of an earlier, quiet full run (68, 64, 60,
# 59, 54, 49, 43, 40, 35, 29, 28). Workers take whole files in collection
# order, so these go first: a long file left for last (as
# tests/test_readme.py would be, by its name) runs alone while the other
# workers idle. The two toy-transformer modules that share one trained run
# (`finished_run`) are apart, so that the second finds it trained instead
# of waiting on it.
LONG_MODULES = (
  "bin/test_targeted.py", "placement/test_two_process.py",
  "bin/test_eval_smoke_models.py", "analysis/test_harvesting.py",
  "bin/test_train.py", "bin/test_browse.py", "bin/test_family_runs.py",
  "test_readme.py", "bin/test_eval_smoke.py", "losses/test_adversarial.py",
  "bin/test_bad_inputs.py", "bin/test_run_dir_contract.py",
  "placement/test_presets.py",
  "bin/test_resume.py", "bin/test_lm_train.py",
  "placement/test_sharded_step.py", "bin/test_crash_soak.py",
  "bin/test_stop_after.py")
TESTS_DIR = pathlib.Path(__file__).resolve().parent
if missing := [m for m in LONG_MODULES if not (TESTS_DIR / m).is_file()]:
  raise RuntimeError(f"tests/conftest.py LONG_MODULES names {missing}, "
                     "which do not exist: rename or drop them there")


# The order the tests run in, drawn afresh for each session: the files
# after LONG_MODULES are shuffled, and so are the tests within every file,
# by one seed the controller draws (or reads from DECOMPAX_TEST_ORDER) and
# its xdist workers inherit, so that they all collect one order. A test
# that passes only after another (in its file, or in a file its worker ran
# before) fails in some sessions, and the header's seed repeats it;
# DECOMPAX_TEST_ORDER=fixed keeps the order the files are written in.
TEST_ORDER = "DECOMPAX_TEST_ORDER"
os.environ.setdefault(TEST_ORDER, str(random.randrange(1 << 16)))


def order_seed() -> int | None:
  """Return the session's order seed; None for the written order."""
  value = os.environ[TEST_ORDER]
  if value == "fixed":
    return None
  if not value.isdigit():
    raise pytest.UsageError(f"{TEST_ORDER}={value!r}: give a seed (a "
                            "non-negative integer) or 'fixed'")
  return int(value)


def ordered(items: list, module_of, seed: int | None) -> list:
  """Return `items` file by file: LONG_MODULES first in their order, the
  other files, and the tests within each file, shuffled by `seed`."""
  files: dict[str, list] = {}
  for item in items:
    files.setdefault(module_of(item), []).append(item)
  names = list(files)
  if seed is not None:
    rng = random.Random(seed)
    rng.shuffle(names)
    for name in names:
      rng.shuffle(files[name])
  return [item for name in sorted(names, key=_rank) for item in files[name]]


def _rank(module: str) -> int:
  if module in LONG_MODULES:
    return LONG_MODULES.index(module)
  return len(LONG_MODULES)


def pytest_report_header(config):
  seed = order_seed()
  if seed is None:
    return f"test order: as written ({TEST_ORDER}=fixed)"
  return (f"test order: seed {seed} ({TEST_ORDER}={seed} repeats it, "
          f"{TEST_ORDER}=fixed keeps the written order)")


def _module(item) -> str:
  return item.path.relative_to(TESTS_DIR).as_posix()


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
  # Shuffled before pytest groups the tests that share a value of a
  # parametrized module fixture (so that each value is set up once), and
  # the long files put back first after it.
  items[:] = ordered(items, _module, order_seed())
  yield
  items.sort(key=lambda item: _rank(_module(item)))


def pytest_unconfigure(config):
  for directory in _OWNED_DIRS:
    shutil.rmtree(directory, ignore_errors=True)


import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from decompax.core import site_forward, sites as sites_lib, target  # noqa: E402


def make_chain_target(d: int = 4, d_out: int = 3, c: int = 5):
  """Return a tiny three-site ReLU chain: two same-kind sites and a head.

  Built only from `decompax.core`, so core and loss tests need no toy target.
  """
  sites = (
    sites_lib.SiteSpec("l0", "sq", 0, d, d, c),
    sites_lib.SiteSpec("l1", "sq", 1, d, d, c),
    sites_lib.SiteSpec("head", "head", 0, d, d_out, c),
  )
  acts = (jax.nn.relu, jax.nn.relu, lambda h: h)

  def weight(weights, site):
    return weights[site.kind][site.row]

  def run(weights, x, matmul):
    taps, h = {}, x
    for site, act in zip(sites, acts):
      taps[site.name] = h
      y = matmul(site, h, weight(weights, site))
      taps[f"{site.name}.out"] = y
      h = act(y)
    return h, taps

  def select(taps, wanted):
    unknown = set(wanted) - set(taps)
    if unknown:
      raise ValueError(f"unknown taps {sorted(unknown)}")
    return {k: taps[k] for k in wanted}

  def clean_forward(weights, x, wanted):
    h, taps = run(weights, x, lambda site, h, w: h @ w)
    return h, select(taps, wanted)

  def masked_run(weights, components, x, site_masks):
    def matmul(site, h, w):
      v, u = sites_lib.site_factors(components, site)
      return site_forward.site_matmul(h, w, v, u, site_masks.get(site.name))
    return run(weights, x, matmul)

  def masked_forward(weights, components, x, site_masks):
    return masked_run(weights, components, x, site_masks)[0]

  def masked_forward_taps(weights, components, x, site_masks, clean_taps,
                          wanted):
    del clean_taps
    h, taps = masked_run(weights, components, x, site_masks)
    return h, select(taps, wanted)

  def mse(a, b):
    return jnp.mean(jnp.square(a - b))

  fns = target.TargetFns(
    sites=sites,
    clean_forward=clean_forward,
    masked_forward=masked_forward,
    masked_forward_taps=masked_forward_taps,
    frozen_stacks=lambda weights: dict(weights),
    divergence=mse,
    batch_lead_shape=lambda x: x.shape[:-1],
    feature_probe=lambda: 0.75 * jnp.eye(d),
  )
  key0, key1 = jax.random.split(jax.random.key(42))
  weights = {
    "sq": jax.random.normal(key0, (2, d, d)) / jnp.sqrt(d),
    "head": jax.random.normal(key1, (1, d, d_out)) / jnp.sqrt(d),
  }
  return fns, weights


_SCALAR_READS = ("__float__", "__int__", "__bool__", "__index__",
                 "__complex__")


@contextlib.contextmanager
def _implicit_scalar_reads_fail():
  """Within, `float(x)`, `int(x)`, `bool(x)` of a jax.Array raise.

  An accelerator's device-to-host transfer guard refuses these implicit
  reads; CPU arrays are host memory, so the real guard never fires here.
  Explicit `jax.device_get` still works.
  """
  array_type = type(jnp.zeros(()))
  saved = {name: getattr(array_type, name) for name in _SCALAR_READS}

  def refuse(self, *args):
    raise RuntimeError("implicit device-to-host read of a jax.Array")

  for name in saved:
    setattr(array_type, name, refuse)
  try:
    yield
  finally:
    for name, method in saved.items():
      setattr(array_type, name, method)


@pytest.fixture(scope="session")
def test_order():
  """Return `(ordered, LONG_MODULES)`: how a session orders its tests."""
  return ordered, LONG_MODULES


@pytest.fixture(scope="session")
def implicit_reads_fail():
  """A context manager in which implicit scalar reads of jax.Arrays raise,
  as they do under an accelerator's transfer guard."""
  return _implicit_scalar_reads_fail


@pytest.fixture(scope="session")
def chain():
  """A tiny three-site target and its frozen weights."""
  return make_chain_target()


def make_token_target(vocab: int = 6, d: int = 4, c: int = 3):
  """Return a tiny LM-shaped target on tokens `[B, T]` and its weights.

  A frozen embedding, a causal running mean over positions (so context
  matters), then sites `mix` (ReLU after) and `head` giving logits; KL
  divergence and next-token labels, as a language model exposes them.
  Built only from `decompax.core`.
  """
  sites = (
    sites_lib.SiteSpec("mix", "mix", 0, d, d, c),
    sites_lib.SiteSpec("head", "head", 0, d, vocab, c),
  )

  def run(weights, tokens, matmul):
    x = weights["embed"][tokens]
    x = jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1)[:, None]
    taps = {"mix": x}
    mixed = matmul(sites[0], x, weights["mix"][0])
    taps["mix.out"] = mixed
    taps["head"] = h = jax.nn.relu(mixed)
    taps["head.out"] = logits = matmul(sites[1], h, weights["head"][0])
    return logits, taps

  def select(taps, wanted):
    unknown = set(wanted) - set(taps)
    if unknown:
      raise ValueError(f"unknown taps {sorted(unknown)}")
    return {k: taps[k] for k in wanted}

  def clean_forward(weights, tokens, wanted):
    logits, taps = run(weights, tokens, lambda s, x, w: x @ w)
    return logits, select(taps, wanted)

  def masked_run(weights, components, tokens, site_masks):
    def matmul(site, x, w):
      v, u = sites_lib.site_factors(components, site)
      return site_forward.site_matmul(x, w, v, u, site_masks.get(site.name))
    return run(weights, tokens, matmul)

  def masked_forward_taps(weights, components, tokens, site_masks, clean_taps,
                          wanted):
    del clean_taps
    logits, taps = masked_run(weights, components, tokens, site_masks)
    return logits, select(taps, wanted)

  def kl(masked, clean):
    log_p = jax.nn.log_softmax(clean, axis=-1)
    log_q = jax.nn.log_softmax(masked, axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1))

  def labels(tokens):
    return jnp.concatenate(
      [tokens[:, 1:], jnp.full_like(tokens[:, :1], -1)], axis=1)

  fns = target.TargetFns(
    sites=sites,
    clean_forward=clean_forward,
    masked_forward=lambda w, comps, t, m: masked_run(w, comps, t, m)[0],
    frozen_stacks=lambda weights: {"mix": weights["mix"],
                                   "head": weights["head"]},
    divergence=kl,
    batch_lead_shape=lambda tokens: tokens.shape,
    masked_forward_taps=masked_forward_taps,
    token_labels=labels,
  )
  keys = jax.random.split(jax.random.key(7), 3)
  weights = {
    "embed": jax.random.normal(keys[0], (vocab, d)),
    "mix": jax.random.normal(keys[1], (1, d, d)) / jnp.sqrt(d),
    "head": 2.0 * jax.random.normal(keys[2], (1, d, vocab)) / jnp.sqrt(d),
  }
  return fns, weights


@pytest.fixture(scope="session")
def token_target():
  """A tiny LM-shaped target on tokens and its frozen weights."""
  return make_token_target()


def _host(tree):
  def leaf(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(jax.device_get(x))
  return jax.tree.map(leaf, tree)


@pytest.fixture(scope="session")
def assert_bitwise_equal():
  """Return an assertion that two pytrees (typed keys included) have the
  same structure and bit-identical leaves."""

  def check(a, b):
    a, b = _host(a), _host(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      assert x.dtype == y.dtype and x.shape == y.shape
      assert x.tobytes() == y.tobytes()

  return check


# Short finished runs of `bin/train`, trained once per test process.
RUN_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHORT = ("--num_steps=4", "--log_every=2", "--eval_every=0",
         "--slow_eval_every=0", "--save_every=4",
         "--faithfulness_warmup_steps=0")
RECIPES = {
  "tms": ("--target=tms_5-2", "--c=6", "--batch_size=16",
          "--use_delta_component"),
  "induction": (f"--flagfile={RUN_ROOT / 'flags' / 'induction.flags'}",
                "--c=8", "--batch_size=4"),
  # `{tokens}`: a token file of random documents the fixture writes.
  "tiny_llama": (f"--flagfile={RUN_ROOT / 'flags' / 'tiny_llama.flags'}",
                 f"--model_dir={RUN_ROOT / 'tests' / 'fixtures' / 'tiny_llama'}",
                 "--batch_size=8", "--seq_len=16", "--c=8",
                 "--data_path={tokens}"),
  # A plain (ungated) MLP's run: the tiny GPT-2 on the same kind of file.
  # Its tests read the model's own neurons, not what the CI makes of them:
  # the small MLP CI compiles in a fraction of the flagfile's transformer's
  # time.
  "tiny_gpt2": (f"--flagfile={RUN_ROOT / 'flags' / 'tiny_gpt2.flags'}",
                f"--model_dir={RUN_ROOT / 'tests' / 'fixtures' / 'tiny_gpt2'}",
                "--batch_size=8", "--seq_len=16", "--c=8",
                "--ci_fn=vector_mlp", "--ci_hidden=8",
                "--data_path={tokens}"),
  # A mixture of experts' run on its own random tokens: the tiny Qwen3-MoE,
  # layer 1's attention and every expert's projections.
  "tiny_qwen3moe": (
    f"--flagfile={RUN_ROOT / 'flags' / 'tiny_qwen3moe.flags'}",
    f"--model_dir={RUN_ROOT / 'tests' / 'fixtures' / 'tiny_qwen3moe'}",
    "--batch_size=8", "--seq_len=16", "--c=8", "--ci_d_model=8",
    "--ci_d_mlp=16"),
  # `{model}`, `{tokens}`: a tiny Llama with a BPE tokenizer and a tagged
  # token file of English-like sentences (`_text_model`): a text run with
  # part-of-speech statistics, its MLP and attention output decomposed.
  "text_llama": (f"--flagfile={RUN_ROOT / 'flags' / 'tiny_llama.flags'}",
                 "--model_dir={model}", "--data_path={tokens}",
                 "--sites=layers.1.mlp.*,layers.1.self_attn.o_proj",
                 "--batch_size=8", "--seq_len=16", "--c=8"),
}
# Each word of the text run's sentences has one Brown tag.
TEXT_LEXICON = {"the": "at", "a": "at", "dog": "nn", "cat": "nn",
                "house": "nn", "runs": "vbz", "saw": "vbd", "sleeps": "vbz",
                "quickly": "rb", "big": "jj", "red": "jj", "she": "pps",
                "and": "cc", "in": "in", "two": "cd", "dogs": "nns", ".": "."}
TEXT_SENTENCES = (("the", "big", "dog", "runs", "quickly", "."),
                  ("she", "saw", "a", "red", "cat", "in", "the", "house", "."),
                  ("the", "cat", "sleeps", "and", "the", "dog", "runs", "."),
                  ("two", "red", "dogs", "saw", "she", "."))


def _token_file(path) -> str:
  """Write 200 random documents over the tiny Llama's 128-token vocabulary."""
  from decompax.io import tokens  # noqa: PLC0415
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, 127, rng.integers(5, 60)) for _ in range(200)]
  tokens.write_tokens(path, docs, 128, 127, "test")
  return str(path)


def _text_model(directory: pathlib.Path) -> dict[str, str]:
  """Write a text model into `directory`: a byte-level BPE tokenizer
  trained on `TEXT_SENTENCES`, a tiny Llama of random weights beside it
  (`text_lm`'s `tiny` preset), and a tagged token file of 24 documents of
  those sentences; return the paths as `RECIPES`' fields."""
  from decompax.io import hf_checkpoint, tokens  # noqa: PLC0415
  from decompax.targets import brown, text_lm
  from decompax.targets import glu_arrays
  rng = np.random.default_rng(0)
  documents = {
    f"d{i:02d}": [[(w, TEXT_LEXICON[w]) for w in TEXT_SENTENCES[j]]
                  for j in rng.integers(0, len(TEXT_SENTENCES), 4)]
    for i in range(24)}
  texts = [brown.document_text(d).text for d in documents.values()]
  tokenizer = brown.train_bpe(texts * 4, 300)
  model = directory / "model"
  preset = text_lm.PRESETS["tiny"]
  weights = text_lm.init(jax.random.key(0), preset)
  hf_checkpoint.write_llama_checkpoint(
    str(model), glu_arrays.weights_to_arrays(jax.device_get(weights)),
    text_lm.model_config(preset), {"bos_token_id": None,
                                   "pad_token_id": None, "eos_token_id": 0})
  hf_checkpoint.write_tokenizer_json(str(model), tokenizer.to_str(),
                                     brown.EOS_TOKEN)
  tags = brown.tag_vocabulary(documents.values())
  tag_ids = {t: i for i, t in enumerate(tags)}
  tagged = []
  for name, document in documents.items():
    text = brown.document_text(document)
    encoded = tokenizer.encode(text.text, add_special_tokens=False)
    starts = np.asarray([start for start, _ in encoded.offsets], np.int64)
    tagged.append(tokens.TaggedDocument(
      name, np.asarray(encoded.ids), brown.token_tags(text, starts, tag_ids),
      brown.sentence_tokens(text, starts)))
  path = directory / "text.bin"
  tokens.write_tagged_tokens(
    path, tagged, tags, brown.EOS_TAG, tokenizer.get_vocab_size(),
    tokenizer.token_to_id(brown.EOS_TOKEN), str(model))
  return {"model": str(model), "tokens": str(path)}


def _train_short_run(name: str, home: pathlib.Path, tokens: str,
                     **paths: str) -> None:
  """Train `RECIPES[name]` into `home/name` on the token file `tokens`."""
  home.mkdir()
  args = [a.format(tokens=tokens, **paths) for a in RECIPES[name]]
  done = subprocess.run(
    [sys.executable, "-P", str(RUN_ROOT / "bin" / "train"), *args, *SHORT,
     f"--output_dir={home / name}"], cwd=RUN_ROOT, capture_output=True,
    text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _shared_short_run(name: str) -> pathlib.Path:
  """Return the shared home of `RECIPES[name]`'s run, trained by whichever
  test process asks first while the others wait on its lock. A run is
  trained under a scratch name and renamed when finished, so one that
  failed is trained again, never half used. Its token file lies outside
  that scratch directory, at the path the run's flags keep naming after
  the rename."""
  import fcntl  # noqa: PLC0415
  shared = pathlib.Path(os.environ[SHARED_RUNS])
  home = shared / name
  with open(shared / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not home.is_dir():
      scratch = shared / f"{name}.{os.getpid()}"
      shutil.rmtree(scratch, ignore_errors=True)
      if name == "text_llama":
        made = shared / f"{name}.data"
        shutil.rmtree(made, ignore_errors=True)
        made.mkdir()
        paths = _text_model(made)
      else:
        paths = {"tokens": _token_file(shared / f"{name}.tokens.bin")}
      _train_short_run(name, scratch, **paths)
      scratch.rename(home)
  return home


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
  """Return `path(name)`: the directory of a 4-step run of `RECIPES[name]`
  (a TMS 5-2 toy, the induction toy's token model, or the tiny Llama on a
  token file of the session's, which its flags name).

  Each test process gets its own copy, free to add files to, of a run the
  suite trains once.
  """
  paths = {}

  def path(name: str) -> str:
    if name not in paths:
      copy = tmp_path_factory.mktemp("runs") / name
      shutil.copytree(_shared_short_run(name), copy)
      paths[name] = str(copy / name)
    return paths[name]

  return path


@pytest.fixture(scope="session")
def harvested(finished_run):
  """Return `path(name, **request)`: this process's finished run `name`,
  harvested once (`analysis.harvest_settings.Request(**request)`; later
  calls return the same harvest)."""
  from decompax.analysis import explore  # noqa: PLC0415
  from decompax.analysis import harvesting as harvest_lib  # noqa: PLC0415
  from decompax.analysis import harvest_settings
  from decompax.io import harvest_store  # noqa: PLC0415
  done = {}

  def path(name: str, **request) -> str:
    if name not in done:
      run_path = finished_run(name)
      run = explore.load_run(run_path)
      settings = harvest_settings.resolve(run,
                                          harvest_settings.Request(**request))
      out = f"{run_path}/{harvest_store.HARVEST_DIR}"
      record = harvest_lib.harvest(run, settings, out, say=lambda _: None)
      harvest_lib.write_manifest(out, run_path, run, settings, record)
      done[name] = run_path
    return done[name]

  return path


@pytest.fixture(scope="session")
def harvested_tms(harvested) -> str:
  """Return this process's finished TMS 5-2 run, harvested with small
  settings (the browser's and the bad-input table's run)."""
  return harvested("tms", positions=512, batch_size=64, top_k=3,
                   ablation_batches=1)
