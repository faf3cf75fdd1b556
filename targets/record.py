"""The one record a run reads of its target, whatever the target is.

A registered toy (`registry.ToyTarget`, which extends the record with what
trains and stores the toy), a checkpoint language model and an exported
task model (`recipe.lm`, both read as `--target=hf`) are each a `Target`:
its name, how a batch is drawn, and the GLU decoder its token ids feed
(None for toys without token inputs). `Resolved` is a target resolved from
a run's settings: the record, its function table over the decomposed sites
and the weight loader (None where the run trains or initialises its own).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

from jaxtyping import Array, Key

from decompax.core.target import Batch, TargetFns
from decompax.targets.glu_config import GluConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
  """What a run reads of its target.

  `sample_inputs(key, batch_size)` draws one batch (a pure function of
  the key); `token_model` is the GLU decoder whose vocabulary the batches'
  token ids index: a checkpoint's, a token toy's, or None.
  """

  name: str
  sample_inputs: Callable[[Key[Array, ""], int], Batch]
  token_model: Optional[GluConfig] = None


class Resolved(NamedTuple):
  """A run's target resolved from its settings (see the module docstring)."""

  record: Target
  fns: TargetFns
  load: Optional[Callable[[], Any]] = None
