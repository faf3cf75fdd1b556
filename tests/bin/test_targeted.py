"""bin/train on a targeted decomposition (SPEC §6.6): the two streams'
flags, their refusals, and a short run end to end."""

import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys
from typing import NamedTuple

import numpy as np
import jax
import pytest

from decompax.bin import train, train_flags
from decompax.io import checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[2]
STREAMS = ("--target_task=addsub", "--nontarget_task=copy",
           "--nontarget_recon_coeff=1", "--faithfulness_coeff=0")
# The induction toy's vocabulary holds the arithmetic task's ids, so the
# plumbing runs on a model trained in seconds. Dual-role CI: four passes.
# Two sites of different shapes, one feeding the other (the GLU's gate, of
# up_proj's shape, would add only compile time: each of the file's steps
# and evals compiles in about two thirds of the three sites' time).
TPD = ("--target=induction",
       "--sites=layers.1.mlp.up_proj,layers.1.mlp.down_proj",
       "--c=6", "--ci_fn=vector_mlp", "--ci_hidden=4", "--num_steps=4",
       "--log_every=2", "--eval_every=2", "--slow_eval_every=4",
       "--noslow_on_first_step",
       "--eval_batches=1", "--save_every=2", "--keep_all",
       "--stochastic_coeff=1", "--per_site_coeff=0", "--importance_coeff=1e-3",
       "--use_delta_component=true", "--target_batch_size=8",
       "--nontarget_batch_size=4", "--nontarget_unmasked_coeff=0.1",
       "--nontarget_importance_coeff=1e-4", "--nontarget_merged_coeff=0.5",
       "--ci_scaled_decay=0.1", "--ci_roles=output,hidden", *STREAMS)


@pytest.mark.parametrize("args,message", [
  (("--target=induction", *STREAMS, "--faithfulness_coeff=1"),
   "no faithfulness term"),
  (("--target=induction", *STREAMS, "--faithfulness_warmup_steps=5"),
   "no faithfulness term"),
  (("--target=induction", "--target_task=addsub",
    "--nontarget_recon_coeff=1", "--faithfulness_coeff=0"),
   "the nontarget stream needs exactly one source"),
  (("--target=induction", "--nontarget_recon_coeff=1"),
   "belongs to a targeted decomposition"),
  (("--target=induction", "--ci_scaled_decay=0.1"),
   "belongs to a targeted decomposition"),
  (("--target=induction", *STREAMS[1:], "--target_task=mul"),
   "no built-in task"),
  (("--target=induction", *STREAMS[1:], "--target_data_path=/x.bin"),
   "token-file target stream has no answer positions"),
  (("--target=tms_5-2", *STREAMS[1:], "--target_data_path=/x.bin",
    "--target_loss_positions=all"), "takes none; decompose a language"),
  (("--target=induction", *STREAMS[1:], "--target_data_path=/x.bin",
    "--target_loss_positions=all", "--data_path=/y.bin", "--target=hf"),
   "drop --data_path"),
  (("--target=induction", *STREAMS[:2], "--faithfulness_coeff=0"),
   "needs its reconstruction"),
  (("--target=induction", *STREAMS, "--stochastic_coeff=0",
    "--per_site_coeff=0"), "no reconstruction term: set --stochastic_coeff"),
  (("--target=induction", *STREAMS, "--target_task=copy",
    "--target_loss_positions=all"), "must be other data"),
  (("--target=induction", "--target_task=copy", "--nontarget_task=addsub",
    *STREAMS[2:]), "has no answer positions"),
  (("--target=induction", *STREAMS[1:], "--target_data_path=/x.bin",
    "--target_loss_positions=all", "--ab_grid=on"),
   "a token-file target stream has none; use --target_task=addsub"),
  (("--target=induction", "--ab_grid=on"), "a run without a target stream"),
  (("--target=induction", *STREAMS, "--ci_roles=hidden"),
   "'output' or 'output,hidden'"),
  (("--target=induction", *STREAMS,
    "--hidden_pass_points=layers.1.mlp.down_proj.out"),
   "add --ci_roles=output,hidden"),
])
def test_bad_targeted_settings_are_refused_by_the_flags(parse, args,
                                                        message):
  with pytest.raises(ValueError, match=message):
    parse(*args)


def test_a_toy_without_token_inputs_is_refused_before_writing(parse,
                                                              tmp_path):
  out = tmp_path / "run"
  config = parse("--target=tms_5-2", *STREAMS, f"--output_dir={out}")
  with pytest.raises(ValueError, match="takes no token ids"):
    train.setup(config)
  assert not out.exists()


def test_a_hidden_point_masking_cannot_reach_is_refused_before_writing(
    parse, finished_run, tmp_path):
  out = tmp_path / "run"
  target_path = os.path.join(finished_run("induction"), "target.npz")
  config = parse(*TPD, f"--target_path={target_path}", f"--output_dir={out}",
                 "--hidden_pass_points=layers.0.mlp.down_proj.out")
  with pytest.raises(ValueError, match="cannot reach 'layers.0.mlp.down"):
    train.setup(config)
  assert not out.exists()


def _train(output_dir, target_path, *extra):
  done = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "train"), *TPD,
     f"--output_dir={output_dir}", f"--target_path={target_path}", *extra],
    cwd=ROOT, capture_output=True, text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return done.stdout


def _records(output_dir):
  with open(os.path.join(output_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _train_in_process(launch, output_dir, target_path, placement) -> str:
  """Run `TPD` into `output_dir` as `bin/train`'s `main` runs it once its
  flags are parsed, in this process on one device (the launch's own
  `placement`); return what it printed. No child process pays JAX's
  start-up, and its step is the program the module's in-process step
  compiles, read from the shared cache."""
  config = train_flags.parse_config(*TPD, f"--output_dir={output_dir}",
                                    f"--target_path={target_path}")
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    launch(config, placement)
  return printed.getvalue()


@pytest.fixture(scope="module")
def straight(finished_run, tmp_path_factory, one_device_placement,
             launch_in_process):
  target_path = os.path.join(finished_run("induction"), "target.npz")
  out = tmp_path_factory.mktemp("tpd") / "straight"
  stdout = _train_in_process(launch_in_process, out, target_path,
                             one_device_placement)
  return out, target_path, stdout


def test_a_targeted_run_logs_every_stream_under_its_name(straight):
  out, _, stdout = straight
  last = [r for r in _records(out) if "loss/total" in r][-1]
  for key in ("target/loss/stochastic_recon",
              "target/loss/importance_minimality", "nontarget/loss/recon",
              "nontarget/loss/unmasked_recon",
              "nontarget/loss/importance_minimality",
              "nontarget/loss/merged_recon",
              "target/ci_l0/layers.1.mlp.up_proj",
              "nontarget/ci_l0/layers.1.mlp.up_proj",
              # The hidden passes: each stream's terms on the hidden role.
              "target/loss/stochastic_recon_hidden",
              "nontarget/loss/merged_recon_hidden",
              "nontarget/ci_l0_hidden/layers.1.mlp.up_proj"):
    assert key in last, key
  evals = [r for r in _records(out) if "eval/target/recon/ci_masked" in r]
  assert evals and "eval/nontarget/recon/ci_masked" in evals[-1]
  assert "eval/task/answer_accuracy/ablated" in evals[-1]
  assert "eval/nontarget/ci_l0_hidden/layers.1.mlp.up_proj" in evals[-1]
  assert "eval/target/loss/stochastic_recon_hidden" in evals[-1]
  assert "target: " in stdout and "nontarget: " in stdout
  assert "[eval nontarget]" in stdout and "[eval task]" in stdout
  report = (out / "report" / "index.html").read_text()
  assert "nontarget stream" in report and "ab_grid.html" in report
  assert (out / "report" / "ab_grid_data.js").is_file()


@pytest.mark.slow
def test_a_targeted_run_resumes_bitwise(straight, tmp_path):
  """I36 for a targeted run: stopped at step 2 and continued, it ends
  with the straight run's numbers and decomposition."""
  out, target_path, _ = straight
  split = tmp_path / "split"
  _train(split, target_path, "--stop_after_step=2")
  assert checkpoint.committed_steps(str(split / "checkpoints"))[-1] == 2
  _train(split, target_path)

  def losses(path):
    return {r["step"]: {k: v for k, v in r.items() if "loss/" in k}
            for r in _records(path)}

  assert losses(split) == losses(out)
  a = dict(np.load(split / "decomposition.npz"))
  b = dict(np.load(out / "decomposition.npz"))
  assert a.keys() == b.keys()
  for key in a:
    assert (a[key] == b[key]).all(), key


def test_a_token_file_stream_feeds_the_step_beside_a_task(
    parse, finished_run, tmp_path):
  from decompax.io import tokens  # noqa: PLC0415
  from decompax.recipe import assembly, streams  # noqa: PLC0415
  rng = np.random.default_rng(0)
  path = tmp_path / "other.bin"
  tokens.write_tokens(str(path), [rng.integers(0, 31, 40) for _ in range(30)],
                      32, 31, "test")
  target_path = os.path.join(finished_run("induction"), "target.npz")
  # The output role alone: the hidden passes read the same batches, and
  # would double the step this test compiles for itself.
  config = parse(*TPD, "--ci_roles=output", "--nontarget_task=",
                 f"--nontarget_data_path={path}",
                 "--nontarget_seq_len=12", f"--target_path={target_path}",
                 f"--output_dir={tmp_path / 'run'}")
  prepared = train.setup(config)
  run = assembly.start(prepared.plan, prepared.weights)
  batches = run.step_inputs(3)
  assert batches["nontarget"].shape == (4, 12)
  assert batches["target"].shape == (8, 5)
  # The task stream's draw is the one the in-step sampler makes.
  want = streams.sampler(config)(jax.random.fold_in(run.data_key, 3))
  np.testing.assert_array_equal(batches["target"], want["target"])
  held_out = run.stream_eval_batches("nontarget", 2)
  assert held_out.shape == (2, 4, 12)
  assert run.stream_eval_batches("target", 2) is None
  state, metrics = run.built.step(run.state, run.weights, batches)
  assert np.isfinite(float(metrics["nontarget/loss/recon"]))


class CompiledTPD(NamedTuple):
  """The TPD recipe's run, started in-process, and its step compiled as
  `bin/train` compiles it, with the launch's compile options."""
  plan: object
  run: object
  compiled: object


@pytest.fixture(scope="module")
def compiled_tpd(finished_run, tmp_path_factory, one_device_placement):
  """One compile of the TPD step for the tests that step it in-process
  (they do not write the run's directory)."""
  from decompax.recipe import assembly  # noqa: PLC0415
  target_path = os.path.join(finished_run("induction"), "target.npz")
  config = train_flags.parse_config(
    *TPD, f"--target_path={target_path}",
    f"--output_dir={tmp_path_factory.mktemp('tpd_step') / 'run'}")
  placement = one_device_placement
  prepared = train.setup(config, placement)
  run = assembly.start(prepared.plan, prepared.weights)
  return CompiledTPD(prepared.plan, run,
                     train.compile_step(run, 0, placement))


def test_a_targeted_run_restored_at_step_2_steps_to_its_saved_step_4(
    straight, compiled_tpd, tmp_path):
  """The fast variant of the resume test: the straight run's step-2
  checkpoint, restored in-process and stepped twice, is its step-4
  checkpoint bit for bit (every term state included)."""
  import shutil  # noqa: PLC0415
  from decompax.io import resume  # noqa: PLC0415
  out, _, _ = straight
  early = tmp_path / "early"
  early.mkdir()
  shutil.copytree(out / "checkpoints" / checkpoint.step_name(2),
                  early / checkpoint.step_name(2))
  run, compiled = compiled_tpd.run, compiled_tpd.compiled
  parts = compiled_tpd.plan.parts
  args = (parts.target.sites, parts.ci_config, parts.term_names)
  step, state = resume.restore_state(str(early), run.state, *args,
                                     report=lambda line: None)
  assert step == 2
  for done in (2, 3):
    state, _ = compiled(state, run.weights, run.step_inputs(done))
  saved_dir = tmp_path / "late"
  saved_dir.mkdir()
  shutil.copytree(out / "checkpoints" / checkpoint.step_name(4),
                  saved_dir / checkpoint.step_name(4))
  _, saved = resume.restore_state(str(saved_dir), run.state, *args,
                                  report=lambda line: None)
  # Each pass's adversary keeps its own sources.
  assert set(saved.term_states) == {"nontarget_merged_recon",
                                    "nontarget_merged_recon_hidden"}
  for got, want in zip(jax.tree.leaves(jax.device_get(state)),
                       jax.tree.leaves(jax.device_get(saved))):
    if hasattr(got, "dtype") and jax.dtypes.issubdtype(
        got.dtype, jax.dtypes.prng_key):
      got, want = jax.random.key_data(got), jax.random.key_data(want)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_assembled_run_pins_delta_on_the_nontarget_stream_alone(
    compiled_tpd):
  """I45 through the built step: with every component zero a masked
  forward is `δ·W`, so a stream whose δ is pinned at 1 reproduces the clean
  forward under any mask and its recon terms are exactly zero, while the
  target stream's stochastic δ leaves a loss."""
  run, compiled = compiled_tpd.run, compiled_tpd.compiled
  # A copy: the step donates its state, and the run's is the template the
  # module's other tests restore into.
  state = jax.tree.map(lambda x: x.copy(), run.state)._replace(
    components=jax.tree.map(jax.numpy.zeros_like, run.state.components))
  _, metrics = compiled(state, run.weights, run.step_inputs(0))
  metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
  pinned = ("nontarget/loss/recon", "nontarget/loss/merged_recon",
            "nontarget/loss/recon_hidden", "nontarget/loss/merged_recon_hidden")
  for key in pinned:
    assert metrics[key] == 0.0, (key, metrics[key])
  for key in ("target/loss/stochastic_recon",
              "target/loss/stochastic_recon_hidden"):
    assert metrics[key] > 1e-4, (key, metrics[key])
  # The unmasked variant runs δ ≡ 0: nothing of W is left.
  assert metrics["nontarget/loss/unmasked_recon"] > 1e-4
