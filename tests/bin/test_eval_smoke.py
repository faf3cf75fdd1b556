"""Every flagfile runs through both eval tiers, a step and a save.

In-process (no JAX start-up per flagfile) on untrained targets with a tiny
batch: the fast tier alone at step 0 (the fresh-run baseline), one training
step, both tiers at step 1 with the slow tier's figures and report rendered
on the worker thread, and checkpoints. A failure that only shows at the
first slow eval shows here.
"""

import json
import os
import pathlib
import re

import jax
import pytest

from decompax.bin import train
from decompax.io import run_dir
from decompax.targets import registry

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Flagfiles that need a downloaded checkpoint and an accelerator.
NOT_CPU_SIZED = {"l18"}
# The default suite runs one flagfile per kind of run: a toy with the VPD
# terms (delta, persistent PGD, EMA frequency), a multi-layer toy with the
# paper's terms, a language model with token labels. `-m slow` runs all.
DEFAULT = {"tms_5-2_vpd", "resid_mlp2", "tiny_llama"}
FLAGFILES = [
  pytest.param(p, id=p.stem,
               marks=() if p.stem in DEFAULT else pytest.mark.slow)
  for p in sorted((ROOT / "flags").glob("*.flags"))
  if p.stem not in NOT_CPU_SIZED]
PNG = b"\x89PNG\r\n\x1a\n"
# Small C and CI widths: compile time grows with them, code paths do not.
OVERRIDES = ("--num_steps=1", "--batch_size=8", "--log_every=1",
             "--eval_every=1", "--slow_eval_every=1", "--eval_batches=2",
             "--noslow_on_first_step", "--save_every=1", "--c=8",
             "--ci_hidden=4")


def test_every_cpu_flagfile_has_a_smoke_run():
  assert {p.values[0].stem for p in FLAGFILES} >= DEFAULT


@pytest.mark.parametrize("path", FLAGFILES)
def test_flagfile_runs_both_eval_tiers_and_saves(parse, tmp_path, path,
                                                 capsys):
  out = tmp_path / "run"
  args = [f"--flagfile={path}", *OVERRIDES, f"--output_dir={out}"]
  config = parse(*args)
  if config.faithfulness_warmup_steps:
    args.append("--faithfulness_warmup_steps=2")
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
  config = parse(*args)
  toy, target, weights, output_dir = train.setup(config)
  train.train(config, toy, target, weights, output_dir)
  sites = target.sites
  assert "figure rendering failed" not in capsys.readouterr().err
  records = run_dir.read_metrics(out / "metrics.jsonl")
  assert [r["step"] for r in records] == [0, 1]
  slow_key = f"eval/hidden_acts/ci_masked/{sites[0].name}"
  assert [slow_key in r for r in records] == [False, True]
  for record in records:
    for variant in ("ci_masked", "stochastic", "zero", "random"):
      assert record[f"eval/recon/{variant}"] >= 0.0
  json.dumps(records)  # every value is a plain number
  probed = ("ci_on_features", "components") if target.feature_probe else ()
  for name in ("ci_histograms", "ci_density", "ci_log_density", *probed):
    assert (out / "figures" / f"{name}.png").read_bytes()[:8] == PNG
  page = (out / "report" / "index.html").read_text()
  refs = re.findall(r'(?:src|href)="([^"]+)"', page)
  assert len(refs) >= 8
  for ref in refs:
    with open(os.path.join(out, "report", ref), "rb") as f:
      assert f.read(8) == PNG, ref
  assert list((out / "checkpoints").iterdir())
