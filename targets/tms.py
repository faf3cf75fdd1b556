"""Toy Models of Superposition target, TMS `m2-m1` (SPEC §10).

Right-multiplication convention, `x: [*b, n_features]`:
`h = x @ w`, then `h = h @ hidden` (frozen identity, `+ID` variant only), then
`y = relu(h @ w.T + b)`. Sites in canonical order: `linear1` (W = w),
`hidden_layers.0` (W = hidden), `linear2` (W = w.T, tied in the target but
decomposed as a site of its own). Every site is its own kind at row 0.
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
class TmsConfig:
  """Shape, data and target-training settings of one TMS model."""

  n_features: int
  n_hidden: int
  hidden_identity: bool = False
  feature_probability: float = 0.05
  value_low: float = 0.0
  value_high: float = 1.0
  batch_size: int = 1024
  training: train_lib.TargetTraining = train_lib.TargetTraining(steps=10_000, lr=5e-3)


class TmsWeights(NamedTuple):
  """Frozen TMS weights; `hidden` is the identity, or None without `+ID`."""

  w: Float[Array, "n_features n_hidden"]
  b: Float[Array, " n_features"]
  hidden: Optional[Float[Array, "n_hidden n_hidden"]] = None


def site_names(config: TmsConfig) -> tuple[str, ...]:
  """Return the site names in canonical order."""
  if config.hidden_identity:
    return ("linear1", "hidden_layers.0", "linear2")
  return ("linear1", "linear2")


def site_specs(
  config: TmsConfig, c: toy_sites.CPerSite
) -> tuple[sites.SiteSpec, ...]:
  """Return the sites (each its own kind, row 0) with `C` per site."""
  n, m = config.n_features, config.n_hidden
  shapes = {"linear1": (n, m), "hidden_layers.0": (m, m), "linear2": (m, n)}
  names = site_names(config)
  cs = toy_sites.c_per_site(c, names)
  specs = tuple(
    sites.SiteSpec(name, name, 0, *shapes[name], cs[name]) for name in names
  )
  sites.validate_sites(specs)
  return specs


def init(key: Key[Array, ""], config: TmsConfig) -> TmsWeights:
  """Return untrained weights: `w ~ U(±1/√n_features)`, `b = 0`."""
  bound = 1.0 / np.sqrt(config.n_features)
  w = jax.random.uniform(
    key, (config.n_features, config.n_hidden), jnp.float32, -bound, bound
  )
  b = jnp.zeros((config.n_features,), jnp.float32)
  hidden = None
  if config.hidden_identity:
    hidden = jnp.eye(config.n_hidden, dtype=jnp.float32)
  return TmsWeights(w=w, b=b, hidden=hidden)


def _forward(
  weights: TmsWeights,
  x: Float[Array, "*b n_features"],
  matmul: toy_sites.SiteMatmul,
) -> tuple[Float[Array, "*b n_features"], dict[str, Float[Array, "..."]]]:
  taps = {"linear1": x}
  h = matmul("linear1", x, weights.w)
  if weights.hidden is not None:
    taps["hidden_layers.0"] = h
    h = matmul("hidden_layers.0", h, weights.hidden)
  taps["linear2"] = h
  y = jax.nn.relu(matmul("linear2", h, weights.w.T) + weights.b)
  return y, taps


def forward(
  weights: TmsWeights, x: Float[Array, "*b n_features"]
) -> Float[Array, "*b n_features"]:
  """Return the frozen model's output."""
  return _forward(weights, x, toy_sites.frozen_matmul)[0]


def frozen_stacks(
  weights: TmsWeights,
) -> dict[str, Float[Array, "_layer _d_in _d_out"]]:
  """Return `{kind: W[None]}` in canonical site order (`linear2`: w.T)."""
  stacks = {"linear1": weights.w[None]}
  if weights.hidden is not None:
    stacks["hidden_layers.0"] = weights.hidden[None]
  stacks["linear2"] = weights.w.T[None]
  return stacks


def target_fns(config: TmsConfig, c: toy_sites.CPerSite) -> target.TargetFns:
  """Return the engine's function table for this TMS model."""
  # linear2's outputs are the ReLU's inputs: one neuron per feature.
  units = {"linear2": target.UnitSpec("neuron", config.n_features)}
  return toy_sites.sequential_target_fns(
    site_specs(config, c), _forward, frozen_stacks, config.n_features, units,
    expected(config))


def expected(config: TmsConfig) -> dict[str, target.Expected]:
  """Return each site's expected CI pattern (SPEC §10): one component per
  feature in both embeddings, the hidden identity dense over `n_hidden`."""
  patterns = {"linear1": target.Expected("identity", feature_axis=0),
              "linear2": target.Expected("identity", feature_axis=1)}
  if config.hidden_identity:
    patterns["hidden_layers.0"] = target.Expected("dense", config.n_hidden)
  return patterns


def sample_inputs(
  key: Key[Array, ""], config: TmsConfig, batch_size: int
) -> Float[Array, "b n"]:
  """Return a batch of sparse features (`ρ`, values `U[low, high]`)."""
  return toy_sites.sample_inputs(key, config, batch_size)


def _loss(
  params: dict[str, Float[Array, "..."]],
  fixed: TmsWeights,
  key: Key[Array, ""],
  config: TmsConfig,
) -> Float[Array, ""]:
  x = sample_inputs(key, config, config.batch_size)
  y = forward(fixed._replace(**params), x)
  return jnp.mean(jnp.square(x - y))


def train(
  key: Key[Array, ""],
  config: TmsConfig,
  progress: Optional[train_lib.Progress] = None,
) -> TmsWeights:
  """Return weights trained on `mean((x − y)²)`; `key` seeds init and data.

  `w` and `b` are trained; the hidden identity stays frozen. The result is
  not checked; see `missing_features`.
  """
  init_key, data_key = jax.random.split(key)
  weights = init(init_key, config)
  params = {"w": weights.w, "b": weights.b}
  params = train_lib.train(
    data_key,
    params,
    weights,
    lambda p, f, k: _loss(p, f, k, config),
    config.training,
    progress,
  )
  return weights._replace(**params)


def missing_features(
  weights: TmsWeights,
  output_tol: float = 0.25,
  min_row_norm: float = 0.5,
) -> tuple[int, ...]:
  """Return the features the model does not represent, ascending.

  Feature `i` is represented when the one-hot input `e_i` gives `y_i` within
  `output_tol` of 1 and its row `w[i]` has norm at least `min_row_norm`.
  """
  n = weights.w.shape[0]
  y = forward(weights, jnp.eye(n, dtype=jnp.float32))
  close = jnp.abs(jnp.diagonal(y) - 1.0) <= output_tol
  present = jnp.linalg.norm(weights.w, axis=1) >= min_row_norm
  return tuple(int(i) for i in np.flatnonzero(~np.asarray(close & present)))


def weights_to_arrays(weights: TmsWeights) -> dict[str, np.ndarray]:
  """Return the weights as host arrays keyed by field (None fields left out)."""
  return toy_sites.fields_to_arrays(weights)


def weights_from_arrays(
  arrays: dict[str, np.ndarray], config: TmsConfig
) -> TmsWeights:
  """Return weights from `weights_to_arrays` output; ValueError on mismatch."""
  n, m = config.n_features, config.n_hidden
  shapes = {"w": (n, m), "b": (n,)}
  if config.hidden_identity:
    shapes["hidden"] = (m, m)
  return TmsWeights(**toy_sites.arrays_to_fields(arrays, shapes))
