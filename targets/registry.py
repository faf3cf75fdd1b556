"""Named toy targets behind one uniform record (SPEC §10).

`get(name)` returns a `ToyTarget` whose callables close over the toy's static
config; weights are always explicit arguments. A trained target is a pure
function of its seed; caching it (`weights_to_arrays` → npz) is the caller's
business.
"""

import dataclasses
import functools
import types
from types import ModuleType
from collections.abc import Callable
from typing import Any, Optional, Union

import jax
import numpy as np
from jaxtyping import Array, Key

from decompax.core import sites, target
from decompax.targets import (
  arithmetic, induction, record, resid_mlp, simple_mlp, tms, token_embed,
  toy_sites)
from decompax.targets import toy_training as train_lib

Weights = Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyTarget(record.Target):
  """One registered toy: the run's `Target` record (its name, sampler and,
  for token toys, the decoder they run on), its config and the functions
  the engine calls.

  `train(key_or_seed, progress=None)` trains from an int seed (preferred: the
  error names it) or a typed key, and raises ValueError when the result does
  not represent every feature (see `missing_features`).
  """

  config: Any
  default_seed: int
  sites: Callable[[toy_sites.CPerSite], tuple[sites.SiteSpec, ...]]
  fns: Callable[[toy_sites.CPerSite], target.TargetFns]
  init: Callable[[Key[Array, ""]], Weights]
  train: Callable[..., Weights]
  missing_features: Callable[[Weights], tuple[int, ...]]
  weights_to_arrays: Callable[[Weights], dict[str, np.ndarray]]
  weights_from_arrays: Callable[[dict[str, np.ndarray]], Weights]
  # Targets whose function table and weight layout depend on the decomposed
  # subset (LM-shaped toys: three layer stacks around the span) build both
  # from the selected sites; None means `fns(c)._replace(sites=...)`.
  fns_for_sites: Optional[
    Callable[[tuple[sites.SiteSpec, ...]], target.TargetFns]] = None
  weights_for_sites: Optional[
    Callable[[Weights, tuple[sites.SiteSpec, ...]], Weights]] = None


# name -> (module, config, default seed). Seeds are ones whose trained target
# passes `missing_features`.
_TOYS: dict[str, tuple[ModuleType, Any, int]] = {
  "tms_5-2": (tms, tms.TmsConfig(5, 2), 0),
  "tms_5-2-id": (tms, tms.TmsConfig(5, 2, hidden_identity=True), 0),
  "tms_40-10": (tms, tms.TmsConfig(40, 10, batch_size=8192), 0),
  "tms_40-10-id": (
    tms,
    tms.TmsConfig(40, 10, hidden_identity=True, batch_size=8192),
    0,
  ),
  "resid_mlp1": (resid_mlp, resid_mlp.ResidMlpConfig(1, 100, 50), 0),
  "resid_mlp2": (resid_mlp, resid_mlp.ResidMlpConfig(2, 100, 25), 0),
  # The paper's three-layer target trains ten times longer than the others.
  "resid_mlp3": (
    resid_mlp,
    resid_mlp.ResidMlpConfig(
      3, 102, 17,
      training=train_lib.TargetTraining(steps=10_000, lr=3e-3, schedule="cosine"),
    ),
    0,
  ),
  "simple_mlp": (simple_mlp, simple_mlp.SimpleMlpConfig(), 0),
  # Token ids through one embedding site (SPEC §3.7), vocab 16, width 8.
  "embed_16-8": (token_embed, token_embed.TokenEmbedConfig(16, 8), 0),
}


def toy_names() -> tuple[str, ...]:
  """Return the registered toy names."""
  return (*_TOYS, *_LM_TOYS)


def fns_for(
  toy: ToyTarget, c: toy_sites.CPerSite, selected: tuple[sites.SiteSpec, ...]
) -> target.TargetFns:
  """Return the function table decomposing the `selected` sites."""
  if toy.fns_for_sites is not None:
    return toy.fns_for_sites(selected)
  return toy.fns(c)._replace(sites=selected)


def weights_for(
  toy: ToyTarget, weights: Weights, selected: tuple[sites.SiteSpec, ...]
) -> Weights:
  """Return the weights in the layout `fns_for(toy, c, selected)` takes."""
  if toy.weights_for_sites is None:
    return weights
  return toy.weights_for_sites(weights, selected)


def _train_checked(
  name: str,
  module: ModuleType | types.SimpleNamespace,
  config: Any,
  key: Union[Key[Array, ""], int],
  progress: Optional[train_lib.Progress] = None,
) -> Weights:
  """Return trained weights; raise ValueError naming unrepresented features."""
  if isinstance(key, int):
    origin = f"seed {key}"
    key = jax.random.key(key)
  else:
    origin = "given key"
  weights = module.train(key, config, progress)
  missing = module.missing_features(weights)
  if missing:
    raise ValueError(
      f"target {name} ({origin}) does not represent features"
      f" {list(missing)}; train it from another seed"
    )
  return weights


def build(
  name: str, module: ModuleType, config: Any, default_seed: int = 0
) -> ToyTarget:
  """Return the `ToyTarget` of a toy module (tms, resid_mlp, …) at `config`."""
  return ToyTarget(
    name=name,
    config=config,
    default_seed=default_seed,
    sites=lambda c: module.site_specs(config, c),
    fns=lambda c: module.target_fns(config, c),
    init=lambda key: module.init(key, config),
    train=functools.partial(_train_checked, name, module, config),
    missing_features=module.missing_features,
    sample_inputs=lambda key, b: module.sample_inputs(key, config, b),
    weights_to_arrays=module.weights_to_arrays,
    weights_from_arrays=lambda a: module.weights_from_arrays(a, config),
  )


def build_token_toy(name: str, module: ModuleType, config: Any,
                    default_seed: int = 0) -> ToyTarget:
  """Return a token-input toy on the GLU decoder (induction, addsub): its
  function table and weight layout follow the decomposed sites."""
  # `_train_checked` calls `module.missing_features(weights)`: bind config.
  bound = types.SimpleNamespace(
    train=module.train,
    missing_features=lambda w: module.missing_features(w, config))
  record = build(name, module, config, default_seed)
  return dataclasses.replace(
    record,
    train=functools.partial(_train_checked, name, bound, config),
    missing_features=bound.missing_features,
    fns_for_sites=lambda s: module.fns_for_sites(config, s),
    weights_for_sites=lambda w, s: module.weights_for_sites(w, config, s),
    token_model=config.model,
  )


def build_induction(
  config: induction.InductionConfig = induction.InductionConfig(),
  default_seed: int = 0,
) -> ToyTarget:
  """Return the induction toy (token inputs; its layout follows the sites)."""
  return build_token_toy("induction", induction, config, default_seed)


def build_addsub(
  config: arithmetic.ArithmeticConfig = arithmetic.ArithmeticConfig(),
  default_seed: int = 0,
) -> ToyTarget:
  """Return the arithmetic toy (`a ± b mod P` prompts; layout as induction's).

  Its inputs are the task prompts; the copying stream it also models is
  `arithmetic.other_batch`.
  """
  return build_token_toy("addsub", arithmetic, config, default_seed)


# Token-input toys built on the GLU decoder, each by its own builder.
_LM_TOYS: dict[str, Callable[[], ToyTarget]] = {
  "induction": build_induction,
  "addsub": build_addsub,
}


def get(name: str) -> ToyTarget:
  """Return the registered toy `name`; ValueError lists the known names."""
  if name in _LM_TOYS:
    return _LM_TOYS[name]()
  if name not in _TOYS:
    raise ValueError(f"unknown toy target {name!r}; known: "
                     f"{list(toy_names())}")
  return build(name, *_TOYS[name])
