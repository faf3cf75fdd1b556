"""LM runs read their batches from token files (`--data_path`)."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.bin import placement_setup, train, train_flags
from decompax.evals import eval_step
from decompax.io import tokens as tokens_lib
from decompax.recipe import assembly, token_data

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "flags" / "tiny_llama.flags"
MODEL_DIR = ROOT / "tests" / "fixtures" / "tiny_llama"
VOCAB = 128  # the tiny Llama fixture's
SMALL = ("--num_steps=3", "--batch_size=8", "--seq_len=8", "--c=8",
         "--faithfulness_warmup_steps=0", "--eval_batches=2")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """Return a training and a held-out token file of random documents."""
  folder = tmp_path_factory.mktemp("tokens")
  rng = np.random.default_rng(0)
  paths = []
  for name, n_docs in (("train", 40), ("held_out", 6)):
    docs = [rng.integers(0, VOCAB - 1, rng.integers(5, 30))
            for _ in range(n_docs)]
    path = folder / f"{name}.bin"
    tokens_lib.write_tokens(path, docs, VOCAB, VOCAB - 1, "test")
    paths.append(path)
  return tuple(paths)


@pytest.fixture(scope="module")
def built(files):
  """Return one tiny-Llama run reading the token files, built once."""
  config = train_flags.parse_config(
    f"--flagfile={TINY}", f"--model_dir={MODEL_DIR}", *SMALL,
    f"--data_path={files[0]}", f"--eval_data_path={files[1]}")
  toy, target, load = assembly.resolve_target(config)
  weights = load()
  data = token_data.open_data(config, toy.token_model.vocab_size)
  return config, toy, target, weights, assembly.build_run(
    config, toy, target, weights, data=data)


@pytest.fixture
def lm(parse, files):
  """Return a parser of tiny-Llama configs reading the token files."""
  return lambda *args: parse(f"--flagfile={TINY}", f"--model_dir={MODEL_DIR}",
                             *SMALL, f"--data_path={files[0]}",
                             f"--eval_data_path={files[1]}", *args)


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def test_each_step_trains_on_its_window_batch(built, files):  # R4
  config, *_, run = built
  opened = tokens_lib.open_tokens(files[0])
  for step in (0, 2):
    expected = tokens_lib.read_batch(opened, config.seed, step, 8, 8)
    np.testing.assert_array_equal(run.step_inputs(step), expected)
  start = run.state
  _, from_file = run.built.step(_copy(start), run.weights, run.step_inputs(0))
  _, again = run.built.step(_copy(start), run.weights, run.step_inputs(0))
  _, other = run.built.step(_copy(start), run.weights, run.step_inputs(1))
  # The batch is the only input that differs, and it reaches the loss.
  assert float(from_file["loss/total"]) == float(again["loss/total"])
  assert float(from_file["loss/total"]) != float(other["loss/total"])
  held = run.eval_batches(2)
  assert held.shape == (2, 8, 8)
  eval_file = tokens_lib.open_tokens(files[1])
  for i in range(2):
    np.testing.assert_array_equal(held[i], tokens_lib.read_batch(
      eval_file, config.seed + token_data.EVAL_STREAM, i, 8, 8))


def test_eval_pass_reads_the_given_batches(built):
  _, _, target, _, run = built
  fns = eval_step.make_eval_step(
    target, run.ci_fn, run.terms,
    eval_step.EvalConfig(n_batches=2, total_steps=3), None)
  held = run.eval_batches(2)
  output, batches = fns.fast(run.state, run.weights, jax.random.key(0), held)
  np.testing.assert_array_equal(batches, held)
  assert np.isfinite(np.asarray(output.scalars["recon/ci_masked"])).all()
  with pytest.raises(ValueError, match="pass its batches"):
    fns.fast(run.state, run.weights, jax.random.key(0))


def test_placed_run_reads_batches_onto_the_batch_sharding(built):
  config, toy, target, weights, plain = built
  placement = placement_setup.make_placement(
    placement_setup.PlacementConfig(placement="zero1"), (8, 8))
  placed = assembly.build_run(config, toy, target, weights,
                              placement=placement, data=plain.data)
  batch = placed.step_inputs(0)
  assert batch.sharding == placed.inputs_sharding
  assert len(batch.sharding.device_set) == 8
  _, m_placed = placed.built.step(placed.state, placed.weights, batch)
  _, m_plain = plain.built.step(_copy(plain.state), plain.weights,
                                plain.step_inputs(0))
  np.testing.assert_allclose(float(m_placed["loss/total"]),
                             float(m_plain["loss/total"]), rtol=1e-5)


def test_the_run_names_its_data(lm, files, tmp_path, capsys):
  train.setup(lm(f"--output_dir={tmp_path / 'run'}"))
  line = capsys.readouterr().out
  assert f"[data] {files[0]}" in line and "held_out.bin" in line


@pytest.mark.parametrize("extra,message", [
  (("--seq_len=200",), "fewer than one --seq_len=200"),
  (("--eval_data_path=/nonexistent/x.bin",), "/nonexistent/x"),
])
def test_bad_token_input_fails_before_writing(lm, tmp_path, extra, message):
  out = tmp_path / "run"
  with pytest.raises(ValueError, match=message) as info:
    train.setup(lm(*extra, f"--output_dir={out}"))
  assert "\n" not in str(info.value)
  assert not out.exists()


@pytest.mark.parametrize("flag", ["data_path", "eval_data_path"])
def test_ids_past_the_vocab_fail_before_writing(lm, tmp_path, flag):
  # A header claiming vocab 10 over ids up to 999: trained NaN from step 0.
  forged = tmp_path / "forged.bin"
  tokens_lib.write_tokens(forged, [np.arange(1000)], 1000, 9, "test")
  hpath = tokens_lib.header_path(forged)
  header = json.loads(pathlib.Path(hpath).read_text())
  pathlib.Path(hpath).write_text(json.dumps(header | {"vocab_size": 10}))
  out = tmp_path / "run"
  with pytest.raises(ValueError, match=f"{forged} holds id 999") as info:
    train.setup(lm(f"--{flag}={forged}", f"--output_dir={out}"))
  assert "\n" not in str(info.value)
  assert not out.exists()


def test_token_files_are_refused_where_they_cannot_apply(parse, files,
                                                         tmp_path):
  with pytest.raises(ValueError, match="toys draw their own data"):
    parse("--target=tms_5-2", f"--data_path={files[0]}")
  with pytest.raises(ValueError, match="needs --data_path"):
    parse(f"--flagfile={TINY}", f"--eval_data_path={files[1]}")
  big = tmp_path / "big.bin"
  tokens_lib.write_tokens(big, [np.array([500])], 1000, 999, "test")
  with pytest.raises(ValueError, match="larger than the model's"):
    token_data.open_data(
      parse(f"--flagfile={TINY}", f"--data_path={big}"), VOCAB)


def test_eval_seed_picks_the_held_out_windows(lm, files):
  """Runs differing in --seed but sharing --eval_seed hold out the same
  windows; each still trains on its own."""
  runs = [token_data.open_data(lm(f"--seed={seed}", "--eval_seed=7"), VOCAB)
          for seed in (1, 2)]
  own = token_data.open_data(lm("--seed=1"), VOCAB)
  held = [token_data.eval_batches(data, 2) for data in (*runs, own)]
  np.testing.assert_array_equal(held[0], held[1])
  assert not np.array_equal(held[0], held[2])
  assert not np.array_equal(token_data.train_batch(runs[0], 0),
                            token_data.train_batch(runs[1], 0))
