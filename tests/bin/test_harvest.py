"""bin/harvest: its flags beside bin/train's in one process, the placement
flags it shares with bin/train, a harvest sharded by them, and a stop
signal that saves it."""

import dataclasses
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from absl import flags

from decompax.analysis import explore, harvest_settings
from decompax.analysis import harvesting as harvest_lib
from decompax.bin import (
  harvest, placement_flags, placement_setup, train, train_flags)
from decompax.io import harvest_store, owned_dir, run_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def parse():
  """Parse bin/harvest arguments into its own flags; reset them after."""

  def _parse(*args):
    harvest.HARVEST_FLAGS.unparse_flags()
    harvest.HARVEST_FLAGS(["harvest", *args])

  yield _parse
  harvest.HARVEST_FLAGS.unparse_flags()


def test_train_and_harvest_flags_share_a_process(parse):
  """Both binaries' flag modules are imported above: each placement flag is
  defined once for each binary, as a flag of that binary's module."""
  for name in placement_flags.NAMES:
    assert flags.FLAGS.find_module_defining_flag(name) == train_flags.__name__
    assert harvest.HARVEST_FLAGS.find_module_defining_flag(
      name) == harvest.__name__
    assert flags.FLAGS[name] is not harvest.HARVEST_FLAGS[name]
  # bin/train still records them in a run's flags.txt.
  assert "--placement=ddp" in train.resolved_flags_text()
  parse("--run_dir=unused", "--replicate=2", "--tp=2", "--placement=zero1",
        "--place=frozen:replicated")
  config = placement_setup.config_from_flags(harvest.HARVEST_FLAGS)
  assert config == placement_setup.PlacementConfig(
    replicate=2, tp=2, placement="zero1", place=("frozen:replicated",))
  assert placement_setup.config_from_flags() == (
    placement_setup.PlacementConfig())


def test_a_batch_that_does_not_split_over_the_mesh_is_refused(parse, capsys):
  # Refused before the run directory is read.
  parse("--run_dir=/nonexistent", "--fsdp=8", "--batch_size=12")
  with pytest.raises(SystemExit) as info:
    harvest.main(["harvest"])
  assert info.value.code == 2
  assert capsys.readouterr().err.splitlines() == [
    "harvest: error: --batch_size: the batch axis of size 12 does not split "
    "over the 8 devices of mesh axes fsdp; choose a size divisible by 8"]


def test_a_harvest_sharded_by_the_flags_equals_the_one_device_harvest(
    finished_run, parse, tmp_path, capsys):
  """A (2, 2, 2) mesh under zero1: the batch of eight split four ways, the
  components' C over tp; counts exact, sums up to their order."""
  run_path = tmp_path / "run"  # the harvest writes inside the run
  # Other tests may have harvested the shared run already: not this one.
  shutil.copytree(finished_run("tms"), run_path,
                  ignore=shutil.ignore_patterns(harvest_store.HARVEST_DIR))
  run = explore.load_run(str(run_path))
  settings = harvest_settings.resolve(run, harvest_settings.Request(
    positions=32, batch_size=8, top_k=5, ablation_batches=1))
  reference = tmp_path / "reference"
  out = str(reference / harvest_store.HARVEST_DIR)
  record = harvest_lib.harvest(run, settings, out, save_every_s=0.0,
                               ablation_chunk=5, say=lambda _: None)
  harvest_lib.write_manifest(out, str(run_path), run, settings, record)
  parse(f"--run_dir={run_path}", "--replicate=2", "--fsdp=2", "--tp=2",
        "--placement=zero1", "--positions=32", "--batch_size=8", "--top_k=5",
        "--ablation_batches=1", "--ablation_chunk=5", "--save_every_s=0")
  harvest.main(["harvest"])
  lines = capsys.readouterr().out.splitlines()
  assert lines[-1] == f"[harvest] wrote {run_path}/harvest/manifest.json"
  assert any(line.startswith("[harvest] batch 4/4") for line in lines)
  sharded = harvest_lib.load_harvest(str(run_path))
  assert sharded.manifest["settings"] == dataclasses.asdict(settings)
  for site, fields in harvest_lib.load_harvest(str(reference)).sites.items():
    for field, want in fields.items():
      got = sharded.sites[site][field]
      if np.issubdtype(want.dtype, np.integer):
        np.testing.assert_array_equal(got, want, f"{site}/{field}")
      else:
        np.testing.assert_allclose(got, want, rtol=1e-5,
                                   err_msg=f"{site}/{field}")


def test_the_binary_lists_the_placement_flags_as_its_own():
  result = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "harvest"), "--helpfull"],
    cwd=ROOT, capture_output=True, text=True, timeout=120,
    env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr
  # The binary's own flags come first, under its name.
  own = result.stdout.split("flags:\n\nharvest:\n")[1].split("\n\n")[0]
  for name in ("run_dir", "batch_size", *placement_flags.NAMES):
    assert f"  --{name}:" in own, name


def test_a_stop_signal_saves_the_harvest_and_exits_for_a_requeue(
    finished_run, tmp_path):
  run_path = tmp_path / "run"
  shutil.copytree(finished_run("tms"), run_path,
                  ignore=shutil.ignore_patterns(harvest_store.HARVEST_DIR))
  out = run_path / harvest_store.HARVEST_DIR
  # 1.25M batches, saved after each: it is mid-harvest when signalled.
  process = subprocess.Popen(
    [sys.executable, "-P", str(ROOT / "bin" / "harvest"),
     f"--run_dir={run_path}", "--positions=10000000", "--batch_size=8",
     "--top_k=5", "--ablation_batches=0", "--save_every_s=0"],
    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"})
  state = out / harvest_store.STATE_FILE
  deadline = time.time() + 240
  while not state.exists():
    assert process.poll() is None and time.time() < deadline
    time.sleep(0.05)
  process.send_signal(signal.SIGINT)
  stdout, stderr = process.communicate(timeout=120)
  assert process.returncode == 75, stdout + stderr
  assert "Traceback" not in stderr, stderr
  said = re.fullmatch(
    r"\[harvest\] stop signal: stopped after batch (\d+) of 1250000, saved;"
    r" exiting with 75, rerun the same command to resume",
    stdout.splitlines()[-1])
  assert said, stdout
  assert sorted(os.listdir(out)) == [run_dir.LOCK_FILE,
                                     owned_dir.MANIFEST_FILE,
                                     harvest_store.STATE_FILE]
  assert harvest_store.STATE_FILE in owned_dir.read_manifest(out)["entries"]
  assert run_dir.load_arrays(state)[1]["done"] == int(said[1])


def test_a_tagged_harvest_adds_the_comparison_to_the_report(
    finished_run, parse, tmp_path, capsys):
  """Over a token file with a tag stream, the run's report gains the
  comparison of components with neurons, and its figure."""
  from decompax.render import tag_report  # noqa: PLC0415
  run_path = tmp_path / "run"
  shutil.copytree(finished_run("text_llama"), run_path,
                  ignore=shutil.ignore_patterns(harvest_store.HARVEST_DIR,
                                                "report"))
  parse(f"--run_dir={run_path}", "--positions=128", "--batch_size=8",
        "--top_k=2", "--ablation_batches=0", "--save_every_s=0")
  harvest.main(["harvest"])
  lines = capsys.readouterr().out.splitlines()
  assert lines[-1] == f"[harvest] wrote {run_path}/report/index.html"
  page = (run_path / "report" / "index.html").read_text()
  assert "Part of speech: components against neurons" in page
  assert (run_path / "report" / tag_report.FIGURE).is_file()


def test_a_stop_signal_in_the_report_leaves_the_harvest_whole(
    finished_run, parse, tmp_path, capsys, monkeypatch):
  """A stop signal once the harvest is written, while the report's
  comparisons run, exits for a requeue at once: the harvest complete, the
  report not rebuilt, the command that rebuilds it named."""
  run_path = tmp_path / "run"
  shutil.copytree(finished_run("text_llama"), run_path,
                  ignore=shutil.ignore_patterns(harvest_store.HARVEST_DIR,
                                                "report"))
  stop = harvest._stop_on_signals()
  monkeypatch.setattr(harvest, "_stop_on_signals", lambda: stop)
  write_manifest = harvest_lib.write_manifest

  def written_then_signalled(*args):
    path = write_manifest(*args)
    os.kill(os.getpid(), signal.SIGTERM)
    return path

  monkeypatch.setattr(harvest_lib, "write_manifest", written_then_signalled)
  parse(f"--run_dir={run_path}", "--positions=128", "--batch_size=8",
        "--top_k=2", "--ablation_batches=0", "--save_every_s=0")
  try:
    with pytest.raises(SystemExit) as exit_:
      harvest.main(["harvest"])
  finally:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
  assert exit_.value.code == 75
  assert capsys.readouterr().out.splitlines()[-1] == (
    f"[harvest] stop signal: the harvest is complete and saved, its report "
    f"not rebuilt; `./dev report --run_dir={run_path}` rebuilds it; "
    f"exiting with 75")
  assert harvest_lib.load_harvest(str(run_path)).manifest["tags"]
  assert not (run_path / "report" / "index.html").exists()
