"""MLP causal-importance functions for toy targets (SPEC §4.2).

Every CI function maps clean taps (the key of a site's name is that site's
input `[*L, d_in]`) to per-site pre-activations `[*L, C_s]`. Hidden
activations are exact-erf GELU; weights are `N(0,1)·gain/√fan_in` with gain
`√2` into a hidden layer and `1` into the output; biases start at zero. Site
`i` (canonical order) initialises from `fold_in(key, i)`. `make_ci_fn` also
builds the LM chunkwise transformer of `ci_transformer` (SPEC §4.3).
"""

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Key

from decompax.core import ci_transformer
# PerComponentMLP is re-exported: the component- and vector-MLP share it.
from decompax.core.component_mlp import PerComponentMLP, component_mlp_pre
from decompax.core.sites import Components, SiteSpec, site_factors

CIKind = Literal[
  "component_mlp", "vector_mlp", "site_mlp", "global_mlp", "transformer"]
CI_KINDS = ("component_mlp", "vector_mlp", "site_mlp", "global_mlp",
            "transformer")


@dataclasses.dataclass(frozen=True)
class CIConfig:
  """Which CI function, and its hidden widths.

  `component_mlp` and `vector_mlp` take exactly one hidden width (`d_gate`);
  `site_mlp` and `global_mlp` take any number, including none. `transformer`
  ignores `hidden` and reads its sizes and chunks from `transformer`.
  """

  kind: str = "component_mlp"  # one of CI_KINDS
  hidden: tuple[int, ...] = (16,)
  transformer: ci_transformer.TransformerCIConfig = (
    ci_transformer.TransformerCIConfig())

  def __post_init__(self):
    if self.kind not in CI_KINDS:
      raise ValueError(f"unknown CI function {self.kind!r}; use one of {CI_KINDS}")
    if self.kind in ("component_mlp", "vector_mlp") and len(self.hidden) != 1:
      raise ValueError(f"{self.kind} takes one hidden width, got {self.hidden}")
    if any(h <= 0 for h in self.hidden):
      raise ValueError(f"CI hidden widths must be positive, got {self.hidden}")


class Dense(NamedTuple):
  """One affine layer `x @ w + b`."""

  w: Float[Array, "d_in d_out"]
  b: Float[Array, " d_out"]


class CIFn(NamedTuple):
  """A CI function as a pure `(init, apply)` pair plus the taps it reads."""

  input_taps: tuple[str, ...]
  init: Callable[[Key[Array, ""]], object]
  apply: Callable[[object, dict[str, Array], Components], dict[str, Array]]


def _normal(key, shape, fan_in: int, gain: float) -> Array:
  return jax.random.normal(key, shape, jnp.float32) * (gain / math.sqrt(fan_in))


def _gelu(x: Float[Array, "*s"]) -> Float[Array, "*s"]:
  return jax.nn.gelu(x, approximate=False)


def init_mlp(key: Key[Array, ""], widths: tuple[int, ...]) -> tuple[Dense, ...]:
  """Return dense layers `widths[0] → … → widths[-1]`, last one linear."""
  keys = jax.random.split(key, len(widths) - 1)
  layers = []
  for i, (d_in, d_out) in enumerate(zip(widths[:-1], widths[1:])):
    gain = 1.0 if i == len(widths) - 2 else math.sqrt(2.0)
    layers.append(
      Dense(_normal(keys[i], (d_in, d_out), d_in, gain), jnp.zeros((d_out,)))
    )
  return tuple(layers)


def apply_mlp(
  layers: tuple[Dense, ...], x: Float[Array, "*l d_in"]
) -> Float[Array, "*l d_out"]:
  """Run the MLP with GELU between layers."""
  for layer in layers[:-1]:
    x = _gelu(x @ layer.w + layer.b)
  return x @ layers[-1].w + layers[-1].b


def init_component_mlp(
  key: Key[Array, ""], c: int, d_gate: int
) -> PerComponentMLP:
  """Return `C` scalar MLPs `1 → d_gate → 1`."""
  k_in, k_out = jax.random.split(key)
  return PerComponentMLP(
    w_in=_normal(k_in, (c, d_gate), 1, math.sqrt(2.0)),
    b_in=jnp.zeros((c, d_gate)),
    w_out=_normal(k_out, (c, d_gate), d_gate, 1.0),
    b_out=jnp.zeros((c,)),
  )


def init_vector_mlp(
  key: Key[Array, ""], d_in: int, c: int, hidden: int
) -> PerComponentMLP:
  """Return `C` MLPs `d_in → hidden → 1`, each reading the whole input."""
  k_in, k_out = jax.random.split(key)
  return PerComponentMLP(
    w_in=_normal(k_in, (d_in, c, hidden), d_in, math.sqrt(2.0)),
    b_in=jnp.zeros((c, hidden)),
    w_out=_normal(k_out, (c, hidden), hidden, 1.0),
    b_out=jnp.zeros((c,)),
  )


def vector_mlp_pre(
  params: PerComponentMLP, x: Float[Array, "*l d_in"]
) -> Float[Array, "*l c"]:
  """Return each component's MLP applied to the full site input."""
  z = jnp.einsum("...i,ich->...ch", x, params.w_in) + params.b_in
  return jnp.sum(_gelu(z) * params.w_out, axis=-1) + params.b_out


def _site_keys(key, sites):
  return [jax.random.fold_in(key, i) for i in range(len(sites))]


def make_ci_fn(config: CIConfig, sites: tuple[SiteSpec, ...]) -> CIFn:
  """Return the `(init, apply)` pair of `config` over `sites`."""
  if config.kind == "transformer":
    return _make_transformer_ci_fn(config.transformer, sites)
  taps = tuple(s.name for s in sites)
  (width,) = config.hidden if len(config.hidden) == 1 else (None,)

  if config.kind == "component_mlp":

    def init(key):
      return {
        s.name: init_component_mlp(k, s.c, width)
        for s, k in zip(sites, _site_keys(key, sites))
      }

    def apply(params, tap_values, components):
      out = {}
      for s in sites:
        v, _ = site_factors(components, s)
        out[s.name] = component_mlp_pre(params[s.name], tap_values[s.name] @ v)
      return out

  elif config.kind == "vector_mlp":

    def init(key):
      return {
        s.name: init_vector_mlp(k, s.d_in, s.c, width)
        for s, k in zip(sites, _site_keys(key, sites))
      }

    def apply(params, tap_values, components):
      del components
      return {s.name: vector_mlp_pre(params[s.name], tap_values[s.name])
              for s in sites}

  elif config.kind == "site_mlp":

    def init(key):
      return {
        s.name: init_mlp(k, (s.d_in, *config.hidden, s.c))
        for s, k in zip(sites, _site_keys(key, sites))
      }

    def apply(params, tap_values, components):
      del components
      return {s.name: apply_mlp(params[s.name], tap_values[s.name])
              for s in sites}

  else:
    d_in = sum(s.d_in for s in sites)
    d_out = sum(s.c for s in sites)

    def init(key):
      return init_mlp(key, (d_in, *config.hidden, d_out))

    def apply(params, tap_values, components):
      del components
      x = jnp.concatenate([tap_values[s.name] for s in sites], axis=-1)
      pre = apply_mlp(params, x)
      bounds = list(itertools.accumulate(s.c for s in sites))[:-1]
      parts = jnp.split(pre, bounds, axis=-1)
      return {s.name: p for s, p in zip(sites, parts)}

  return CIFn(input_taps=taps, init=init, apply=apply)


def _make_transformer_ci_fn(
  config: ci_transformer.TransformerCIConfig, sites: tuple[SiteSpec, ...]
) -> CIFn:
  # Chunks are resolved and checked here, before any parameter exists (I7).
  plan = ci_transformer.plan_chunks(config, sites)

  def init(key):
    return ci_transformer.init_params(key, config, plan)

  def apply(params, tap_values, components):
    del components
    pre = ci_transformer.apply(params, tap_values, config, plan)
    return {s.name: pre[s.name] for s in sites}

  return CIFn(input_taps=plan.taps, init=init, apply=apply)
