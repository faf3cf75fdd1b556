"""The Brown decomposition recipes (`flags/brown_s.flags`,
`flags/brown_m.flags`) against the models `bin/train_lm` makes.

The trained models and the corpus are not in the repository, so these
checks stand a random model of each preset's shape in for the trained one:
the flagfiles' sites, sizes and data paths must fit the preset they name,
and brown_s's step must build and lower at smoke size. The real pipeline
runs in the `slow` test at the end when `data/brown` exists.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from decompax.bin import train
from decompax.io import hf_checkpoint, tokens
from decompax.recipe import assembly
from decompax.targets import glu_arrays, text_lm

ROOT = pathlib.Path(__file__).resolve().parents[2]
FLAGFILES = {"brown_s": "brown-s", "brown_s_chip": "brown-s",
             "brown_m": "brown-m"}
BROWN_S_SITES = [f"layers.{i}.mlp.{p}_proj" for i in range(4)
                 for p in ("gate", "up", "down")]


def _flagfile(name: str) -> pathlib.Path:
  return ROOT / "flags" / f"{name}.flags"


def _flag_values(name: str) -> dict[str, str]:
  values = {}
  for line in _flagfile(name).read_text().splitlines():
    if line.startswith("--"):
      key, _, value = line[2:].partition("=")
      values[key] = value
  return values


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
  """Return per preset a directory holding only its `config.json`."""
  dirs = {}
  for preset in FLAGFILES.values():
    path = tmp_path_factory.mktemp(preset)
    glu = text_lm.model_config(text_lm.PRESETS[preset])
    hf_checkpoint._write_json(str(path / "config.json"),
                              hf_checkpoint.llama_config(glu))
    dirs[preset] = path
  return dirs


@pytest.mark.parametrize("name", sorted(FLAGFILES))
def test_flagfile_names_its_preset_model_and_data(name):
  preset = text_lm.PRESETS[FLAGFILES[name]]
  values = _flag_values(name)
  data = f"data/brown/bpe-{preset.vocab_size}"
  assert values["model_dir"] == f"models/{preset.name}"
  assert values["data_path"] == f"{data}/train.bin"
  assert values["eval_data_path"] == f"{data}/held_out.bin"
  # The model never saw a longer context than its training windows.
  assert int(values["seq_len"]) <= preset.seq_len


@pytest.mark.parametrize("name,sites", [
  ("brown_s", BROWN_S_SITES),
  ("brown_s_chip", BROWN_S_SITES),
  ("brown_m", [f"layers.{i}.{p}_proj" for i in range(8)
               for p in ("self_attn.q", "self_attn.k", "self_attn.v",
                         "self_attn.o", "mlp.gate", "mlp.up", "mlp.down")]),
])
def test_flagfile_decomposes_the_sites_the_recipe_names(parse, config_dirs,
                                                        name, sites):
  config = parse(f"--flagfile={_flagfile(name)}",
                 f"--model_dir={config_dirs[FLAGFILES[name]]}")
  toy, target, _ = assembly.resolve_target(config)
  assert [s.name for s in target.sites] == sites
  parts = assembly.parts(config, toy, target)
  # The LM recipe of the design: transformer CI, persistent PGD and
  # stochastic reconstruction, the faithfulness warmup before them.
  assert parts.ci_config.kind == "transformer"
  assert {"faithfulness", "importance_minimality", "stochastic_recon",
          "persistent_pgd_recon"} <= set(parts.term_names)
  assert config.faithfulness_warmup_steps > 0
  assert config.checkpointing == "periodic"
  assert config.num_steps % config.save_every == 0


def test_the_chip_recipe_changes_only_what_its_sweep_chose():
  """docs/brown.md's sweep chose length and importance; the rest is
  brown_s's recipe, so the CPU and chip runs stay comparable."""
  cpu, chip = _flag_values("brown_s"), _flag_values("brown_s_chip")
  changed = {k for k in cpu.keys() | chip.keys() if cpu.get(k) != chip.get(k)}
  assert changed == {"num_steps", "importance_coeff", "log_every",
                     "eval_every", "slow_eval_every", "eval_batches",
                     "save_every",
                     "noslow_on_first_step"}
  assert float(chip["importance_coeff"]) == 5 * float(cpu["importance_coeff"])


@pytest.fixture(scope="module")
def brown_s_stand_in(tmp_path_factory):
  """Return a random `brown-s`-shaped checkpoint and token files of its
  vocab: what `bin/train_lm` and `./dev data brown` would leave."""
  root = tmp_path_factory.mktemp("brown_s")
  preset = text_lm.PRESETS["brown-s"]
  weights = text_lm.init(jax.random.key(0), preset)
  hf_checkpoint.write_llama_checkpoint(
    str(root / "model"), glu_arrays.weights_to_arrays(weights),
    text_lm.model_config(preset), {"eos_token_id": 0})
  rng = np.random.default_rng(0)
  for split in ("train", "held_out"):
    docs = [rng.integers(1, preset.vocab_size, 3000) for _ in range(3)]
    tokens.write_tokens(root / f"{split}.bin", docs, preset.vocab_size, 0,
                        "random")
  return root


def test_brown_s_step_builds_and_lowers_at_smoke_size(parse, tmp_path,
                                                      brown_s_stand_in):
  root = brown_s_stand_in
  config = parse(
    f"--flagfile={_flagfile('brown_s')}", f"--model_dir={root / 'model'}",
    f"--data_path={root / 'train.bin'}",
    f"--eval_data_path={root / 'held_out.bin'}", "--c=8", "--batch_size=2",
    "--ci_d_model=16", "--ci_d_mlp=16", "--num_steps=1", "--log_every=1",
    "--eval_every=1", "--slow_eval_every=1", "--save_every=1",
    "--faithfulness_warmup_steps=0", f"--output_dir={tmp_path / 'run'}")
  prepared = train.setup(config)
  run = assembly.start(prepared.plan, prepared.weights)
  lowered = run.built.step.lower(run.state, run.weights, run.step_inputs(0))
  assert "func.func public @main" in lowered.as_text()


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "data" / "brown" / "bpe-4096").is_dir(),
                    reason="needs the corpus: ./dev data brown")
def test_brown_s_pipeline_runs_end_to_end_on_the_corpus(tmp_path):
  """The CPU pipeline on the real corpus, every stage shortened: train_lm,
  then brown_s's decomposition, then the harvest of the held-out split."""
  model, run = tmp_path / "brown-s", tmp_path / "run"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}

  def binary(name, *args):
    done = subprocess.run([sys.executable, "-P", str(ROOT / "bin" / name),
                           *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    return done

  binary("train_lm", "--preset=brown-s", "--num_steps=20",
         f"--output_dir={model}", "--max_eval_windows=16")
  binary("train", f"--flagfile={_flagfile('brown_s')}",
         f"--model_dir={model}", f"--output_dir={run}", "--num_steps=20",
         "--faithfulness_warmup_steps=10", "--eval_every=10",
         "--slow_eval_every=20", "--save_every=10", "--log_every=10")
  binary("harvest", f"--run_dir={run}", "--positions=4096",
         "--data_path=data/brown/bpe-4096/held_out.bin")
  manifest = json.loads((run / "harvest" / "manifest.json").read_text())
  assert manifest["tags"]
