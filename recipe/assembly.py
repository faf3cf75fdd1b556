"""Assemble a run from its config, once: the one way `bin/train`, the
benchmarks and the tests build a ready-to-step run.

The stages follow the best JAX trainers, each building its
objects once and handing them on:

  `parts`  config → target sites, CI function, loss terms, step settings;
  `plan`   → the initial state's shapes (`jax.eval_shape`) → their
           shardings on the mesh → the step, jitted once with them;
  `start`  → the initial components (a fresh run's warmed up, SPEC §6.2)
           → `jax.jit(init, out_shardings=…)`, the state born in its
           shards → a resumed run's state read from its checkpoint onto
           the same shardings → the loop (`bin/train`).

`parts` needs no weights and `plan` only their shapes, so a binary runs
both, and with them every refusal of sites, terms, rider points and
layouts, before it writes anything; `start` makes the arrays. `build_run`
runs the three in a row.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from decompax.core import ci_fns, sites as sites_lib, slots, train_step
from decompax.core import step_records
from decompax.core import warmup as warmup_lib
from decompax.core.target import TargetFns
from decompax.losses import faithfulness
from decompax.placement import shardings as shardings_lib
from decompax.placement import table as table_lib
from decompax.placement import transfer
from decompax.recipe import engine, lm, streams, token_data
from decompax.recipe.config import TrainConfig
from decompax.targets import record as target_record
from decompax.targets import registry

# restore(template, reinit, shardings, term_names) -> the restored state;
# `reinit(components, ci_params)` builds a fresh state around a restored
# decomposition (see `bin/checkpointing.restorer`).
Restore = Callable[..., step_records.TrainState]


class Parts(NamedTuple):
  """A run's engine objects, built from its config before any weight.

  `record` is the target's (`targets.record.Target`: a toy's, a checkpoint
  LM's or a task model's); `lead_shape` is one batch's activation lead
  shape.
  """

  config: TrainConfig
  record: target_record.Target
  target: TargetFns
  ci_config: ci_fns.CIConfig
  ci_fn: ci_fns.CIFn
  terms: tuple[step_records.LossTerm, ...]
  step_config: step_records.StepConfig
  # A targeted run's: a dict by stream (`recipe.streams`).
  lead_shape: tuple[int, ...] | dict[str, tuple[int, ...]]

  @property
  def term_names(self) -> tuple[str, ...]:
    return tuple(t.name for t in self.terms)

  @property
  def targeted(self) -> bool:
    return bool(self.step_config.streams)

  def sample_inputs(self, key: jax.Array) -> Any:
    """Return the batch the step draws from `key` (a targeted run's: a
    dict by stream)."""
    if self.targeted:
      return streams.sampler(self.config)(key)
    return self.record.sample_inputs(key, self.config.batch_size)

  def stream_inputs(self, stream: str) -> Callable[[jax.Array], Any]:
    """Return `sample(key)` drawing one stream's batch alone."""
    sample = streams.sampler(self.config, (stream,))
    return lambda key: sample(key)[stream]


class Plan(NamedTuple):
  """A run placed, before its state exists.

  `step` is the one jitted step (placed when `shardings` is not None);
  `state` the initial state's shapes; `sample_inputs` the batch sampler
  (pinned to the batch layout when placed) and `constrain` the placement
  hook, both for other jitted passes over the run (evals); `fallbacks`
  where a preset's layouts keep what does not tile replicated; `data` the
  token files batches are read from (None: the step samples its own);
  `pads` the pad slots its V/U masters are held with (`core.slots`).
  """

  parts: Parts
  step: step_records.TrainStep
  state: step_records.TrainState
  shardings: step_records.StepShardings | None
  constrain: step_records.Constrain
  sample_inputs: Callable[[jax.Array], Any]
  fallbacks: tuple[shardings_lib.Fallback, ...] = ()
  data: token_data.TokenData | streams.StreamData | None = None
  pads: slots.SlotPads = slots.NO_PADS


class Run(NamedTuple):
  """A ready-to-step run: its plan, initial state, frozen weights (on the
  mesh when placed), data key and the faithfulness warmup's losses."""

  plan: Plan
  state: step_records.TrainState
  weights: Any
  data_key: jax.Array
  warmup_losses: jax.Array

  @property
  def built(self) -> step_records.TrainStep:
    return self.plan.step

  @property
  def ci_fn(self) -> ci_fns.CIFn:
    return self.plan.parts.ci_fn

  @property
  def terms(self) -> tuple[step_records.LossTerm, ...]:
    return self.plan.parts.terms

  @property
  def sample_inputs(self) -> Callable[[jax.Array], Any]:
    return self.plan.sample_inputs

  @property
  def constrain(self) -> step_records.Constrain:
    return self.plan.constrain

  @property
  def data(self) -> token_data.TokenData | streams.StreamData | None:
    return self.plan.data

  @property
  def inputs_sharding(self) -> Any:
    """Where a host-read batch goes (None: unplaced, or sampled inside)."""
    if self.plan.data is None or self.plan.shardings is None:
      return None
    return self.plan.shardings.inputs

  def step_inputs(self, step: int) -> Any:
    """Return what the step takes beside state and weights at `step`."""
    if self.data is None:
      return self.data_key
    if isinstance(self.data, streams.StreamData):
      return streams.train_batches(self.data, step, self.data_key,
                                   self.inputs_sharding)
    return token_data.train_batch(self.data, step, self.inputs_sharding)

  def eval_batches(self, n_batches: int) -> Any:
    """Return the held-out batches read from token files, or None."""
    if self.data is None or isinstance(self.data, streams.StreamData):
      return None
    return token_data.eval_batches(self.data, n_batches,
                                   self.inputs_sharding)

  def stream_eval_batches(self, stream: str, n_batches: int) -> Any:
    """Return a targeted run's held-out batches of one file stream, or None
    (a task stream's evals draw their own)."""
    if not isinstance(self.data, streams.StreamData):
      return None
    sharding = self.inputs_sharding
    return streams.eval_batches(self.data, stream, n_batches,
                                None if sharding is None else sharding[stream])


class Keys(NamedTuple):
  """The run's key streams, split from its seed."""

  components: jax.Array
  ci: jax.Array
  run: jax.Array
  data: jax.Array


def keys_of(seed: int) -> Keys:
  """Return the key streams of `seed` (their order fixes every run)."""
  init_key, _, run_key, data_key = jax.random.split(jax.random.key(seed), 4)
  vu_key, ci_key = jax.random.split(init_key)
  return Keys(vu_key, ci_key, run_key, data_key)


def resolve_target(config: TrainConfig) -> target_record.Resolved:
  """Return the target record, its function table over the selected sites
  and, for checkpoint LMs and task models, the weight loader (None: toys
  train theirs)."""
  if lm.is_lm(config):
    return lm.hf_target(config)
  toy = registry.get(config.target)
  sites = engine.select_sites(toy.sites(config.c), config.sites, toy.name)
  return target_record.Resolved(toy, registry.fns_for(toy, config.c, sites))


def parts(config: TrainConfig, record: target_record.Target,
          target: TargetFns) -> Parts:
  """Return the run's CI function, loss terms and step settings, each built
  once. Raises ValueError for a setting a term or config refuses."""
  streams.check(config)
  if streams.is_targeted(config):
    lead = stream_leads(config, record, target)
    tokens = 0  # each stream's terms count their own
  else:
    lead = lm.lead_shape(target, record.sample_inputs, config.batch_size)
    tokens = lm.tokens_per_batch(lead)
  # A checkpoint's CI function may be sized from its model; a token toy's
  # is not.
  model = record.token_model if lm.is_lm(config) else None
  ci_config = engine.ci_config(config, target.sites, model)
  terms = engine.loss_terms(config, target.sites, tokens,
                            target.nonlinear_units, lead)
  return Parts(config, record, target, ci_config,
               ci_fns.make_ci_fn(ci_config, target.sites), terms,
               engine.step_config(
                 config, engine.hidden_pass_points(config, target)), lead)


def stream_leads(config: TrainConfig, record: target_record.Target,
                 target: TargetFns) -> dict[str, tuple[int, ...]]:
  """Return each stream's activation lead shape; ValueError for streams the
  target cannot read (a target without token inputs, token ids past its
  vocabulary)."""
  model = record.token_model
  if target.token_labels is None or model is None:
    raise ValueError(f"--target={config.target} takes no token ids; a "
                     "targeted decomposition's streams are token tasks, so "
                     "decompose a language model")
  if streams.vocab_size(config) > model.vocab_size:
    raise ValueError(
      f"the streams' tasks use {streams.vocab_size(config)} token ids and "
      f"--target={config.target} has a vocabulary of {model.vocab_size}; "
      "decompose the task's own model (--target=addsub, or its exported "
      "directory)")
  return {s: tuple(target.batch_lead_shape(b))
          for s, b in streams.batch_shapes(config).items()}


def abstract_state(p: Parts, pads: slots.SlotPads = slots.NO_PADS
                   ) -> step_records.TrainState:
  """Return the shapes of the run's initial state, its V/U masters held
  with `pads` (`core.slots`)."""
  keys = keys_of(p.config.seed)
  init = train_step.make_init(p.terms, p.step_config)
  return jax.eval_shape(
    lambda: init(slots.pad_components(
      sites_lib.init_components(keys.components, p.target.sites),
      p.target.sites, pads), p.ci_fn.init(keys.ci), keys.run, p.lead_shape))


def plan(p: Parts, weights: Any,
         placement: shardings_lib.Placement | None = None,
         data: token_data.TokenData | streams.StreamData | None = None
         ) -> Plan:
  """Return the run planned on `placement` (None: unplaced) for frozen
  `weights` (arrays or their shapes), its step built once; with `data` the
  step takes batches read from token files.

  Raises ValueError for rider points the target cannot tap and for
  `--place` layouts that do not tile (`LayoutError`), before anything is
  placed or compiled.
  """
  engine.check_rider_points(p.config, p.target, weights,
                            p.record.sample_inputs(jax.random.key(0), 2))
  pads = slots.NO_PADS
  if placement is not None:
    pads = table_lib.slot_pads(placement.table, dict(placement.mesh.shape))
  state = abstract_state(p, pads)
  shardings, fallbacks = None, ()
  constrain, sample = step_records.no_constraint, p.sample_inputs
  if placement is not None:
    mesh, table, _ = placement
    fallbacks = shardings_lib.fallbacks(
      table, dict(mesh.shape), state, weights, p.lead_shape,
      jax.eval_shape(p.target.frozen_stacks, weights), p.target.sites)
    shardings = shardings_lib.step_shardings(
      table, mesh, state, weights, p.lead_shape, example_batch(p, data))
    constrain = shardings_lib.make_constrain(table, mesh, p.lead_shape)
    sample = shardings_lib.constrained_sampler(p.sample_inputs, constrain)
  step = train_step.make_train_step(
    p.target, p.ci_fn, p.terms, p.step_config,
    sample_inputs=p.sample_inputs if data is None else None,
    shardings=shardings, constrain=constrain)
  return Plan(p, step, state, shardings, constrain, sample, fallbacks, data,
              pads)


def example_batch(p: Parts, data) -> Any:
  """Return the shapes of the batch the step takes (None: it samples its
  own)."""
  if data is None:
    return None
  if isinstance(data, streams.StreamData):
    return streams.batch_shapes(p.config)
  return token_data.example_batch(data)


def warm_components(config: TrainConfig, target: TargetFns, weights: Any,
                    key: jax.Array, warm: bool,
                    between: warmup_lib.Between | None = None):
  """Return the initial components, after the faithfulness warmup when
  `warm`, and the warmup's losses (none without it); `between` is the
  host's look between its chunks (`core.warmup`)."""
  w_stacks = target.frozen_stacks(weights)
  if config.components_init == "projected":
    components = sites_lib.init_components_projected(
      key, target.sites, w_stacks)
  else:
    components = sites_lib.init_components(key, target.sites)
  return warmup_lib.faithfulness_warmup(
    lambda comps, ws: faithfulness.faithfulness_per_kind(ws, comps),
    components, w_stacks, config.faithfulness_warmup_steps if warm else 0,
    config.faithfulness_warmup_lr, config.faithfulness_warmup_weight_decay,
    between)


def start(planned: Plan, weights: Any, restore: Restore | None = None,
          between: warmup_lib.Between | None = None) -> Run:
  """Return the run with its initial state built in place.

  A fresh run's components are warmed up (faithfulness alone) and the
  state built around them, each leaf straight into its shard; with
  `restore` (a resume or fine-tune init) the warmup is skipped and the
  state is read from the checkpoint onto the same shardings. `between`
  runs between chunks of the warmup (it may end the launch there).
  """
  p, placed = planned.parts, planned.shardings
  keys = keys_of(p.config.seed)
  components, warmup_losses = warm_components(
    p.config, p.target, weights, keys.components, warm=restore is None,
    between=between)
  state_shardings = None if placed is None else placed.state

  def build(comps, ci_params):
    # Components arrive real (fresh) or already padded (a fine-tune init
    # read onto this run's shapes); either way they leave padded.
    return planned.step.init(
      slots.pad_components(comps, p.target.sites, planned.pads), ci_params,
      keys.run, p.lead_shape)

  init = shardings_lib.sharded_init(build, state_shardings)
  state = init(components, p.ci_fn.init(keys.ci))
  if restore is not None:
    state = restore(state, build, state_shardings, p.term_names)
  if placed is not None:
    # Restored leaves are in place already; a fine-tune init's are not.
    state = transfer.put(state, placed.state)
    weights = transfer.put(weights, placed.weights)
  return Run(planned, state, weights, keys.data, warmup_losses)


def build_run(config: TrainConfig, record: target_record.Target,
              target: TargetFns, weights: Any,
              restore: Restore | None = None,
              placement: shardings_lib.Placement | None = None,
              data: token_data.TokenData | streams.StreamData | None = None
              ) -> Run:
  """Return the ready-to-step run of `config` (`parts`, `plan`, `start`)."""
  return start(plan(parts(config, record, target), weights, placement, data),
               weights, restore)
