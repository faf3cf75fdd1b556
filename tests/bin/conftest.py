"""Fixtures shared by the bin tests."""

import math
import os
import pathlib
import queue
import re
import signal
import threading

import jax
import pytest
from absl import flags

from decompax.bin import (figure_worker, placement_setup, render_process,
                          train, train_flags)
from decompax.io import run_dir
from decompax.targets import registry



def _output_lines(process):
  """Yield a process's output lines as they come, failing after 300 s of
  silence (a reader thread, so a hung child fails the test, not the run)."""
  lines: queue.Queue = queue.Queue()

  def pump():
    for line in process.stdout:
      lines.put(line)
    lines.put(None)

  threading.Thread(target=pump, daemon=True).start()
  while (line := lines.get(timeout=300)) is not None:
    yield line


@pytest.fixture(scope="session")
def output_lines():
  """Return `output_lines(process)`: its stdout lines as they come."""
  return _output_lines


@pytest.fixture
def parse():
  """Parse flags into a TrainConfig; restore the defaults after."""

  def _parse(*args):
    flags.FLAGS.unparse_flags()
    argv = flags.FLAGS.read_flags_from_files(list(args), force_gnu=False)
    flags.FLAGS(["train", *argv])
    return train_flags.config_from_flags()

  yield _parse
  flags.FLAGS.unparse_flags()
  flags.FLAGS.mark_as_parsed()


def _launch_in_process(config, placement=None) -> None:
  """Run `config` as one `bin/train` launch does once its flags are read,
  in this process; leave the run directory's lock and the stop signals'
  handlers as the launch's exit would, whatever it raised."""
  handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  prepared = train.setup(config, placement)
  try:
    train.train(prepared)
  finally:
    if prepared.lock is not None:
      os.close(prepared.lock)
    for signum, handler in handlers.items():
      signal.signal(signum, handler)


@pytest.fixture(scope="session")
def launch_in_process():
  """Return `launch(config, placement=None)`: one bin/train launch run in
  this process (no child pays JAX's start-up)."""
  return _launch_in_process


@pytest.fixture(scope="session")
def one_device_placement():
  """Return bin/train's default placement on one device, as a launch of it
  on the CPU has: a run in this process then compiles the launch's program
  (a step without the placement's sharding constraints, or on eight
  devices, may fuse, and round, differently), so it is bitwise a launch's
  and shares its entries of the compilation cache."""
  from decompax.placement import compiler  # noqa: PLC0415
  from decompax.placement import mesh as mesh_lib  # noqa: PLC0415
  from decompax.placement import shardings  # noqa: PLC0415
  config = placement_setup.PlacementConfig()
  mesh = placement_setup.build_mesh(
    mesh_lib.mesh_shape(1, config.replicate, config.fsdp, config.tp),
    jax.devices()[:1])
  return shardings.Placement(mesh, config.table,
                             compiler.options(config.compiler))


@pytest.fixture(scope="module")
def tms_target(tmp_path_factory):
  """An untrained TMS 5-2 saved as a cached target (`--target_path`), for
  tests whose runs do not depend on the weights' values."""
  toy = registry.get("tms_5-2")
  path = tmp_path_factory.mktemp("target") / "target.npz"
  run_dir.save_arrays(str(path),
                      toy.weights_to_arrays(toy.init(jax.random.key(0))),
                      {"target": toy.name, "target_seed": toy.default_seed})
  return path


ROOT = pathlib.Path(__file__).resolve().parents[2]
# Flagfiles that need a downloaded checkpoint and an accelerator (l18), or a
# model that `bin/train_lm` trains here (brown; none is in the repository:
# tests/bin/test_brown_flagfiles.py checks those instead).
NOT_CPU_SIZED = {"l18", "l18_addsub_tpd", "brown_s", "brown_s_chip", "brown_m"}
PNG = b"\x89PNG\r\n\x1a\n"
# Small C and CI widths: compile time grows with them, code paths do not.
# One run: a recipe's restarts (tms_5-2) have their own tests
# (test_restarts.py).
SMOKE_OVERRIDES = (
  "--num_steps=1", "--batch_size=8", "--log_every=1", "--eval_every=1",
  "--slow_eval_every=1", "--eval_batches=2", "--noslow_on_first_step",
  "--save_every=1", "--c=8", "--ci_hidden=4", "--eval_pgd_steps=2",
  "--restarts=1", "--select_at=0")


def cpu_flagfiles() -> list[pathlib.Path]:
  """Return every flagfile a CPU runs in minutes."""
  return [p for p in sorted((ROOT / "flags").glob("*.flags"))
          if p.stem not in NOT_CPU_SIZED]


# The flagfiles whose whole smoke run is in the default suite: one per code
# path (the TMS recipe; the hidden identity with its locality term and
# smooth-L0 minimality; the VPD terms; the residual MLP; the token
# embedding site; the toy transformer's attention sites and the LM eval
# tiers). The others take
# those paths at other sizes or with other settings: their smoke runs are
# slow, and `test_flagfiles_lower.py` still builds and lowers each of their
# steps in the default suite. The tiny Llama checkpoint with the
# transformer CI is launched with the fast eval tier by
# tests/bin/test_lm_train.py; a targeted recipe's short run is
# tests/bin/test_targeted.py's.
# The TMS recipe's own path (stochastic and per-site reconstruction, the
# L_p penalty, the feature probe) is the sum of others': the hidden
# identity's run takes both reconstructions and the probe, the VPD run the
# TMS target itself, and every other run the L_p penalty; its smoke run is
# slow, its step lowered. The fast variants are
# tests/bin/test_eval_smoke.py::test_flagfile_runs_both_eval_tiers_and_saves
# [tms_5-2-id] and [tms_5-2_vpd], and
# tests/bin/test_flagfiles_lower.py::
# test_flagfile_builds_its_run_and_lowers_its_step[tms_5-2].
SMOKE_IN_DEFAULT = frozenset({"tms_5-2-id", "tms_5-2_vpd", "resid_mlp1",
                              "embed_16-8", "induction"})


# The flagfiles that tests/bin/test_family_runs.py runs for a few steps in
# the default suite (test_family_flagfile_decomposes_a_few_steps[<name>]):
# their steps are built, compiled and run there, so lowering them again is
# `slow` (that test checks it keeps this set).
FAMILY_RUNS = frozenset({"tiny_gemma2", "tiny_gemma3", "tiny_gpt2",
                         "tiny_pythia", "tiny_qwen3moe"})


def pytest_generate_tests(metafunc):
  # A smoke module names its share of the flagfiles (SMOKE_GROUP: the TMS
  # ones or the rest), so the suite's workers run the two files side by side.
  if "smoke_flagfile" in metafunc.fixturenames:
    tms = metafunc.module.SMOKE_GROUP == "tms"
    paths = [p for p in cpu_flagfiles() if p.stem.startswith("tms_") == tms]
    params = [p if p.stem in SMOKE_IN_DEFAULT
              else pytest.param(p, marks=pytest.mark.slow) for p in paths]
    metafunc.parametrize("smoke_flagfile", params,
                         ids=[p.stem for p in paths])
  if "slow_smoke_flagfile" in metafunc.fixturenames:
    paths = [p for p in cpu_flagfiles() if p.stem not in SMOKE_IN_DEFAULT]
    params = [pytest.param(p, marks=pytest.mark.slow)
              if p.stem in FAMILY_RUNS else p for p in paths]
    metafunc.parametrize("slow_smoke_flagfile", params,
                         ids=[p.stem for p in paths])


@pytest.fixture
def cpu_flagfile_names() -> set[str]:
  return {p.stem for p in cpu_flagfiles()}


@pytest.fixture
def smoke_in_default() -> frozenset[str]:
  return SMOKE_IN_DEFAULT


@pytest.fixture
def family_runs() -> frozenset[str]:
  return FAMILY_RUNS


def smoke_args(parse, path: pathlib.Path, tmp_path: pathlib.Path,
               warmup_steps: int = 2) -> list[str]:
  """Return the arguments of a smoke-sized run of the flagfile at `path`
  writing under `tmp_path`: tiny sizes, every eval tier due, a faithfulness
  warmup of `warmup_steps` where the flagfile has one, and a toy's target
  untrained (saved under `tmp_path` and loaded as the target cache)."""
  args = [f"--flagfile={path}", *SMOKE_OVERRIDES,
          f"--output_dir={tmp_path / 'run'}"]
  config = parse(*args)
  if config.faithfulness_warmup_steps:
    args.append(f"--faithfulness_warmup_steps={warmup_steps}")
  if config.target_task:
    args += ["--target_batch_size=8", "--nontarget_batch_size=8"]
  if config.target in registry.toy_names():
    # An untrained toy stands in for the trained one: setup loads it from
    # the target cache instead of training for thousands of steps.
    toy = registry.get(config.target)
    cache = tmp_path / "target.npz"
    seed = (toy.default_seed if config.target_seed is None
            else config.target_seed)
    run_dir.save_arrays(
      cache, toy.weights_to_arrays(toy.init(jax.random.key(0))),
      {"target": toy.name, "target_seed": seed})
    args.append(f"--target_path={cache}")
  return args


@pytest.fixture
def smoke_config(parse, tmp_path):
  """Return the parsed config of a flagfile's smoke-sized run (see
  `smoke_args`), with no faithfulness warmup."""
  return lambda path: parse(*smoke_args(parse, path, tmp_path, 0))


@pytest.fixture(scope="module")
def warm_render_process():
  """Hand every run of the module its figures' render process from one
  child, started once: a child's start (Python, matplotlib, JAX) costs
  seconds of each smoke run. It is started here, on the main thread, which
  outlives every run's figure worker (the child's parent-death signal
  follows the thread that started it); a run's close leaves it running."""
  child = render_process.start()
  shared = render_process.RenderProcess(child.run, lambda: None)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(figure_worker, "lazy_render_process", lambda: shared)
    yield
  child.close()


@pytest.fixture
def smoke_run(parse, tmp_path, capsys, warm_render_process):
  """Return a runner of one flagfile through both eval tiers and a save.

  In-process (no JAX start-up per flagfile, one render child per module)
  on an untrained target with a tiny batch: the fast tier alone at step 0 (the fresh-run baseline), one
  training step, both tiers at step 1 with the slow tier's figures and
  report rendered off the loop, and checkpoints.
  """

  def run(path: pathlib.Path) -> None:
    out = tmp_path / "run"
    prepared = train.setup(parse(*smoke_args(parse, path, tmp_path)))
    train.train(prepared)
    check_smoke_run(out, prepared.target, capsys.readouterr().err,
                    "target/" if prepared.config.target_task else "")

  return run


def check_smoke_run(out: pathlib.Path, target, stderr: str,
                    stream: str = "") -> None:
  """Assert a smoke run left every record, figure, page and checkpoint;
  `stream` is the eval prefix of a targeted run's target stream."""
  sites = target.sites
  assert "figure rendering failed" not in stderr
  records = run_dir.read_metrics(out / "metrics.jsonl")
  assert [r["step"] for r in records] == [0, 1]
  slow_key = f"eval/{stream}hidden_acts/ci_masked/{sites[0].name}"
  assert [slow_key in r for r in records] == [False, True]
  for record in records:
    for variant in ("ci_masked", "stochastic", "zero", "random", "pgd"):
      assert record[f"eval/{stream}recon/{variant}"] >= 0.0
    # A plain, finite number each: a NaN or a list would pass json.dumps.
    for key, value in record.items():
      assert type(value) in (int, float) and math.isfinite(value), key
  probed = ("ci_on_features", "components") if target.feature_probe else ()
  for name in ("ci_histograms", "ci_density", "ci_log_density", *probed):
    assert (out / "figures" / f"{name}.png").read_bytes()[:8] == PNG
  page = (out / "report" / "index.html").read_text()
  # A data: URL (the page's empty favicon) names no file.
  refs = re.findall(r'(?:src|href)="(?!data:)([^"]+)"', page)
  assert len(refs) >= 8
  for ref in refs:
    with open(os.path.join(out, "report", ref), "rb") as f:
      # Figures, and a targeted run's A/B grid page.
      assert f.read(8) == PNG or ref.endswith(".html"), ref
  assert list((out / "checkpoints").iterdir())
  # Every file the run wrote is its own to replace: --overwrite finds
  # nothing there that it did not write.
  run_dir.check_run_dir(out, "", overwrite=True)
