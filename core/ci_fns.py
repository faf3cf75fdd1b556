"""MLP causal-importance functions for toy targets (SPEC §4.2).

Every CI function maps clean taps (the key of a site's name is that site's
input `[*L, d_in]`) to per-site pre-activations `[*L, C_s]`. Hidden
activations are exact-erf GELU; weights are `N(0,1)·gain/√fan_in` with gain
`√2` into a hidden layer and `1` into the output; biases start at zero. Site
`i` (canonical order) initialises from `fold_in(key, i)`. `make_ci_fn` also
builds the LM chunkwise transformer of `ci_transformer` (SPEC §4.3).

An embedding site's input is token ids, whose one-hot is never formed: the
MLP forms read its component activations `V[t]` (width `C`) where they read
a linear site's input (SPEC §3.7).

Dual-role CI (SPEC §6.6): every kind splits into a trunk (everything up to
its last linear map) and a readout head. With the roles `output,hidden` the
parameters are `RoleHeads(shared, hidden_head)`: `shared` is exactly the
one-role function's parameters (trunk and output head, initialised from the
same key), `hidden_head` a second readout of the same trunk. The trunk's
arrays exist once, so their gradient is the sum of both roles'.
"""

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Key

from decompax.core import ci_transformer, factored, site_forward
# PerComponentMLP is re-exported: the component- and vector-MLP share it.
from decompax.core.component_mlp import PerComponentMLP, component_mlp_pre
from decompax.core.sites import (
  Components, SiteSpec, is_embedding, site_factors)

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
  `roles`: `("output",)`, or `("output", "hidden")` for dual-role CI.
  """

  kind: str = "component_mlp"  # one of CI_KINDS
  hidden: tuple[int, ...] = (16,)
  transformer: ci_transformer.TransformerCIConfig = (
    ci_transformer.TransformerCIConfig())
  roles: tuple[str, ...] = ("output",)

  def __post_init__(self):
    parse_roles(self.roles)
    if (len(self.roles) > 1 and self.kind in ("site_mlp", "global_mlp")
        and not self.hidden):
      raise ValueError(f"dual-role CI shares a trunk, and a {self.kind} "
                       "without hidden layers has none; give it a hidden "
                       "width or read out the output role only")
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


# The roles a CI function may read out: the output role's masks serve every
# term scoring the output, the hidden role's the hidden-activation passes.
OUTPUT, HIDDEN = "output", "hidden"
ROLES = (OUTPUT, HIDDEN)
# `fold_in` of the CI key that draws the hidden head: the output role keeps
# the one-role function's draws.
HIDDEN_HEAD_STREAM = 2**31 - 1


class CIFn(NamedTuple):
  """A CI function as a pure `(init, apply)` pair plus the taps it reads.

  `apply` returns the output role's pre-activations; `apply_roles` every
  role's, `{role: {site: pre}}`, the trunk computed once (None: the output
  role only, as `apply`).
  """

  input_taps: tuple[str, ...]
  init: Callable[[Key[Array, ""]], object]
  apply: Callable[[object, dict[str, Array], Components], dict[str, Array]]
  roles: tuple[str, ...] = (OUTPUT,)
  apply_roles: Optional[Callable[
    [object, dict[str, Array], Components],
    dict[str, dict[str, Array]]]] = None


class RoleHeads(NamedTuple):
  """A dual-role CI function's parameters: the one-role function's (trunk
  and output head) and the hidden role's readout head."""

  shared: object
  hidden_head: object


def role_suffix(role: str) -> str:
  """Return the suffix a role's names carry (`ci_l0<suffix>/…`,
  `<term><suffix>`): none for the output role, `_<role>` otherwise."""
  return "" if role == OUTPUT else f"_{role}"


def role_pre(ci_fn: CIFn, params: object,
             taps: dict[str, factored.Activation],
             components: Components) -> dict[str, dict[str, Array]]:
  """Return every role's pre-activations, `{role: {site: pre}}`."""
  if ci_fn.apply_roles is None:
    return {OUTPUT: ci_fn.apply(params, taps, components)}
  return ci_fn.apply_roles(params, taps, components)


def parse_roles(text: str | tuple[str, ...]) -> tuple[str, ...]:
  """Return the roles `output` or `output,hidden`; ValueError otherwise."""
  roles = tuple(text.split(",")) if isinstance(text, str) else tuple(text)
  if roles not in ((OUTPUT,), ROLES):
    raise ValueError(f"CI roles must be 'output' or 'output,hidden', got "
                     f"{','.join(roles)!r}")
  return roles


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


def ci_input_width(site: SiteSpec) -> int:
  """Return the width of what a site-reading CI function reads: `d_in`, or
  `C` for an embedding (SPEC §3.7)."""
  return site.c if is_embedding(site) else site.d_in


def ci_input(site: SiteSpec, tap: factored.Activation | Int[Array, "*l"],
             components: Components) -> Float[Array, "*l w"]:
  """Return the site's input as a CI function reads it: the activation
  itself, or an embedding's component activations `V[t]` (its token ids'
  one-hot is never formed)."""
  if is_embedding(site):
    return site_forward.component_acts(site, tap,
                                       site_factors(components, site)[0])
  return factored.dense(tap)


class _Parts(NamedTuple):
  """One CI kind split at its readout: `features(params, taps, components)`
  runs the trunk, `readout(params, head, features)` the last linear map
  (`head` None: the params' own output head), `init_head(key)` draws a
  second head."""

  init: Callable[[Key[Array, ""]], object]
  features: Callable[[object, dict[str, Array], Components], object]
  readout: Callable[[object, object, object], dict[str, Array]]
  init_head: Callable[[Key[Array, ""]], object]


def _init_dense(key: Key[Array, ""], d_in: int, d_out: int) -> Dense:
  """Return a readout layer: gain 1, zero bias."""
  return Dense(_normal(key, (d_in, d_out), d_in, 1.0), jnp.zeros((d_out,)))


def _per_component_head(key: Key[Array, ""], c: int, hidden: int) -> Dense:
  """Return a second `w_out [C, hidden]`, `b_out [C]` for per-component MLPs."""
  return Dense(_normal(key, (c, hidden), hidden, 1.0), jnp.zeros((c,)))


def _with_head(params: PerComponentMLP, head: Dense | None) -> PerComponentMLP:
  return params if head is None else params._replace(w_out=head.w,
                                                     b_out=head.b)


def _component_parts(sites, width: int, vector: bool) -> _Parts:
  """Return the component- or vector-MLP: the per-component hidden layer is
  the trunk, `w_out`/`b_out` the head."""
  pre_fn = vector_mlp_pre if vector else component_mlp_pre

  def init(key):
    return {
      s.name: (init_vector_mlp(k, ci_input_width(s), s.c, width) if vector
               else init_component_mlp(k, s.c, width))
      for s, k in zip(sites, _site_keys(key, sites))}

  def features(params, tap_values, components):
    del params
    if vector:
      return {s.name: ci_input(s, tap_values[s.name], components)
              for s in sites}
    # A factored tap is projected without being formed (`core.factored`),
    # an embedding's rows gathered.
    return {s.name: site_forward.component_acts(
              s, tap_values[s.name], site_factors(components, s)[0])
            for s in sites}

  def readout(params, head, feats):
    # The hidden layer is recomputed per head inside the fused kernel: one
    # set of trunk arrays, whose gradient sums over the heads reading it.
    return {s.name: pre_fn(_with_head(params[s.name],
                                      None if head is None else head[s.name]),
                           feats[s.name])
            for s in sites}

  def init_head(key):
    return {s.name: _per_component_head(k, s.c, width)
            for s, k in zip(sites, _site_keys(key, sites))}

  return _Parts(init, features, readout, init_head)


def _hidden_layers(layers, x):
  for layer in layers[:-1]:
    x = _gelu(x @ layer.w + layer.b)
  return x


def _site_parts(sites, hidden: tuple[int, ...]) -> _Parts:
  """Return one MLP per site; its last layer is the head."""
  widths = {s.name: (ci_input_width(s), *hidden, s.c) for s in sites}

  def init(key):
    return {s.name: init_mlp(k, widths[s.name])
            for s, k in zip(sites, _site_keys(key, sites))}

  def features(params, tap_values, components):
    return {s.name: _hidden_layers(
              params[s.name], ci_input(s, tap_values[s.name], components))
            for s in sites}

  def readout(params, head, feats):
    out = {}
    for s in sites:
      last = params[s.name][-1] if head is None else head[s.name]
      out[s.name] = feats[s.name] @ last.w + last.b
    return out

  def init_head(key):
    return {s.name: _init_dense(k, widths[s.name][-2], s.c)
            for s, k in zip(sites, _site_keys(key, sites))}

  return _Parts(init, features, readout, init_head)


def _global_parts(sites, hidden: tuple[int, ...]) -> _Parts:
  """Return one MLP over every site's input; its last layer is the head."""
  widths = (sum(ci_input_width(s) for s in sites), *hidden,
            sum(s.c for s in sites))
  bounds = list(itertools.accumulate(s.c for s in sites))[:-1]

  def init(key):
    return init_mlp(key, widths)

  def features(params, tap_values, components):
    x = jnp.concatenate(
      [ci_input(s, tap_values[s.name], components) for s in sites], axis=-1)
    return _hidden_layers(params, x)

  def readout(params, head, feats):
    last = params[-1] if head is None else head
    parts = jnp.split(feats @ last.w + last.b, bounds, axis=-1)
    return {s.name: p for s, p in zip(sites, parts)}

  def init_head(key):
    return _init_dense(key, widths[-2], widths[-1])

  return _Parts(init, features, readout, init_head)


def _transformer_parts(
  config: ci_transformer.TransformerCIConfig, sites: tuple[SiteSpec, ...]
) -> tuple[_Parts, tuple[str, ...]]:
  """Return the chunkwise transformer (its blocks are the trunk, `w_out`/
  `b_out` the head) and the taps it reads."""
  embeddings = [s.name for s in sites if is_embedding(s)]
  if embeddings:
    raise ValueError(
      f"the transformer CI function reads residual taps and has no input "
      f"for the embedding sites {embeddings}; use an MLP CI function")
  # Chunks are resolved and checked here, before any parameter exists (I7).
  plan = ci_transformer.plan_chunks(config, sites)

  def init(key):
    return ci_transformer.init_params(key, config, plan)

  def features(params, tap_values, components):
    del components
    return tap_values, ci_transformer.trunk(params, tap_values, config, plan)

  def readout(params, head, feats):
    tap_values, h = feats
    w, b = ((params.w_out, params.b_out) if head is None
            else (head.w, head.b))
    pre = ci_transformer.readout(w, b, h, tap_values, plan)
    return {s.name: pre[s.name] for s in sites}

  def init_head(key):
    return ci_transformer.init_heads(key, config, plan)

  return _Parts(init, features, readout, init_head), plan.taps


def make_ci_fn(config: CIConfig, sites: tuple[SiteSpec, ...]) -> CIFn:
  """Return the `(init, apply)` pair of `config` over `sites`, reading out
  its roles (`output`, or `output,hidden` for dual-role CI)."""
  roles = config.roles
  taps = tuple(s.name for s in sites)
  if config.kind == "transformer":
    parts, taps = _transformer_parts(config.transformer, sites)
  elif config.kind in ("component_mlp", "vector_mlp"):
    parts = _component_parts(sites, config.hidden[0],
                             config.kind == "vector_mlp")
  elif config.kind == "site_mlp":
    parts = _site_parts(sites, config.hidden)
  else:
    parts = _global_parts(sites, config.hidden)

  def apply(params, tap_values, components):
    return parts.readout(params, None,
                         parts.features(params, tap_values, components))

  if roles == (OUTPUT,):
    return CIFn(input_taps=taps, init=parts.init, apply=apply)

  def init_roles(key):
    return RoleHeads(parts.init(key), parts.init_head(
      jax.random.fold_in(key, HIDDEN_HEAD_STREAM)))

  def apply_output(params, tap_values, components):
    return apply(params.shared, tap_values, components)

  def apply_roles(params, tap_values, components):
    feats = parts.features(params.shared, tap_values, components)
    return {OUTPUT: parts.readout(params.shared, None, feats),
            HIDDEN: parts.readout(params.shared, params.hidden_head, feats)}

  return CIFn(input_taps=taps, init=init_roles, apply=apply_output,
              roles=roles, apply_roles=apply_roles)
