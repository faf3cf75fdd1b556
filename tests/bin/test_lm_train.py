"""bin/train on checkpoint language models (`--target=hf`)."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from decompax.bin import train
from decompax.recipe import assembly
from decompax.recipe import lm as lm_lib
from decompax.io import run_dir, tokens

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "flags" / "tiny_llama.flags"
L18 = ROOT / "flags" / "l18.flags"
LLAMA_8B_CONFIG = ROOT / "tests" / "fixtures" / "hf_configs" / "llama-3.1-8b"


def test_tiny_llama_flagfile_resolves(parse, monkeypatch):
  monkeypatch.chdir(ROOT)  # the flagfile's --model_dir is repo-relative
  config = parse(f"--flagfile={TINY}")
  toy, target, load = assembly.resolve_target(config)
  assert toy.name == "tiny_llama" and load is not None
  assert [s.name for s in target.sites] == [f"layers.1.mlp.{r}_proj"
                                     for r in ("gate", "up", "down")]
  assert target.start_taps == ("resid.1",)
  lead = lm_lib.lead_shape(target, toy.sample_inputs, config.batch_size)
  assert lead == (config.batch_size, config.seq_len)


def test_l18_flagfile_validates_against_the_8b_config(parse):
  # The 8B weights are not here; its config.json is, and that is all the
  # site table, the function table and the loss terms need.
  config = parse(f"--flagfile={L18}", f"--model_dir={LLAMA_8B_CONFIG}")
  toy, target, _ = assembly.resolve_target(config)
  sites = target.sites
  assert [(s.name, s.kind, s.row, s.d_in, s.d_out, s.c) for s in sites] == [
    ("layers.18.mlp.gate_proj", "gate_proj", 0, 4096, 14336, 24576),
    ("layers.18.mlp.up_proj", "up_proj", 0, 4096, 14336, 24576),
    ("layers.18.mlp.down_proj", "down_proj", 0, 14336, 4096, 24576)]
  assert target.start_taps == ("resid.18",)
  parts = assembly.parts(config, toy, target)
  assert parts.lead_shape == (512, 2048)
  assert parts.term_names == (
    "faithfulness", "importance_minimality", "frequency_minimality",
    "stochastic_recon", "persistent_pgd_recon")
  assert config.compute_dtype == "bfloat16"
  assert parts.step_config.compute_dtype == "bfloat16"  # N4
  # The reference CI (SPEC §4.3): one chunk reading resid.18, three outputs.
  ci = parts.ci_config
  assert ci.kind == "transformer"
  assert [(c.input_taps, c.output_sites) for c in ci.transformer.chunks] == [
    (("resid.18",), tuple(s.name for s in sites))]
  assert ci.transformer.tap_widths == (("resid.18", 4096),)
  assert (ci.transformer.d_model, ci.transformer.n_blocks,
          ci.transformer.n_heads, ci.transformer.d_mlp) == (4096, 4, 64, 16384)
  assert parts.ci_fn.input_taps == ("resid.18",)


@pytest.mark.parametrize("args,message", [
  (("--target=hf",), "needs --model_dir"),
  (("--target=hf", "--model_dir=/nonexistent"), "holds no config.json"),
  (("--target=hf", f"--model_dir={LLAMA_8B_CONFIG}",
    "--sites=layers.40.mlp.*"), "matches no site"),
  (("--target=hf", f"--model_dir={LLAMA_8B_CONFIG}", "--seq_len=200000"),
   "exceeds the model's max_position_embeddings"),
])
def test_bad_lm_settings_fail_before_writing(parse, tmp_path, args, message):
  out = tmp_path / "run"
  with pytest.raises(ValueError, match=message):
    train.setup(parse(*args, f"--output_dir={out}"))
  assert not out.exists()


def test_site_patterns_expand_in_model_order():
  names = ("layers.0.mlp.up_proj", "layers.1.self_attn.q_proj",
           "layers.1.mlp.up_proj")
  assert lm_lib.expand_sites(names, ("layers.1.*", "layers.0.mlp.up_proj")
                               ) == names


def test_tiny_llama_decomposes_end_to_end(tmp_path):
  out = tmp_path / "run"
  data = tmp_path / "corpus.bin"
  rng = np.random.default_rng(0)
  tokens.write_tokens(data, [rng.integers(0, 127, 50) for _ in range(20)],
                      128, 127, "test")
  result = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "train"), f"--flagfile={TINY}",
     # Small widths and the fast eval tier: the slow tier's LM figures run
     # in the induction smoke test, and the flagfile's own smoke run is slow
     # (tests/bin/test_eval_smoke_models.py).
     "--num_steps=4", "--log_every=2", "--eval_every=4",
     "--slow_eval_every=0", "--faithfulness_warmup_steps=2", "--c=8",
     "--ci_d_model=8", "--ci_d_mlp=16",
     f"--data_path={data}", f"--output_dir={out}"],
    cwd=ROOT, capture_output=True, text=True, timeout=600,
    env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr[-3000:]
  records = run_dir.read_metrics(out / "metrics.jsonl")
  steps = [r["step"] for r in records if "loss/total" in r]
  assert steps == [2, 4]
  assert all(json.dumps(r) for r in records)
  assert (out / "decomposition.npz").is_file()
  assert "PyTorch was not found" not in result.stderr
  assert f"[data] {data}: 1,020 tokens, 20 documents" in result.stdout


def test_tiny_llama_vpd_run_resumes_bitwise(parse, monkeypatch, tmp_path,
                                            assert_bitwise_equal):
  """I36 on the GLU transformer target with the transformer CI, persistent
  PGD over positions and EMA frequency minimality: 4 straight steps equal
  2 steps, save, restore onto a fresh state, 2 steps."""
  import jax
  import jax.numpy as jnp

  from decompax.io import checkpoint

  monkeypatch.chdir(ROOT)
  config = parse(
    f"--flagfile={TINY}", "--num_steps=4", "--batch_size=2", "--seq_len=8",
    "--faithfulness_warmup_steps=0", "--pgd_coeff=0.5", "--pgd_scope=sc",
    "--pgd_n_warmup=1", "--frequency_coeff=1e-3", "--ema_halflife_steps=4",
    "--components_optimizer=muon")
  toy, target, load = assembly.resolve_target(config)
  weights = load()

  run = assembly.build_run(config, toy, target, weights)
  # One run built, one step compiled for both halves: the second half and
  # the restore's template start from copies of the fresh state (the step
  # donates its input), as a rebuilt run's would be.
  step = run.built.step
  fresh = [jax.tree.map(jnp.copy, run.state) for _ in range(2)]
  state, metrics = run.state, []
  for _ in range(4):
    state, m = step(state, run.weights, run.data_key)
    metrics.append(jax.device_get(m))
  straight = state

  state = fresh[0]
  for _ in range(2):
    state, _ = step(state, run.weights, run.data_key)
  path = checkpoint.save(tmp_path, 2, checkpoint.split_state(state))
  template = fresh[1]
  items = checkpoint.split_state(template)
  state = checkpoint.join_state(template, {
    name: checkpoint.restore_item(path, name, tree)
    for name, tree in items.items()})
  for k in (2, 3):
    state, m = step(state, run.weights, run.data_key)
    assert_bitwise_equal(m, metrics[k])
  assert_bitwise_equal(state, straight)


def _truncate_half(model: pathlib.Path) -> pathlib.Path:
  path = model / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])
  return path


def _cut_to_four_bytes(model: pathlib.Path) -> pathlib.Path:
  path = model / "model.safetensors"
  path.write_bytes(path.read_bytes()[:4])
  return path


@pytest.mark.parametrize("damage,message", [
  (_truncate_half, "is truncated"),
  (_cut_to_four_bytes, "is not a safetensors file: 4 bytes"),
])
def test_damaged_weights_fail_before_writing(parse, tmp_path, damage,
                                             message):
  model = tmp_path / "tiny_llama"
  shutil.copytree(ROOT / "tests" / "fixtures" / "tiny_llama", model)
  path = damage(model)
  out = tmp_path / "run"
  with pytest.raises(ValueError, match=message) as info:
    train.setup(parse(f"--flagfile={TINY}", f"--model_dir={model}",
                      f"--output_dir={out}"))
  assert str(info.value).startswith(f"{path} ")
  assert not out.exists()


def test_a_missing_shard_fails_before_writing(parse, tmp_path):
  model = tmp_path / "tiny_qwen3"
  shutil.copytree(ROOT / "tests" / "fixtures" / "tiny_qwen3", model)
  (model / "model-00001-of-00002.safetensors").unlink()
  out = tmp_path / "run"
  with pytest.raises(ValueError, match="names model-00001-of-00002"
                     ".safetensors, which is not in"):
    train.setup(parse(f"--flagfile={TINY}", f"--model_dir={model}",
                      f"--output_dir={out}"))
  assert not out.exists()
