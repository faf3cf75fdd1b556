"""The steps `bench/memory.py` measures, built from a model's config alone:
the reference recipe (`flags/l18.flags`) on a model's MLP at one layer (a
mixture of experts': every expert's gate, up and down), with abstract
frozen weights. Defines no flags, so tests and other benches import it
beside any binary's."""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "hf_configs"
# model -> (title, default layer, default C). Qwen3-30B-A3B's layer has 384
# expert matrices (128 experts × 3): C = 192 each keeps the reference
# recipe's 73728 components a layer (3 × 24576), so its CI is l18's size.
MODELS = {"llama-3.1-8b": ("Llama-3.1-8B", 18, 24576),
          "pythia-1.4b": ("Pythia-1.4B", 12, 16384),
          "qwen3-30b-a3b": ("Qwen3-30B-A3B", 24, 192)}
GIB = 2.0**30


def recipe(batch: int, seq_len: int, c: int):
  """Return the reference recipe's settings at this batch, length and C."""
  from decompax.recipe.flagfiles import read_args
  return read_args([f"--flagfile={ROOT / 'flags' / 'l18.flags'}",
                    f"--batch_size={batch}", f"--seq_len={seq_len}",
                    f"--c={c}"])


def mlp_site_names(glu, layer: int) -> tuple[str, ...]:
  """Return a layer's MLP matrices in site order: gate (where the MLP is
  gated), up and down, or every expert's of a mixture of experts."""
  from decompax.targets import glu_weights
  if glu.moe:
    return tuple(glu_weights.site_name(layer, r, e)
                 for e in range(glu.n_experts)
                 for r in glu_weights.EXPERT_ROLES)
  return tuple(glu_weights.site_name(layer, r) for r in ("gate", "up", "down")
               if r in glu_weights.model_roles(glu))


def build(config, layer: int, model: str = "llama-3.1-8b"):
  """Return the run's parts (`recipe.assembly.parts`: target, CI function,
  terms), built once, and its abstract frozen weights: `model`'s MLP at
  `layer`."""
  import jax
  import jax.numpy as jnp
  from decompax.recipe import assembly
  from decompax.targets import glu_config, glu_target
  from decompax.targets import glu_arrays
  from decompax.targets import glu_sites
  from decompax.targets import record as target_record

  glu = glu_config.config_from_hf(json.loads(
    (CONFIGS / model / "config.json").read_text()))
  names = mlp_site_names(glu, layer)
  sites = glu_sites.site_specs(glu, names, config.c)
  target = glu_target.target_fns(glu, sites, config.attention, remat=True,
                                 output_chunk=config.output_chunk)
  seg = glu_sites.span_segments(glu, sites)
  arrays = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16)
            for k, s in glu_arrays.array_shapes(glu).items()}
  weights = jax.eval_shape(lambda a: glu_arrays.weights_from_arrays(
    a, glu, seg, jnp.bfloat16), arrays)

  def sample_inputs(key, batch_size):
    return jax.random.randint(key, (batch_size, config.seq_len), 0,
                              glu.vocab_size, jnp.int32)

  toy = target_record.Target(name=model,
                             sample_inputs=sample_inputs, token_model=glu)
  return assembly.parts(config, toy, target), weights
