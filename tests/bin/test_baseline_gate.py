"""The step-0 slow-eval gate of `bin/train` (SPEC §11, I44), end to end.

`train.train` itself runs, in-process, on an untrained TMS 5-2 at toy size
(C = 8, batch 8, four steps; logs every step, fast evals every 2, slow every
4): its `first == 0` gate, `evaluation.log_baseline`, the evaluator's tier
choice and the checkpoint session's metrics truncation are the real ones.
A launch is "killed" by an exception, raised from the loop's profiler hook
before a given step or from inside the baseline before its record is
written, leaving on disk what a SIGKILL there would. Off the path of I44 and
stubbed for speed: the slow tier's figure rendering (`evaluation.NO_RENDERER`)
and the final decomposition and report; the launches share compiled programs
through a persistent compilation cache (~15 s of CPU for the file).
"""

import pathlib
import signal
import types

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from decompax.bin import checkpointing, figure_worker, run_records, train
from decompax.bin import train_flags
from decompax.recipe import evaluation
from decompax.io import checkpoint, run_dir
from decompax.targets import registry

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 4
ARGS = (
  f"--flagfile={ROOT / 'flags' / 'tms_5-2.flags'}", "--c=8", "--ci_hidden=4",
  "--batch_size=8", f"--num_steps={STEPS}", "--log_every=1",
  "--eval_every=2", "--slow_eval_every=4", "--eval_batches=1",
  "--eval_pgd_steps=0", "--per_site_coeff=0", "--save_every=2", "--keep_all",
  "--restarts=1", "--select_at=0")
# Written by the slow tier alone (hidden-activation recon, SPEC §5.9).
SLOW_KEY = "eval/hidden_acts/ci_masked/all"
FAST_KEY = "eval/recon/ci_masked"


class Killed(Exception):
  """Stands in for a SIGKILL between two steps."""


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  """Share compiled programs between the launches (each builds its own
  jitted closures): JAX's persistent cache, for this module only."""
  names = ("jax_compilation_cache_dir",
           "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  before = {name: getattr(jax.config, name) for name in names}
  jax.config.update(names[0], str(tmp_path_factory.mktemp("xla_cache")))
  jax.config.update(names[1], 0.0)
  jax.config.update(names[2], 0)
  compilation_cache.reset_cache()
  yield
  for name, value in before.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()


@pytest.fixture
def launch(monkeypatch, tmp_path, compile_cache):
  """Return a launcher: `run(config, kill=None)` is one launch of
  `train.train` on `config`'s run directory and returns its metrics records
  after; `kill` is a 0-based step the launch dies before, or "baseline"
  (it dies once the step-0 eval has run, before its record is written,
  which `baseline` then holds). `config_of(*args)` parses the run's flags."""
  monkeypatch.setattr(figure_worker, "renderer",
                      lambda *args: evaluation.NO_RENDERER)
  monkeypatch.setattr(train, "finish", lambda *args: None)
  monkeypatch.setattr(evaluation, "write_final_report", lambda *args: None)
  launcher = types.SimpleNamespace(kill=None, baseline=None)
  profile, log_baseline = (run_records.profile_before_step,
                           evaluation.log_baseline)

  def before_step(config, output_dir, index):
    if index == launcher.kill:
      raise Killed
    profile(config, output_dir, index)

  def baseline(evaluator, state, metrics_path):
    if launcher.kill == "baseline":
      launcher.baseline = evaluator.evaluate(state, 0)
      raise Killed
    log_baseline(evaluator, state, metrics_path)

  monkeypatch.setattr(run_records, "profile_before_step", before_step)
  monkeypatch.setattr(evaluation, "log_baseline", baseline)
  handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  toy = registry.get("tms_5-2")
  cache = tmp_path / "target.npz"
  run_dir.save_arrays(cache, toy.weights_to_arrays(toy.init(jax.random.key(0))),
                      {"target": toy.name, "target_seed": toy.default_seed})
  prepared = {}

  def run(config, kill=None):
    if config.output_dir not in prepared:  # setup locks the dir for good
      prepared[config.output_dir] = train.setup(config)
    output_dir = prepared[config.output_dir].output_dir
    launcher.kill = kill
    try:
      train.train(prepared[config.output_dir])
    except Killed:
      for s, handler in handlers.items():  # the dead session's stay set
        signal.signal(s, handler)
    else:
      assert kill is None, "the launch ended before its kill"
    return run_dir.read_metrics(pathlib.Path(output_dir) /
                                run_dir.METRICS_FILE)

  def config_of(*args):
    return train_flags.parse_config(
      *ARGS, *args, f"--target_path={cache}",
      f"--output_dir={tmp_path / 'run'}")

  launcher.run, launcher.config_of = run, config_of
  return launcher


def _steps(records):
  return [r["step"] for r in records]


def _tiers(records):
  """Return the steps that ran the fast tier and those that ran the slow."""
  return ([r["step"] for r in records if FAST_KEY in r],
          [r["step"] for r in records if SLOW_KEY in r])


@pytest.mark.parametrize("slow_on_first_step,killed", [
  (True, "after its baseline record"), (False, "inside its baseline")])
def test_step_zero_is_logged_once_and_slow_only_with_the_flag(
    launch, slow_on_first_step, killed):
  """A fresh run killed right after its label-0 save, once with its
  baseline record written and once while taking it, resumes from label 0:
  one step-0 record, slow iff `slow_on_first_step` (an old record is
  dropped and the baseline taken again). Killed once more after label 2,
  the next resume takes no baseline. Over the run the tiers nest: fast at
  0, 2, 4; slow at 4 and, with the flag, at 0."""
  run = launch.run
  config = launch.config_of(
    "--" + ("" if slow_on_first_step else "no") + "slow_on_first_step")
  first = [0] if slow_on_first_step else []
  ckpts = checkpointing.checkpoint_dir(config.output_dir)
  metrics = pathlib.Path(config.output_dir) / run_dir.METRICS_FILE

  if killed == "inside its baseline":  # fresh: label 0, then the baseline
    assert run(config, kill="baseline") == []
    assert _tiers([{"step": 0, **launch.baseline}]) == ([0], first)
  else:
    records = run(config, kill=0)
    assert _steps(records) == [0]
    assert _tiers(records) == ([0], first)
    # Marked, so that a kept old baseline is told from a new one.
    metrics.unlink()
    run_dir.append_metrics(metrics, {**records[0], "killed_launch": 1})
  assert checkpoint.committed_steps(ckpts) == [0]

  records = run(config, kill=3)  # resumed from label 0
  assert checkpoint.committed_steps(ckpts) == [0, 2]
  assert _steps(records) == [0, 1, 2, 3]  # logged past its last save
  assert "killed_launch" not in records[0]
  assert _tiers(records) == ([0, 2], first)

  records = run(config)  # resumed from label 2: no baseline
  assert _steps(records) == [0, 1, 2, 3, 4]
  assert _tiers(records) == ([0, 2, 4], first + [4])


def test_cadences_that_do_not_nest_are_refused_at_startup():
  train_flags.parse_config(*ARGS)
  for bad, message in (("--eval_every=3", "--eval_every=3 must be a "
                        "multiple of --log_every=2"),
                       ("--slow_eval_every=3", "--slow_eval_every=3 must be a "
                        "multiple of --eval_every=2")):
    with pytest.raises(ValueError, match=message):
      train_flags.parse_config(*ARGS, "--log_every=2", bad)
