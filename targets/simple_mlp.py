"""Plain ReLU MLP target on sparse features.

Right-multiplication convention, `x: [*b, n_features]`: for each layer `i`,
`h = h @ w[i] + b[i]`, with a ReLU after every layer but the last; widths
`n_features → *hidden → n_features`. Labels are the inputs themselves
(`y = x`, values `U[0, 1]`, `ρ = 0.05`). Hidden layers are at least as wide as
the input: narrower ones make training drop features (a linear output cannot
filter superposition noise, and an output ReLU leaves dead outputs), which
`missing_features` reports. Sites `layers.{i}`, each its own kind at row 0.
"""

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Key

from decompax.core import sites, target
from decompax.targets import toy_sites
from decompax.targets import toy_training as train_lib


@dataclasses.dataclass(frozen=True)
class SimpleMlpConfig:
  """Shape, data and target-training settings of one simple MLP."""

  n_features: int = 20
  hidden: tuple[int, ...] = (32,)
  feature_probability: float = 0.05
  value_low: float = 0.0
  value_high: float = 1.0
  batch_size: int = 1024
  training: train_lib.TargetTraining = train_lib.TargetTraining(
    steps=5_000, lr=5e-3, schedule="cosine"
  )

  def widths(self) -> tuple[int, ...]:
    """Return every layer boundary's width, input to output."""
    return (self.n_features, *self.hidden, self.n_features)


class SimpleMlpWeights(NamedTuple):
  """Frozen per-layer weights `w[i]: [d_i, d_{i+1}]` and biases `b[i]`."""

  w: tuple[Float[Array, "d_in d_out"], ...]
  b: tuple[Float[Array, " d_out"], ...]


def site_specs(
  config: SimpleMlpConfig, c: toy_sites.CPerSite
) -> tuple[sites.SiteSpec, ...]:
  """Return the sites `layers.{i}` (each its own kind, row 0) with `C`."""
  widths = config.widths()
  names = tuple(f"layers.{i}" for i in range(len(widths) - 1))
  cs = toy_sites.c_per_site(c, names)
  specs = tuple(
    sites.SiteSpec(name, name, 0, widths[i], widths[i + 1], cs[name])
    for i, name in enumerate(names)
  )
  sites.validate_sites(specs)
  return specs


def init(key: Key[Array, ""], config: SimpleMlpConfig) -> SimpleMlpWeights:
  """Return untrained weights `U(±1/√d_in)` and zero biases."""
  widths = config.widths()
  keys = jax.random.split(key, len(widths) - 1)
  w = tuple(
    jax.random.uniform(
      k, (d_in, d_out), jnp.float32, -1 / np.sqrt(d_in), 1 / np.sqrt(d_in)
    )
    for k, d_in, d_out in zip(keys, widths[:-1], widths[1:])
  )
  b = tuple(jnp.zeros((d,), jnp.float32) for d in widths[1:])
  return SimpleMlpWeights(w=w, b=b)


def _forward(
  weights: SimpleMlpWeights,
  x: Float[Array, "*b n_features"],
  matmul: toy_sites.SiteMatmul,
) -> tuple[Float[Array, "*b n_features"], dict[str, Float[Array, "..."]]]:
  taps = {}
  h = x
  last = len(weights.w) - 1
  for i, (w, b) in enumerate(zip(weights.w, weights.b)):
    taps[f"layers.{i}"] = h
    h = matmul(f"layers.{i}", h, w) + b
    if i < last:
      h = jax.nn.relu(h)
  return h, taps


def forward(
  weights: SimpleMlpWeights, x: Float[Array, "*b n_features"]
) -> Float[Array, "*b n_features"]:
  """Return the frozen model's output."""
  return _forward(weights, x, toy_sites.frozen_matmul)[0]


def frozen_stacks(
  weights: SimpleMlpWeights,
) -> dict[str, Float[Array, "_layer _d_in _d_out"]]:
  """Return `{f"layers.{i}": w[i][None]}`."""
  return {f"layers.{i}": w[None] for i, w in enumerate(weights.w)}


def target_fns(
  config: SimpleMlpConfig, c: toy_sites.CPerSite
) -> target.TargetFns:
  """Return the engine's function table for this MLP."""
  return toy_sites.sequential_target_fns(
    site_specs(config, c), _forward, frozen_stacks, config.n_features)


def sample_inputs(
  key: Key[Array, ""], config: SimpleMlpConfig, batch_size: int
) -> Float[Array, "b n"]:
  """Return a batch of sparse features (`ρ`, values `U[low, high]`)."""
  return toy_sites.sample_inputs(key, config, batch_size)


def _loss(
  params: SimpleMlpWeights,
  fixed: None,
  key: Key[Array, ""],
  config: SimpleMlpConfig,
) -> Float[Array, ""]:
  del fixed
  x = sample_inputs(key, config, config.batch_size)
  return jnp.mean(jnp.square(forward(params, x) - x))


def train(
  key: Key[Array, ""],
  config: SimpleMlpConfig,
  progress: Optional[train_lib.Progress] = None,
) -> SimpleMlpWeights:
  """Return weights trained on `mean((y − x)²)`; `key` seeds init and data.

  The result is not checked; see `missing_features`.
  """
  init_key, data_key = jax.random.split(key)
  return train_lib.train(
    data_key,
    init(init_key, config),
    None,
    lambda p, f, k: _loss(p, f, k, config),
    config.training,
    progress,
  )


def missing_features(
  weights: SimpleMlpWeights,
  output_tol: float = 0.25,
  min_response: float = 0.5,
) -> tuple[int, ...]:
  """Return the features the model does not represent, ascending.

  Feature `i` is represented when the one-hot input `e_i` gives `y_i` within
  `output_tol` of 1 and at least `min_response` above `y_i` at zero input.
  """
  n = weights.w[0].shape[0]
  y = jnp.diagonal(forward(weights, jnp.eye(n, dtype=jnp.float32)))
  y0 = forward(weights, jnp.zeros((n,), jnp.float32))
  ok = (jnp.abs(y - 1.0) <= output_tol) & (y - y0 >= min_response)
  return tuple(int(i) for i in np.flatnonzero(~np.asarray(ok)))


def weights_to_arrays(weights: SimpleMlpWeights) -> dict[str, np.ndarray]:
  """Return host arrays keyed `layers.{i}.w` / `layers.{i}.b`."""
  arrays = {}
  for i, (w, b) in enumerate(zip(weights.w, weights.b)):
    arrays[f"layers.{i}.w"] = np.asarray(w)
    arrays[f"layers.{i}.b"] = np.asarray(b)
  return arrays


def weights_from_arrays(
  arrays: dict[str, np.ndarray], config: SimpleMlpConfig
) -> SimpleMlpWeights:
  """Return weights from `weights_to_arrays` output; ValueError on mismatch."""
  widths = config.widths()
  n_layers = len(widths) - 1
  shapes = {}
  for i in range(n_layers):
    shapes[f"layers.{i}.w"] = (widths[i], widths[i + 1])
    shapes[f"layers.{i}.b"] = (widths[i + 1],)
  fields = toy_sites.arrays_to_fields(arrays, shapes)
  return SimpleMlpWeights(
    w=tuple(fields[f"layers.{i}.w"] for i in range(n_layers)),
    b=tuple(fields[f"layers.{i}.b"] for i in range(n_layers)),
  )
