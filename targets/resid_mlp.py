"""Residual MLP target (SPEC §10), 1–3 layers, positionless.

Right-multiplication convention, `x: [*b, n_features]`:
`r = x @ w_e`; per layer `i`, `r += relu(r @ w_in[i] + b_in[i]) @ w_out[i]`
(`+ b_out[i]` when configured); `y = r @ w_e.T` (`W_U = W_Eᵀ`, fixed). Layer
weights are stacked on a leading `layer` axis, which is also the row of each
site in its kind's stack. Sites, canonical order: `layers.{i}.mlp_in` (kind
`mlp_in`), `layers.{i}.mlp_out` (kind `mlp_out`), layer-ascending.
Labels are `x + relu(κ ⊙ x)` with `κ` drawn once per model from
`U[kappa_low, kappa_high]` and stored with the weights; the toys use the SPD
paper's `κ = 1`.

The clean and masked forwards never form `r` ([*b, d_embed], d_embed = 1000
against n_features, d_mlp, C ≤ 100): `r` is kept as a `Residual`, a sum of
`coef @ basis` terms, and every `r @ M` is `Σ coef @ (basis @ M)` with the
`d_embed` contraction between weights. Equal to the dense definition
(`forward`) up to float reassociation; only requested `mlp_in` taps are
materialised.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Key

from decompax.core import factored, sites, target
from decompax.core.masks import SiteMask
from decompax.targets import sparse_data, toy_sites
from decompax.targets import toy_training as train_lib


@dataclasses.dataclass(frozen=True)
class ResidMlpConfig:
  """Shape, data and target-training settings of one residual MLP.

  `d_mlp` is the width of each layer's MLP. The defaults are the SPD paper's
  target: labels `x + relu(x)` (`κ = 1`), no biases, 1000 training steps.
  They matter for what a decomposition should find. A spread of `κ` (e.g.
  `U[1, 2]`) or ten times the training gives the high-`κ` features a few
  nearly private neurons, and the paper's recipe then splits `W_out` into
  per-feature pieces for them instead of one dense block
  (docs/recovery.md).
  """

  n_layers: int
  n_features: int
  d_mlp: int
  d_embed: int = 1000
  in_bias: bool = False
  out_bias: bool = False
  feature_probability: float = 0.01
  value_low: float = -1.0
  value_high: float = 1.0
  kappa_low: float = 1.0
  kappa_high: float = 1.0
  batch_size: int = 2048
  training: train_lib.TargetTraining = train_lib.TargetTraining(
    steps=1000, lr=3e-3, schedule="cosine"
  )


class ResidMlpWeights(NamedTuple):
  """Frozen weights, MLPs stacked over layers; absent biases are None."""

  w_e: Float[Array, "n_features d_embed"]
  w_in: Float[Array, "layer d_embed d_mlp"]
  w_out: Float[Array, "layer d_mlp d_embed"]
  kappa: Float[Array, " n_features"]
  b_in: Optional[Float[Array, "layer d_mlp"]] = None
  b_out: Optional[Float[Array, "layer d_embed"]] = None


_TRAINED = ("w_in", "w_out", "b_in", "b_out")


def site_specs(
  config: ResidMlpConfig, c: toy_sites.CPerSite
) -> tuple[sites.SiteSpec, ...]:
  """Return the sites in canonical order with `C` per site."""
  d, m = config.d_embed, config.d_mlp
  layout = []
  for i in range(config.n_layers):
    layout.append((f"layers.{i}.mlp_in", "mlp_in", i, d, m))
    layout.append((f"layers.{i}.mlp_out", "mlp_out", i, m, d))
  cs = toy_sites.c_per_site(c, tuple(entry[0] for entry in layout))
  specs = tuple(sites.SiteSpec(*entry, cs[entry[0]]) for entry in layout)
  sites.validate_sites(specs)
  return specs


def _uniform(
  key: Key[Array, ""], shape: tuple[int, ...], fan_in: int
) -> Float[Array, "..."]:
  bound = 1.0 / np.sqrt(fan_in)
  return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def init(key: Key[Array, ""], config: ResidMlpConfig) -> ResidMlpWeights:
  """Return untrained weights, unit-norm `w_e` rows and the label `κ`.

  MLP matrices and biases are `U(±1/√fan_in)`.
  """
  e_key, in_key, out_key, b_in_key, b_out_key, kappa_key = jax.random.split(
    key, 6
  )
  n, d, m, lay = (
    config.n_features,
    config.d_embed,
    config.d_mlp,
    config.n_layers,
  )
  w_e = jax.random.normal(e_key, (n, d), jnp.float32)
  w_e = w_e / jnp.linalg.norm(w_e, axis=1, keepdims=True)
  kappa = jax.random.uniform(
    kappa_key, (n,), jnp.float32, config.kappa_low, config.kappa_high
  )
  return ResidMlpWeights(
    w_e=w_e,
    w_in=_uniform(in_key, (lay, d, m), d),
    w_out=_uniform(out_key, (lay, m, d), m),
    kappa=kappa,
    b_in=_uniform(b_in_key, (lay, m), d) if config.in_bias else None,
    b_out=_uniform(b_out_key, (lay, d), m) if config.out_bias else None,
  )


# The residual stream `Σ_k coefs[k] @ bases[k] + const`, never formed: its
# terms are the activations written into the stream (`x` through `w_e`, a
# layer's `h` through `w_out`, a live `mlp_out`'s masked `a` through `U`)
# with the matrices that write them; `const` sums the `b_out` biases. Every
# `r @ M` is `factored.project`: the d_embed contraction runs between
# weights, once per forward, not between batch rows.
Residual = factored.Factored


# (site name, residual, W) -> residual @ W, or the live site's output.
ReadSite = Callable[[str, Residual, Array], Array]
# (site name, h, W) -> the (coef, basis) terms the site adds to the residual.
WriteSite = Callable[[str, Array, Array], tuple[tuple[Array, Array], ...]]


def _frozen_read(
  name: str, resid: Residual, w: Float[Array, "d_embed d_mlp"]
) -> Float[Array, "*b d_mlp"]:
  del name
  return factored.project(resid, w)


def _frozen_write(
  name: str, h: Float[Array, "*b d_mlp"], w: Float[Array, "d_mlp d_embed"]
) -> tuple[tuple[Array, Array], ...]:
  del name
  return ((h, w),)


def _decomposed_read(
  resid: Residual,
  w: Float[Array, "d_embed d_mlp"],
  v: Float[Array, "d_embed c"],
  u: Float[Array, "c d_mlp"],
  site_mask: SiteMask,
) -> Float[Array, "*b d_mlp"]:
  # `site_forward.decomposed_matmul` with every `r @ M` taken by `factored.project`.
  a = factored.project(resid, v)
  y = (a * site_mask.mask) @ u
  rw = None
  if site_mask.delta is not None:
    rw = factored.project(resid, w)
    y = y + site_mask.delta[..., None] * (rw - a @ u)
  if site_mask.route is not None:
    rw = factored.project(resid, w) if rw is None else rw
    y = jnp.where(site_mask.route[..., None], y, rw)
  return y


def _decomposed_write(
  h: Float[Array, "*b d_mlp"],
  w: Float[Array, "d_mlp d_embed"],
  v: Float[Array, "d_mlp c"],
  u: Float[Array, "c d_embed"],
  site_mask: SiteMask,
) -> tuple[tuple[Array, Array], ...]:
  # `decomposed_matmul` regrouped by basis: `(a⊙m)·U + δ(h·W − a·U)` is
  # `(δh)·W + (a⊙m − δa)·U`; unrouted positions write `h·W` and nothing on U.
  a = h @ v
  coef_u = a * site_mask.mask
  coef_w = None
  if site_mask.delta is not None:
    delta = site_mask.delta[..., None]
    coef_u = coef_u - delta * a
    coef_w = delta * h
  if site_mask.route is not None:
    route = site_mask.route[..., None]
    coef_u = jnp.where(route, coef_u, 0.0)
    coef_w = jnp.where(route, 0.0 if coef_w is None else coef_w, h)
  if coef_w is None:
    return ((coef_u, u),)
  return ((coef_w, w), (coef_u, u))


def _masked_sites(
  specs: tuple[sites.SiteSpec, ...],
  components: sites.Components,
  site_masks: dict[str, SiteMask],
) -> tuple[ReadSite, WriteSite]:
  """Return site ops running the sites in `site_masks` decomposed (§3.2)."""
  by_name = toy_sites.site_specs_by_name(specs, site_masks)

  def read(name, resid, w):
    if name not in site_masks:
      return _frozen_read(name, resid, w)
    v, u = sites.site_factors(components, by_name[name])
    return _decomposed_read(resid, w, v, u, site_masks[name])

  def write(name, h, w):
    if name not in site_masks:
      return _frozen_write(name, h, w)
    v, u = sites.site_factors(components, by_name[name])
    return _decomposed_write(h, w, v, u, site_masks[name])

  return read, write


def _factored_forward(
  weights: ResidMlpWeights,
  x: Float[Array, "*b n_features"],
  read: ReadSite,
  write: WriteSite,
  wanted: tuple[str, ...] = (),
) -> tuple[Float[Array, "*b n_features"], dict[str, factored.Activation]]:
  # Clean and masked forwards share this op sequence (SPEC I2). `mlp_in` taps
  # are the residual itself, handed over factored: a CI function projects
  # them onto V without forming the [*b, d_embed] array.
  taps = {}
  resid = Residual((x,), (weights.w_e,))
  for i in range(weights.w_in.shape[0]):
    name_in, name_out = f"layers.{i}.mlp_in", f"layers.{i}.mlp_out"
    if name_in in wanted:
      taps[name_in] = resid
    pre = read(name_in, resid, weights.w_in[i])
    taps[f"{name_in}.out"] = pre
    if weights.b_in is not None:
      pre = pre + weights.b_in[i]
    h = jax.nn.relu(pre)
    taps[name_out] = h
    terms = write(name_out, h, weights.w_out[i])
    if f"{name_out}.out" in wanted:
      written = Residual(tuple(t[0] for t in terms), tuple(t[1] for t in terms))
      taps[f"{name_out}.out"] = factored.dense(written)
    const = resid.const
    if weights.b_out is not None:
      const = weights.b_out[i] if const is None else const + weights.b_out[i]
    resid = Residual(
      resid.coefs + tuple(t[0] for t in terms),
      resid.bases + tuple(t[1] for t in terms),
      const,
    )
  return factored.project(resid, weights.w_e.T), taps


def _dense_forward(
  weights: ResidMlpWeights, x: Float[Array, "*b n_features"]
) -> tuple[Float[Array, "*b n_features"], list[Float[Array, "*b d_mlp"]]]:
  """Return the output and each layer's hidden activations (dense residual)."""
  r = x @ weights.w_e
  hidden = []
  for i in range(weights.w_in.shape[0]):
    pre = r @ weights.w_in[i]
    if weights.b_in is not None:
      pre = pre + weights.b_in[i]
    hidden.append(jax.nn.relu(pre))
    out = hidden[-1] @ weights.w_out[i]
    if weights.b_out is not None:
      out = out + weights.b_out[i]
    r = r + out
  return r @ weights.w_e.T, hidden


def forward(
  weights: ResidMlpWeights, x: Float[Array, "*b n_features"]
) -> Float[Array, "*b n_features"]:
  """Return the frozen model's output, by its definition (dense residual)."""
  return _dense_forward(weights, x)[0]


def neurons_per_feature(
  weights: ResidMlpWeights, share: float = 0.9
) -> Int[Array, " n"]:
  """Return, per feature `i`, the fewest neurons (all layers together) that
  carry `share` of the energy the MLPs write for the CI probe input `0.75·e_i`
  (`sparse_data.feature_probe`).

  A neuron's part is `|Δh|·‖w_out row‖`, `Δh` its activation against the
  zero input's; a feature no neuron responds to gets 0. A feature with few
  such neurons is computed nearly monosemantically, and a decomposition may
  then give it its own piece of `W_out` instead of the paper's dense block
  (docs/recovery.md).
  """
  n = weights.w_e.shape[0]
  probes = jnp.concatenate([sparse_data.feature_probe(n), jnp.zeros((1, n))])
  _, hidden = _dense_forward(weights, probes)
  parts = jnp.concatenate([
    jnp.abs(h[:-1] - h[-1]) * jnp.linalg.norm(w_out, axis=1)
    for h, w_out in zip(hidden, weights.w_out)
  ], axis=1)
  energy = -jnp.sort(-jnp.square(parts), axis=1)
  total = jnp.sum(energy, axis=1, keepdims=True)
  carried = jnp.cumsum(energy, axis=1) / jnp.where(total > 0, total, 1.0)
  return jnp.where(total[:, 0] > 0, jnp.sum(carried < share, axis=1) + 1, 0)


def feature_space_forward(
  weights: ResidMlpWeights, x: Float[Array, "*b n_features"]
) -> Float[Array, "*b n_features"]:
  """Return `forward(weights, x)` up to float reassociation, computed cheaply.

  The residual is kept as `Σ_k a_k @ M_k` over the activations `a_k` written
  into it (`x` through `w_e`, each layer's `h` through `w_out`); every
  contraction with `d_embed` is taken between weights instead of batch rows
  (`d_embed ≫ n_features, d_mlp`). The clean forward of `target_fns`.
  """
  return _factored_forward(weights, x, _frozen_read, _frozen_write)[0]


def frozen_stacks(
  weights: ResidMlpWeights,
) -> dict[str, Float[Array, "_layer _d_in _d_out"]]:
  """Return `{"mlp_in": w_in, "mlp_out": w_out}` (already layer-stacked)."""
  return {"mlp_in": weights.w_in, "mlp_out": weights.w_out}


def target_fns(
  config: ResidMlpConfig, c: toy_sites.CPerSite
) -> target.TargetFns:
  """Return the engine's function table for this residual MLP."""
  specs = site_specs(config, c)
  tap_keys = tuple(k for s in specs for k in (s.name, f"{s.name}.out"))

  def clean_forward(
    weights: ResidMlpWeights, x: Float[Array, "*b n"], wanted: tuple[str, ...]
  ) -> tuple[Float[Array, "*b n"], dict[str, factored.Activation]]:
    toy_sites.check_tap_keys(wanted, tap_keys)
    weights = jax.lax.stop_gradient(weights)
    y, taps = _factored_forward(
      weights, x, _frozen_read, _frozen_write, wanted
    )
    return y, toy_sites.select_taps(taps, wanted)

  def masked_forward_taps(weights, components, x, site_masks, clean_taps,
                          wanted):
    del clean_taps  # the factored forward is cheap from the inputs
    toy_sites.check_tap_keys(wanted, tap_keys)
    read, write = _masked_sites(specs, components, site_masks)
    y, taps = _factored_forward(weights, x, read, write, wanted)
    return y, toy_sites.select_taps(taps, wanted)

  def masked_forward(
    weights: ResidMlpWeights,
    components: sites.Components,
    x: Float[Array, "*b n"],
    site_masks: dict[str, SiteMask],
  ) -> Float[Array, "*b n"]:
    read, write = _masked_sites(specs, components, site_masks)
    return _factored_forward(weights, x, read, write)[0]

  return target.TargetFns(
    sites=specs,
    clean_forward=clean_forward,
    masked_forward=masked_forward,
    masked_forward_taps=masked_forward_taps,
    frozen_stacks=frozen_stacks,
    divergence=toy_sites.mse,
    batch_lead_shape=lambda x: x.shape[:-1],
    feature_probe=lambda: sparse_data.feature_probe(config.n_features),
    # mlp_in writes the ReLU's inputs: one neuron per output column.
    nonlinear_units={
      s.name: target.UnitSpec("neuron", s.d_out)
      for s in specs if s.kind == "mlp_in"},
    expected=expected(config, specs),
  )


def expected(config: ResidMlpConfig, specs: tuple[sites.SiteSpec, ...]
             ) -> dict[str, target.Expected]:
  """Return each site's expected CI pattern (SPEC §10): `mlp_in` one
  component per feature, `mlp_out` dense over the layer's `d_mlp` neurons."""
  return {s.name: target.Expected("identity") if s.kind == "mlp_in"
          else target.Expected("dense", config.d_mlp) for s in specs}


def sample_inputs(
  key: Key[Array, ""], config: ResidMlpConfig, batch_size: int
) -> Float[Array, "b n"]:
  """Return a batch of sparse features (`ρ`, values `U[low, high]`)."""
  return toy_sites.sample_inputs(key, config, batch_size)


def labels(
  kappa: Float[Array, " n"], x: Float[Array, "*b n"]
) -> Float[Array, "*b n"]:
  """Return the training labels `x + relu(κ ⊙ x)`."""
  return x + jax.nn.relu(kappa * x)


def _loss(
  params: dict[str, Float[Array, "..."]],
  fixed: ResidMlpWeights,
  key: Key[Array, ""],
  config: ResidMlpConfig,
) -> Float[Array, ""]:
  x = sample_inputs(key, config, config.batch_size)
  y = feature_space_forward(fixed._replace(**params), x)
  return jnp.mean(jnp.square(y - labels(fixed.kappa, x)))


def train(
  key: Key[Array, ""],
  config: ResidMlpConfig,
  progress: Optional[train_lib.Progress] = None,
) -> ResidMlpWeights:
  """Return weights trained on the label MSE; `key` seeds init and data.

  Only the MLP weights and biases train; `w_e` and `κ` stay fixed. The result
  is not checked; see `missing_features`.
  """
  init_key, data_key = jax.random.split(key)
  weights = init(init_key, config)
  params = {
    f: getattr(weights, f) for f in _TRAINED if getattr(weights, f) is not None
  }
  params = train_lib.train(
    data_key,
    params,
    weights,
    lambda p, f, k: _loss(p, f, k, config),
    config.training,
    progress,
  )
  return weights._replace(**params)


def mlp_contribution(weights: ResidMlpWeights) -> Float[Array, " n"]:
  """Return, per feature `i`, what the MLPs add to output `i` for input `e_i`.

  Measured against the zero input, so constant bias outputs do not count; the
  direct path contributes `‖w_e[i]‖² = 1`, the label asks for `κ_i`.
  """
  n = weights.w_e.shape[0]
  y = forward(weights, jnp.eye(n, dtype=jnp.float32))
  y0 = forward(weights, jnp.zeros((n,), jnp.float32))
  direct = jnp.sum(jnp.square(weights.w_e), axis=1)
  return jnp.diagonal(y) - y0 - direct


def missing_features(
  weights: ResidMlpWeights, min_share: float = 0.03, max_share: float = 2.0
) -> tuple[int, ...]:
  """Return the features the model does not compute, ascending.

  Feature `i` is represented when, for input `e_i`, the MLPs add between
  `min_share·κ_i` and `max_share·κ_i` to output `i` (the label asks for
  `κ_i`). `min_share` is low on purpose: with `κ ~ U[1, 2]` a converged
  target spends its neurons on high-`κ` features and gives its lowest-`κ`
  ones only 7–9% of `κ` (seeds 0–2, 1–3 layers), while a feature no neuron
  reads gets 0.
  """
  share = mlp_contribution(weights) / weights.kappa
  ok = (share >= min_share) & (share <= max_share)
  return tuple(int(i) for i in np.flatnonzero(~np.asarray(ok)))


def weights_to_arrays(weights: ResidMlpWeights) -> dict[str, np.ndarray]:
  """Return the weights as host arrays keyed by field (None fields left out)."""
  return toy_sites.fields_to_arrays(weights)


def weights_from_arrays(
  arrays: dict[str, np.ndarray], config: ResidMlpConfig
) -> ResidMlpWeights:
  """Return weights from `weights_to_arrays` output; ValueError on mismatch.

  The biases are taken as `arrays` holds them, whatever `config.in_bias` and
  `config.out_bias` say, so that a run keeps the target it was trained on:
  the toys' targets had an `mlp_in` bias before they followed the paper.
  """
  n, d, m, lay = (
    config.n_features,
    config.d_embed,
    config.d_mlp,
    config.n_layers,
  )
  shapes = {
    "w_e": (n, d),
    "w_in": (lay, d, m),
    "w_out": (lay, m, d),
    "kappa": (n,),
  }
  biases = {"b_in": (lay, m), "b_out": (lay, d)}
  shapes |= {name: shape for name, shape in biases.items() if name in arrays}
  return ResidMlpWeights(**toy_sites.arrays_to_fields(arrays, shapes))
