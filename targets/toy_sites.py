"""Site plumbing shared by the toy targets.

Toy forwards are written once against a `SiteMatmul(name, x, w)`; the clean
forward passes the frozen `x @ w`, the masked forward a dispatcher that runs
live sites through `site_forward.site_matmul` and every other site through the
very same `x @ w` (SPEC I2: no live site ⇒ bit-identical to the clean forward).
An integer `x` is a batch of token ids, the one-hot rows of `x @ w`, which
every path takes as the row gather `w[x]` (an embedding site, SPEC §3.7).
"""

from collections.abc import Callable
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Key

from decompax.core import factored, site_forward, sites, target
from decompax.core.masks import SiteMask
from decompax.targets import sparse_data

SiteMatmul = Callable[[str, Array, Array], Array]
CPerSite = Union[int, dict[str, int]]


def is_token_ids(x: Array) -> bool:
  """Return whether `x` holds token ids (an embedding's input)."""
  return jnp.issubdtype(x.dtype, jnp.integer)


def frozen_matmul(
  name: str, x: Float[Array, "*l d_in"] | Int[Array, "*l"],
  w: Float[Array, "d_in d_out"],
) -> Float[Array, "*l d_out"]:
  """Return the frozen `x @ w` (the clean forward's matmul at every site):
  the rows `w[x]` for token ids."""
  del name
  if is_token_ids(x):
    return site_forward.rows(w, x)
  return x @ w


def site_specs_by_name(
  site_specs: tuple[sites.SiteSpec, ...],
  site_masks: dict[str, SiteMask],
) -> dict[str, sites.SiteSpec]:
  """Return the specs by name; raise ValueError if a live site is unknown."""
  by_name = sites.site_by_name(site_specs)
  unknown = sorted(set(site_masks) - set(by_name))
  if unknown:
    raise ValueError(f"unknown live sites {unknown}; sites are {list(by_name)}")
  return by_name


def masked_matmul(
  site_specs: tuple[sites.SiteSpec, ...],
  components: sites.Components,
  site_masks: dict[str, SiteMask],
) -> SiteMatmul:
  """Return a matmul running the sites in `site_masks` decomposed (§3.2-3.3).

  Raises:
    ValueError: a key of `site_masks` names no site.
  """
  by_name = site_specs_by_name(site_specs, site_masks)

  def matmul(
    name: str, x: Float[Array, "*l d_in"] | Int[Array, "*l"],
    w: Float[Array, "d_in d_out"],
  ) -> Float[Array, "*l d_out"]:
    site_mask = site_masks.get(name)
    if site_mask is None:
      return frozen_matmul(name, x, w)
    site = by_name[name]
    check_site_input(site, x)
    v, u = sites.site_factors(components, site)
    if sites.is_embedding(site):
      return site_forward.site_embedding(x, w, v, u, site_mask)
    return site_forward.site_matmul(x, w, v, u, site_mask)

  return matmul


def check_site_input(site: sites.SiteSpec, x: Array) -> None:
  """Raise ValueError (at trace time) unless an embedding site gets token
  ids and any other site activations."""
  if sites.is_embedding(site) != is_token_ids(x):
    raise ValueError(
      f"site {site.name} is {site.op} but its input has dtype {x.dtype}; an "
      "embedding site reads integer token ids, a linear site activations")


def select_taps(
  taps: dict[str, factored.Activation], wanted: tuple[str, ...]
) -> dict[str, factored.Activation]:
  """Return the requested taps; raise ValueError naming any unknown key."""
  check_tap_keys(wanted, tuple(taps))
  return {k: taps[k] for k in wanted}


def check_tap_keys(wanted: tuple[str, ...], known: tuple[str, ...]) -> None:
  """Raise ValueError naming every key of `wanted` not in `known`."""
  unknown = [k for k in wanted if k not in known]
  if unknown:
    raise ValueError(
      f"unknown tap keys {unknown}; known keys are {list(known)}"
    )


def c_per_site(c: CPerSite, names: tuple[str, ...]) -> dict[str, int]:
  """Return `C` for each site name from one int or a `{site: C}` dict."""
  if isinstance(c, int):
    return {name: c for name in names}
  missing = [n for n in names if n not in c]
  extra = sorted(set(c) - set(names))
  if missing or extra:
    raise ValueError(
      f"C per site must name exactly the sites {list(names)};"
      f" missing {missing}, unknown {extra}"
    )
  return {name: c[name] for name in names}


def mse(
  masked: Float[Array, "*l d"], clean: Float[Array, "*l d"]
) -> Float[Array, ""]:
  """Return `mean((masked − clean)²)` over all elements (toy `D_toy`)."""
  return jnp.mean(jnp.square(masked - clean))


def fields_to_arrays(record) -> dict[str, np.ndarray]:
  """Return a NamedTuple's array fields as host arrays (None fields left out)."""
  return {
    k: np.asarray(v) for k, v in record._asdict().items() if v is not None
  }


def arrays_to_fields(
  arrays: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]
) -> dict[str, Float[Array, "..."]]:
  """Return fp32 device arrays for exactly the fields in `shapes`.

  Raises:
    ValueError: the field names or a shape differ from `shapes` (e.g. a cached
      target of another configuration).
  """
  if set(arrays) != set(shapes):
    raise ValueError(
      f"weight arrays {sorted(arrays)} do not match fields {sorted(shapes)}"
    )
  for name, shape in shapes.items():
    if tuple(arrays[name].shape) != shape:
      raise ValueError(
        f"weight {name}: shape {tuple(arrays[name].shape)}, expected {shape}"
      )
  return {name: jnp.asarray(arrays[name], jnp.float32) for name in shapes}


def sequential_target_fns(
  specs: tuple[sites.SiteSpec, ...],
  forward: Callable,
  frozen_stacks: Callable,
  n_features: int,
  nonlinear_units: dict | None = None,
  expected: dict[str, target.Expected] | None = None,
  token_inputs: bool = False,
) -> target.TargetFns:
  """Return the function table of a toy whose `forward(weights, x, matmul)`
  runs every site through `matmul(name, x, w)` and returns `(y, taps)`.

  The clean forward and the non-live sites of the masked forward share one
  op sequence, so a masked forward with no live site is the clean forward.
  `token_inputs`: the batch is token ids `[*L]` in `[0, n_features)`, and
  the probe each id once; otherwise sparse features `[*L, n_features]`.
  """

  def clean_forward(weights, x, wanted):
    weights = jax.lax.stop_gradient(weights)
    return forward_with_outputs(forward, weights, x, frozen_matmul, wanted)

  def masked_forward(weights, components, x, site_masks):
    matmul = masked_matmul(specs, components, site_masks)
    return forward(weights, x, matmul)[0]

  def masked_forward_taps(weights, components, x, site_masks, clean_taps,
                          wanted):
    del clean_taps  # toys are cheap enough to always start from the inputs
    matmul = masked_matmul(specs, components, site_masks)
    return forward_with_outputs(forward, weights, x, matmul, wanted)

  return target.TargetFns(
    sites=specs,
    clean_forward=clean_forward,
    masked_forward=masked_forward,
    frozen_stacks=frozen_stacks,
    divergence=mse,
    batch_lead_shape=(
      (lambda x: x.shape) if token_inputs else (lambda x: x.shape[:-1])),
    feature_probe=(
      (lambda: jnp.arange(n_features, dtype=jnp.int32)) if token_inputs
      else (lambda: sparse_data.feature_probe(n_features))),
    nonlinear_units=nonlinear_units,
    masked_forward_taps=masked_forward_taps,
    expected=expected,
  )


def forward_with_outputs(
  forward: Callable, weights, x: Float[Array, "*l d"] | Int[Array, "*l"],
  matmul: SiteMatmul,
  wanted: tuple[str, ...],
) -> tuple[Float[Array, "..."], dict[str, factored.Activation]]:
  """Run `forward` and return its `wanted` taps, where `<site>.out` is the
  output of that site's matmul (SPEC §5.9 hidden activations)."""
  outputs = {}

  def recording(name, h, w):
    y = matmul(name, h, w)
    outputs[f"{name}.out"] = y
    return y

  y, taps = forward(weights, x, recording)
  return y, select_taps({**taps, **outputs}, wanted)


def sample_inputs(key: Key[Array, ""], config, batch_size: int) -> Float[Array, "b n"]:
  """Return a batch of the toy's sparse features (`ρ`, values `U[low, high]`)."""
  return sparse_data.sample_sparse_features(
    key, batch_size, config.n_features, config.feature_probability,
    config.value_low, config.value_high)
