"""A language-model run on random weights, to measure a step without a
checkpoint.

A step's cost does not depend on the frozen weights' values, so the
benchmarks build a model of a checkpoint's shapes (or a narrower one) with
random weights, drawn on the device in the compute dtype: matrices
`N(0, 1/d_in)`, norms near 1 (as `glu_weights.init_stack`), embeddings and head
`N(0, 1)`.
The run is built as `bin/train` builds `--target=hf` (`lm.hf_target`): the
named sites, every decoder block rematerialised in masked forwards, batches
of uniform random tokens, then `assembly.build_run`.
"""

import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Key

from decompax.analysis import explore
from decompax.core.sites import SiteSpec
from decompax.io import decomposition as decomposition_lib
from decompax.recipe import assembly
from decompax.recipe.config import TrainConfig
from decompax.targets import (
  glu_arrays, glu_config, glu_sites, glu_target, glu_weights)
from decompax.targets import record as target_record


def random_weights(key: Key[Array, ""], model: glu_config.GluConfig,
                   sites: tuple[SiteSpec, ...],
                   dtype: Any = jnp.bfloat16) -> glu_weights.GluWeights:
  """Return random frozen weights of `model` in `dtype`, stored in the
  three stacks around the sites' span, drawn by one jitted call."""
  seg = glu_sites.span_segments(model, sites)
  return _draw(key, model, seg, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw(key: Key[Array, ""], model: glu_config.GluConfig,
          seg: glu_weights.Segments, dtype: Any) -> glu_weights.GluWeights:
  shapes = glu_arrays.layer_array_shapes(model)
  sizes = [math.prod(shape) for shape in shapes.values()]
  layer_key, vocab_key = jax.random.split(key)
  # One draw per layer, vmapped, then cut into leaves: on CPU XLA takes
  # seconds to compile each random draw, whatever its size.
  flat = jax.vmap(lambda k: jax.random.normal(k, (sum(sizes),), dtype))(
    jax.random.split(layer_key, model.n_layers))
  columns = jnp.split(flat, list(itertools.accumulate(sizes))[:-1], axis=1)
  leaves = {}
  for (name, shape), column in zip(shapes.items(), columns):
    values = column.reshape(model.n_layers, *shape)
    # Matrices `[.., d_in, d_out]` (an expert stack's lead with experts).
    leaves[name] = (values / math.sqrt(shape[-2]) if len(shape) >= 2
                    else 1 + 0.1 * values)
  prefix, span, tail = glu_weights.split_stacks(
    glu_weights.layer_stack(**leaves), seg)
  vocab = jax.random.normal(vocab_key, (2, model.vocab_size, model.d_model),
                            dtype)
  return glu_weights.GluWeights(
    embed=vocab[0], prefix=prefix, span=span, tail=tail,
    norm=jnp.ones(model.d_model, dtype),
    head=None if model.tied else vocab[1])


def build_run(config: TrainConfig, model: glu_config.GluConfig,
              sites: tuple[SiteSpec, ...], weights: glu_weights.GluWeights,
              prefix_sharing: bool = True) -> assembly.Run:
  """Return the run decomposing `sites` of `model` with `weights`, as
  `bin/train` builds it for `--target=hf`; with `prefix_sharing` off,
  masked forwards rerun the frozen prefix (SPEC §3.5, to measure what
  sharing saves)."""
  target = glu_target.target_fns(model, sites, config.attention, remat=True,
                                 prefix_sharing=prefix_sharing,
                                 output_chunk=config.output_chunk)

  def sample_inputs(key, batch_size):
    return jax.random.randint(key, (batch_size, config.seq_len), 0,
                              model.vocab_size, jnp.int32)

  record = target_record.Target(name=f"random_{model.family}",
                                sample_inputs=sample_inputs,
                                token_model=model)
  return assembly.build_run(config, record, target, weights)


def loaded_run(config: TrainConfig, model: glu_config.GluConfig,
               sites: tuple[SiteSpec, ...]) -> explore.LoadedRun:
  """Return a random model of `model`'s shape with `sites` decomposed at
  their initialisation, opened as `explore.load_run` opens a finished run
  (for benches of the analysis tools, which need no trained run)."""
  weights = random_weights(jax.random.key(0), model, sites, jnp.float32)
  run = build_run(config, model, sites, weights)
  parts = run.plan.parts
  decomposition = decomposition_lib.Decomposition(
    run.state.components, run.state.ci_params, sites, parts.ci_config, 0, {})
  return explore.LoadedRun(config, parts.target, run.weights, decomposition,
                           parts.ci_fn,
                           explore.jit_functions(parts.target, parts.ci_fn))
