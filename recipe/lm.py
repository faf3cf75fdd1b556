"""Language-model targets of a run: `--target=hf --model_dir=DIR`.

The model is a local Hugging Face checkpoint (Llama-3.x, dense Qwen3,
GPT-2, GPT-NeoX/Pythia, Gemma 2 or Gemma 3 text; `targets/glu_config.py`
says what is refused);
`--sites` names its matrices or shell patterns over them
(`layers.18.mlp.*`). Batches are uniform random token ids `[batch_size,
seq_len]`, a pure function of the step's key.
"""

import fnmatch
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from decompax.core import target as target_lib
from decompax.io import hf_checkpoint
from decompax.recipe.config import setting
from decompax.targets import (
  glu_arrays, glu_config, glu_sites, glu_target, glu_weights, record)

HF = "hf"
_DTYPES = {"bfloat16": (jnp.bfloat16, ml_dtypes.bfloat16),
           "float32": (jnp.float32, np.float32)}


def is_lm(config) -> bool:
  """Return whether the run decomposes a checkpoint language model."""
  return config.target == HF


def expand_sites(
  names: tuple[str, ...], patterns: tuple[str, ...]
) -> tuple[str, ...]:
  """Return the names matching any pattern, in the order of `names`.

  Raises:
    ValueError: a pattern matches no name.
  """
  for pattern in patterns:
    if not fnmatch.filter(names, pattern):
      parsed = [p for p in map(glu_weights.parse_site, names) if p is not None]
      mlp = ",".join(r for r in glu_weights.ROLES[4:]
                     if any(p[1] == r for p in parsed))
      ends = [n for n in glu_weights.END_SITES if n in names]
      experts = [e for e in map(glu_weights.site_expert,
                                names) if e is not None]
      # A mixture-of-experts model's MLP sites are its experts'.
      mlp_sites = (f" and layers.<i>.mlp.{{{mlp}}}_proj" if mlp else
                   " and layers.<i>.mlp.experts.<e>.{gate,up,down}_proj, "
                   f"e < {1 + max(experts)}")
      raise ValueError(f"--sites entry {pattern!r} matches no site; sites "
                       f"are layers.<i>.self_attn.{{q,k,v,o}}_proj"
                       f"{mlp_sites}, i < {1 + max(p[0] for p in parsed)}"
                       + "".join(f", {n}" for n in ends))
  return tuple(n for n in names
               if any(fnmatch.fnmatchcase(n, p) for p in patterns))


def hf_target(config) -> record.Resolved:
  """Return the record, the function table and a weight loader of
  `--model_dir` (a checkpoint LM or an exported task model); ValueError on
  an unusable checkpoint or flags."""
  if not config.model_dir:
    raise ValueError("--target=hf needs --model_dir=<local Hugging Face "
                     "checkpoint directory>")
  model_dir = config.model_dir
  with setting("model_dir"):
    glu = glu_config.config_from_hf(hf_checkpoint.read_config(
      model_dir, glu_config.check_fields))
  if config.seq_len > glu.max_position:
    raise ValueError(f"--seq_len {config.seq_len} exceeds the model's "
                     f"max_position_embeddings {glu.max_position}")
  # Without --sites, every projection; the embedding and the head only
  # when named (design §9.2).
  names = (expand_sites(glu_sites.selectable_site_names(glu), config.sites)
           if config.sites else glu_sites.all_site_names(glu))
  sites = glu_sites.site_specs(glu, names, config.c)
  fns = glu_target.target_fns(glu, sites, config.attention, remat=True,
                               output_chunk=config.output_chunk)
  seg = glu_sites.span_segments(glu, sites)
  jnp_dtype, np_dtype = _DTYPES[config.compute_dtype]

  def load():
    arrays = hf_checkpoint.load_model_arrays(glu, model_dir, np_dtype)
    return glu_arrays.weights_from_arrays(arrays, glu, seg, jnp_dtype)

  def sample_inputs(key, batch_size):
    return jax.random.randint(key, (batch_size, config.seq_len), 0,
                              glu.vocab_size, jnp.int32)

  name = os.path.basename(os.path.normpath(model_dir))
  return record.Resolved(
    record.Target(name=name, sample_inputs=sample_inputs, token_model=glu),
    fns, load)


def lead_shape(
  fns: target_lib.TargetFns, sample_inputs: Callable[[jax.Array, int], Any],
  batch_size: int,
) -> tuple[int, ...]:
  """Return the activations' leading shape of one batch (`(B,)`, `(B, T)`)."""
  batch = jax.eval_shape(lambda k: sample_inputs(k, batch_size),
                         jax.random.key(0))
  return tuple(fns.batch_lead_shape(batch))


def tokens_per_batch(shape: tuple[int, ...]) -> int:
  """Return the element count of a lead shape (frequency minimality's a')."""
  return math.prod(shape)
