"""A decoder LM's weights as a checkpoint's flat arrays and back: the
per-layer and model array shapes a config implies, and the conversion
between stacked `GluWeights` (split into prefix, span and tail, I41) and the
whole-model arrays `io` reads and writes.
"""


import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from decompax.targets import glu_config, glu_sites, glu_weights


def layer_array_shapes(
  config: glu_config.GluConfig,
) -> dict[str, tuple[int, ...]]:
  """Return the per-layer shape of every stacked weight array: matrices,
  norms and (of models with them) biases `<role>_bias`, `ln{1,2}_bias`
  and sandwich norms `post_{attn,mlp}_norm`."""
  roles = glu_weights.model_roles(config)
  shapes = {r: glu_sites.role_dims(config, r) for r in roles}
  shapes.update(ln1=(config.d_model,), ln2=(config.d_model,))
  if config.qk_norm:
    shapes.update(q_norm=(config.head_dim,), k_norm=(config.head_dim,))
  if config.bias:
    shapes.update({f"{r}_bias": glu_sites.role_dims(config, r)[1:]
                   for r in roles})
  if config.norm == "layer":
    shapes.update(ln1_bias=(config.d_model,), ln2_bias=(config.d_model,))
  if config.sandwich:
    shapes.update(post_attn_norm=(config.d_model,),
                  post_mlp_norm=(config.d_model,))
  if config.moe:
    e, (d, f) = config.n_experts, (config.d_model, config.d_ff)
    shapes.update(router=(d, e), expert_gate=(e, d, f), expert_up=(e, d, f),
                  expert_down=(e, f, d))
  return shapes


# Whole-model arrays beside the layer stacks.
_MODEL_ARRAYS = ("embed", "norm", "head", "pos", "norm_bias")


def array_shapes(config: glu_config.GluConfig) -> dict[str, tuple[int, ...]]:
  """Return the shape of every array `weights_from_arrays` takes: `embed`,
  `norm`, `head` (untied models only), `pos` (learned positions only),
  `norm_bias` (LayerNorm only) and each per-layer array stacked
  `[n_layers, ...]`."""
  want = {"embed": (config.vocab_size, config.d_model),
          "norm": (config.d_model,)}
  if not config.tied:
    want["head"] = (config.vocab_size, config.d_model)
  if config.positions == "learned":
    want["pos"] = (config.max_position, config.d_model)
  if config.norm == "layer":
    want["norm_bias"] = (config.d_model,)
  for name, shape in layer_array_shapes(config).items():
    want[name] = (config.n_layers, *shape)
  return want


def weights_from_arrays(
  arrays: dict[str, np.ndarray | Array],
  config: glu_config.GluConfig,
  seg: glu_weights.Segments,
  dtype=jnp.float32,
) -> glu_weights.GluWeights:
  """Return device weights split into the three stacks of `seg`.

  `arrays` holds the arrays of `array_shapes`, per-layer ones in `x @ W`
  orientation: host arrays, or abstract ones under `jax.eval_shape` (the
  memory bench's).

  Raises:
    ValueError: a name or shape does not match `config`.
  """
  want = array_shapes(config)
  if set(arrays) != set(want):
    raise ValueError(f"weight arrays {sorted(arrays)} do not match the "
                     f"model's {sorted(want)}")
  for name, shape in want.items():
    if tuple(arrays[name].shape) != shape:
      raise ValueError(f"weight {name}: shape {tuple(arrays[name].shape)}, "
                       f"expected {shape}")
  stacks = glu_weights.split_stacks(
    glu_weights.layer_stack(**{n: arrays[n] for n in want
                               if n not in _MODEL_ARRAYS}), seg)

  def put(a):
    return jnp.asarray(a, dtype)

  return glu_weights.GluWeights(
    embed=put(arrays["embed"]),
    prefix=None if stacks[0] is None else jax.tree.map(put, stacks[0]),
    span=None if stacks[1] is None else jax.tree.map(put, stacks[1]),
    tail=None if stacks[2] is None else jax.tree.map(put, stacks[2]),
    norm=put(arrays["norm"]),
    head=None if config.tied else put(arrays["head"]),
    **{n: put(arrays[n]) for n in ("pos", "norm_bias") if n in want})


def weights_to_arrays(weights: glu_weights.GluWeights) -> dict[str, np.ndarray]:
  """Return host arrays in the `weights_from_arrays` layout."""
  stacks = [s for s in (weights.prefix, weights.span, weights.tail)
            if s is not None]
  out = {"embed": np.asarray(weights.embed), "norm": np.asarray(weights.norm)}
  for name in ("head", "pos", "norm_bias"):
    if getattr(weights, name) is not None:
      out[name] = np.asarray(getattr(weights, name))
  for name in glu_weights.LayerStack._fields:
    parts = [getattr(s, name) for s in stacks]
    if parts[0] is not None:
      out[name] = np.concatenate([np.asarray(p) for p in parts])
  return out
