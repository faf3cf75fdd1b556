"""The GPT-2, Pythia, Gemma and Qwen3-MoE flagfiles decompose their tiny
fixtures for a few steps (design §9.4, §9.5), in-process on CPU."""

import math
import pathlib

import numpy as np
import pytest

from decompax.bin import train
from decompax.io import run_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]
_BLOCK_2 = tuple(f"layers.2.{m}_proj" for m in (
  "self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "mlp.gate",
  "mlp.up", "mlp.down"))
SITES = {
  # Gemma 2's layer 2 attends through a sliding window, Gemma 3's is global.
  "tiny_gemma2": _BLOCK_2,
  "tiny_gemma3": _BLOCK_2,
  "tiny_gpt2": ("layers.1.mlp.up_proj", "layers.1.mlp.down_proj"),
  "tiny_pythia": tuple(f"layers.1.{m}_proj" for m in (
    "self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "mlp.up",
    "mlp.down")),
  # A mixture-of-experts model's MLP sites are its experts' projections.
  "tiny_qwen3moe": tuple(f"layers.1.self_attn.{r}_proj" for r in "qkvo")
  + tuple(f"layers.1.mlp.experts.{e}.{r}_proj" for e in range(4)
          for r in ("gate", "up", "down")),
}


def test_the_family_runs_are_the_ones_lowered_only_under_slow(family_runs):
  # tests/bin/test_flagfiles_lower.py leaves these flagfiles' steps to this
  # file's runs in the default suite.
  assert family_runs == set(SITES)


@pytest.mark.parametrize("name", sorted(SITES))
def test_family_flagfile_decomposes_a_few_steps(name, parse, tmp_path,
                                                monkeypatch):
  monkeypatch.chdir(ROOT)  # the flagfile's --model_dir is repo-relative
  out = tmp_path / "run"
  prepared = train.setup(parse(
    f"--flagfile={ROOT / 'flags' / f'{name}.flags'}", "--num_steps=3",
    "--log_every=1", "--eval_every=0", "--slow_eval_every=0",
    "--save_every=3", "--faithfulness_warmup_steps=1", "--c=8",
    "--batch_size=4", "--ci_d_model=8", "--ci_d_mlp=16",
    f"--output_dir={out}"))
  assert tuple(s.name for s in prepared.target.sites) == SITES[name]
  train.train(prepared)
  records = run_dir.read_metrics(out / "metrics.jsonl")
  losses = [r["loss/total"] for r in records if "loss/total" in r]
  assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
  assert (out / "decomposition.npz").is_file()


def test_tiny_llama_decomposes_its_embedding_and_head(parse, tmp_path,
                                                      monkeypatch):
  """The embedding and the unembedding as sites beside an MLP (design
  §9.2), with a CI function that reads them (the transformer CI has no
  input for an embedding)."""
  monkeypatch.chdir(ROOT)
  out = tmp_path / "run"
  prepared = train.setup(parse(
    f"--flagfile={ROOT / 'flags' / 'tiny_llama.flags'}",
    "--sites=embed_tokens,layers.1.mlp.up_proj,lm_head",
    "--ci_fn=vector_mlp", "--ci_hidden=8", "--num_steps=3", "--log_every=1",
    "--eval_every=0", "--slow_eval_every=0", "--save_every=3",
    "--faithfulness_warmup_steps=1", "--c=8", "--batch_size=4",
    f"--output_dir={out}"))
  assert tuple(s.name for s in prepared.target.sites) == (
    "embed_tokens", "layers.1.mlp.up_proj", "lm_head")
  train.train(prepared)
  records = run_dir.read_metrics(out / "metrics.jsonl")
  losses = [r["loss/total"] for r in records if "loss/total" in r]
  assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
  with np.load(out / "decomposition.npz") as saved:
    assert saved["components/embed_tokens/v"].shape == (1, 128, 8)
    assert saved["components/lm_head/u"].shape == (1, 8, 128)
