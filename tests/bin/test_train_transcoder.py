"""bin/train_transcoder end to end on the harvested text run: k matched to
the harvest's CI-L0, the transcoders and results written into a claimed
directory, judged on the harvest's positions; other settings refused."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from decompax.analysis import harvesting
from decompax.io import owned_dir
from decompax.io import transcoder_store as store

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARGS = ("--num_steps=3", "--batch_size=4", "--seq_len=8",
        "--log_every_steps=2", "--decomposition_ce=false")


def _run(run: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "train_transcoder"),
     f"--run_dir={run}", *args], cwd=ROOT, capture_output=True, text=True,
    timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.fixture(scope="module")
def trained(harvested, tmp_path_factory):
  source = harvested("text_llama", positions=2 * 8 * 16, batch_size=8,
                     top_k=4, ablation_batches=1)
  run = tmp_path_factory.mktemp("transcoder") / "run"
  shutil.copytree(source, run)
  done = _run(str(run), *ARGS)
  assert done.returncode == 0, done.stderr[-3000:]
  return str(run), done


def test_k_is_the_harvest_s_ci_l0_and_results_are_written(trained):
  run, done = trained
  out = os.path.join(run, "transcoder")
  with open(os.path.join(out, store.RESULTS)) as f:
    record = json.load(f)
  found = harvesting.load_harvest(run)
  l0 = sum(found.sites[f"layers.1.mlp.{r}_proj"]["fired"].sum()
           for r in ("gate", "up", "down")) / found.manifest["positions"]
  layer = record["layers"]["1"]
  assert layer["k"] == max(1, round(l0))
  assert layer["ci_l0"] == pytest.approx(l0)
  assert 0 < layer["latent_l0"] <= layer["k"]
  assert record["positions"] == found.manifest["positions"]
  assert record["positions_of_harvest"] and record["ci_l0_source"] == (
    "harvest")
  assert record["ce"]["ci_masked"] is None
  assert set(layer["purity"]) >= {"latents", "components", "neurons"}
  arrays, meta = store.read_transcoders(out)
  assert arrays[1]["w_enc"].shape == (32, 24)  # d_model, 3 sites × C 8
  assert meta["train"]["ks"] == [layer["k"]]
  assert set(owned_dir.read_manifest(out)["entries"]) == set(store.ENTRIES)
  assert "[transcoder] step 2/3" in done.stdout
  assert "| layer | k | CI-L0 |" in done.stdout
  assert os.path.isfile(os.path.join(out, store.TABLE))


def test_other_settings_are_refused_without_overwrite(trained):
  run, _ = trained
  done = _run(run, *ARGS[1:], "--num_steps=4")
  lines = [line for line in done.stderr.splitlines()
           if line.startswith("train_transcoder: error: ")]
  assert done.returncode == 2 and len(lines) == 1, done.stderr
  assert "train.num_steps was 3, now 4" in lines[0]
  assert "--overwrite" in lines[0]
