"""GLU LM target: forward starts, taps, three stacks, masks, a train step."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, optim, step_records, step_streams, train_step
from decompax.core import masks as masks_lib
from decompax.core import sites as sites_lib
from decompax.core.schedules import Schedule
from decompax.losses import faithfulness, recon
from decompax.losses import loss_terms as terms
from decompax.targets import (
  glu_arrays, glu_config, glu_sites, glu_target,
  glu_weights)

CONFIG = glu_config.GluConfig(
  n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=24,
  vocab_size=32, rope_theta=500000.0, rms_eps=1e-5, tied=False,
  qk_norm=True, rope_scaling=glu_config.RopeScaling(8.0, 1.0, 4.0, 16))
B, T, C = 2, 6, 5
# Span [1, 3): q, gate, up, down on both layers (scanned in place) and k on
# layer 1 only (gathered to span layout, inactive on layer 2).
NAMES = tuple(glu_weights.site_name(i, r) for i in (1, 2)
              for r in ("q", "gate", "up", "down")) + (
  glu_weights.site_name(1, "k"),)
SPLIT = 1


def _arrays(config=CONFIG):
  """Return random host weights (numpy: no compile per random op)."""
  rng = np.random.default_rng(0)
  out = {}
  for name, shape in glu_arrays.layer_array_shapes(config).items():
    scale = 1 / np.sqrt(shape[0]) if len(shape) == 2 else 0.1
    value = rng.standard_normal((config.n_layers, *shape)) * scale
    out[name] = (value + (len(shape) == 1)).astype(np.float32)
  for name in ("embed", "head")[:1 if config.tied else 2]:
    out[name] = rng.standard_normal(
      (config.vocab_size, config.d_model)).astype(np.float32)
  out["norm"] = np.ones(config.d_model, np.float32)
  return out


@pytest.fixture(scope="module")
def model():
  sites = glu_sites.site_specs(CONFIG, NAMES, C)
  fns = glu_target.target_fns(CONFIG, sites)
  seg = glu_sites.span_segments(CONFIG, sites)
  weights = glu_arrays.weights_from_arrays(_arrays(), CONFIG, seg)
  components = jax.jit(sites_lib.init_components, static_argnums=1)(
    jax.random.key(2), sites)
  tokens = jnp.asarray(np.random.default_rng(3).integers(
    0, CONFIG.vocab_size, (B, T)), jnp.int32)
  return fns, weights, components, tokens


def _stochastic_masks(fns, key, routing="uniform_k"):
  """Return stochastic masks of every site from random CI, with delta."""
  ci = {s.name: jax.random.uniform(jax.random.fold_in(key, i), (B, T, s.c))
        for i, s in enumerate(fns.sites)}
  entry = recon.all_sites_plan(fns.sites, routing)[0]
  index = sites_lib.draw_paths(fns.sites)
  routes = recon.entry_routes(jax.random.fold_in(key, 99), entry, (B, T))
  return masks_lib.stochastic_site_masks(key, entry.live_sites, ci, index,
                                         True, "continuous", routes)


def test_site_table_and_kinds(model):
  fns = model[0]
  by_name = {s.name: s for s in fns.sites}
  assert [s.name for s in fns.sites][:4] == [
    "layers.1.self_attn.q_proj", "layers.1.self_attn.k_proj",
    "layers.1.mlp.gate_proj", "layers.1.mlp.up_proj"]
  assert by_name["layers.2.mlp.gate_proj"].kind == "gate_proj"
  assert by_name["layers.2.mlp.gate_proj"].row == 1
  assert (by_name["layers.1.self_attn.k_proj"].d_in,
          by_name["layers.1.self_attn.k_proj"].d_out) == (16, 16)
  assert (by_name["layers.1.mlp.down_proj"].d_in,
          by_name["layers.1.mlp.down_proj"].d_out) == (24, 16)
  assert fns.start_taps == (f"resid.{SPLIT}",)
  assert fns.batch_lead_shape(model[3]) == (B, T)


def test_segment_bounds_equal_stored_stack_bounds(model):  # I41
  fns, weights, _, tokens = model
  assert weights.prefix.ln1.shape[0] == SPLIT
  assert weights.span.ln1.shape[0] == 2
  assert weights.tail.ln1.shape[0] == CONFIG.n_layers - 3
  other = glu_arrays.weights_from_arrays(
    _arrays(), CONFIG, glu_weights.Segments(CONFIG.n_layers, 0, 2))
  with pytest.raises(ValueError, match="I41"):
    fns.clean_forward(other, tokens, ())


SLICING = ("slice", "dynamic_slice", "gather")
# Ops whose output is the same stored stack, recast or reshaped.
SAME_STACK = ("convert_element_type", "reshape", "transpose", "squeeze",
              "expand_dims", "copy", "copy_p", "sharding_constraint",
              "reshard", "mesh_cast", "pvary", "optimization_barrier",
              "stop_gradient")
# Calls whose jaxpr takes the call's operands and returns its results 1:1.
ONE_TO_ONE = ("jit", "pjit", "remat", "remat2", "checkpoint",
              "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_jvp_call",
              "closed_call", "core_call", "custom_lin")


def _sub_jaxprs(eqn):
  """Yield `(param name, jaxpr)` for every jaxpr among `eqn`'s params."""
  for key, value in eqn.params.items():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(sub, jax.extend.core.ClosedJaxpr):
        sub = sub.jaxpr
      if isinstance(sub, jax.extend.core.Jaxpr):
        yield key, sub


def _inner_operands(eqn, key):
  """Return the operands (outer vars) of the sub-jaxpr `key` of `eqn`, in the
  order of its invars."""
  outer = list(eqn.invars)
  prim, params = eqn.primitive.name, eqn.params
  if prim == "while":
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    consts = outer[:nc] if key == "cond_jaxpr" else outer[nc:nc + nb]
    return consts + outer[nc + nb:]
  if prim == "cond":
    return outer[1:]
  return outer


def stack_reads(jaxpr, names):
  """Return `(primitive, stacks read)` of every slice, dynamic slice and
  gather of a named stack in `jaxpr` and, recursively, in every jaxpr nested
  in it (jit, scan, remat, custom_vjp, cond, while bodies), following each
  named input through the call boundaries and through recasts and reshapes."""
  names = dict(names)
  found = []
  for eqn in jaxpr.eqns:
    prim = eqn.primitive.name
    named = {names[v] for v in eqn.invars
             if isinstance(v, jax.extend.core.Var) and v in names}
    if prim in SLICING and named:
      found.append((prim, named))
    if prim in SAME_STACK and len(named) == 1 and len(eqn.outvars) == 1:
      names[eqn.outvars[0]] = named.pop()
    for key, sub in _sub_jaxprs(eqn):
      operands = _inner_operands(eqn, key)
      assert len(operands) == len(sub.invars), f"unhandled {prim}"
      # A scan's `xs` arrive in its body as one row per iteration: rows of
      # a stack scanned in place are no cut, so only whole values keep
      # their name.
      inner = {v: names[o] for v, o in zip(sub.invars, operands)
               if isinstance(o, jax.extend.core.Var) and o in names
               and o.aval.shape == v.aval.shape}
      found.extend(stack_reads(sub, inner))
      if prim in ONE_TO_ONE:
        for outer_v, inner_v in zip(eqn.outvars, sub.outvars):
          if isinstance(inner_v, jax.extend.core.Var) and inner_v in inner:
            names[outer_v] = inner[inner_v]
  return found


def _weight_names(closed, weights):
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(weights)[0]]
  return dict(zip(closed.jaxpr.invars, paths))


def test_no_forward_slices_a_stored_stack(model):  # I41
  fns, weights, components, tokens = model

  def step(w):
    masks = _stochastic_masks(fns, jax.random.key(4))
    _, taps = fns.clean_forward(w, tokens, fns.start_taps)
    stacks = fns.frozen_stacks(w)
    return (fns.masked_forward_taps(w, components, tokens, masks, taps, ()),
            stacks)

  closed = jax.make_jaxpr(step)(weights)
  reads = stack_reads(closed.jaxpr, _weight_names(closed, weights))
  # Only the k kind, whose rows are not the span's layers, gathers (its one
  # row), and the embedding looks up tokens; every other stack is read as a
  # whole-leaf scan input, at every depth.
  assert {n for _, named in reads for n in named} == {".span.k", ".embed"}
  # Kinds covering the span are the stored leaf itself, not a copy.
  assert fns.frozen_stacks(weights)["gate_proj"] is weights.span.gate


def _custom_vjp_rows(stack):
  @jax.custom_vjp
  def rows(w):
    return w[1:3]

  rows.defvjp(lambda w: (w[1:3], None), lambda _, g: (jnp.zeros((4, 2)),))
  return rows(stack)


@pytest.mark.parametrize("cut", [
  lambda w: w.astype(jnp.bfloat16)[1:3],
  lambda w: jax.jit(lambda v: v[1:3])(w),
  lambda w: jax.checkpoint(lambda v: jnp.sin(v[1:3]))(w),
  lambda w: jax.jit(lambda v: jax.checkpoint(lambda u: u[1:3])(v))(w),
  lambda w: jax.lax.scan(
    lambda c, i: (c + jax.lax.dynamic_slice_in_dim(w, i, 2)[0], None),
    jnp.zeros(2), jnp.arange(2))[0],
  lambda w: jax.lax.cond(True, lambda v: v[1:3], lambda v: v[:2], w),
  lambda w: jax.lax.while_loop(
    lambda c: c[0] < 2,
    lambda c: (c[0] + 1, c[1] + jax.lax.dynamic_slice_in_dim(w, c[0], 2)[0]),
    (0, jnp.zeros(2)))[1],
  _custom_vjp_rows,
  lambda w: jax.jit(lambda v: v)(w)[1:3],
], ids=["recast", "jit", "remat", "jit_remat", "scan_const", "cond", "while",
        "custom_vjp", "returned_by_jit"])
def test_stack_reads_sees_slices_nested_in_sub_jaxprs(cut):
  weights = {"span": {"gate": jnp.ones((4, 2))}}
  closed = jax.make_jaxpr(lambda w: cut(w["span"]["gate"]))(weights)
  reads = stack_reads(closed.jaxpr, _weight_names(closed, weights))
  assert any(named == {"['span']['gate']"} for _, named in reads), reads
  # A stack scanned as `xs` is consumed row by row, which is no cut.
  closed = jax.make_jaxpr(lambda w: jax.lax.scan(
    lambda c, row: (c + row[:1], None), jnp.zeros(1),
    w["span"]["gate"])[0])(weights)
  assert stack_reads(closed.jaxpr, _weight_names(closed, weights)) == []


@pytest.fixture(scope="module")
def clean_passes(model):
  fns, weights, _, tokens = model
  every = glu_weights.all_tap_keys(CONFIG)
  run = jax.jit(fns.clean_forward, static_argnums=2)
  return run(weights, tokens, ()), run(weights, tokens, every), run


def test_fused_clean_pass_equals_output_only_forward(model, clean_passes):
  (plain, none), (logits, taps), run = clean_passes  # I29
  assert none == {}
  np.testing.assert_array_equal(plain, logits)
  fns, weights, _, tokens = model
  for keys in (("resid.2",), ("layers.1.mlp.up_proj",),
               ("layers.0.mlp.up_proj", "layers.3.mlp.down_proj.out")):
    few_logits, few = run(weights, tokens, keys)
    np.testing.assert_array_equal(few_logits, plain)
    for k in keys:
      np.testing.assert_array_equal(few[k], taps[k])


def test_taps_stop_at_the_deepest_tapped_layer(model):  # SPEC §3.4
  fns, weights, _, tokens = model

  def scan_lengths(keys):
    jaxpr = jax.make_jaxpr(fns.clean_forward, static_argnums=2)(
      weights, tokens, keys)
    return sorted(e.params["length"] for e in jaxpr.eqns
                  if e.primitive.name == "scan")

  # Prefix [0, 1), span [1, 3), tail [3, 4): a tap at layer 1 leaves the
  # span's second layer to a scan of its own that emits nothing.
  assert scan_lengths(("layers.1.mlp.up_proj",)) == [1, 1, 1, 1]
  assert scan_lengths(("layers.2.mlp.up_proj",)) == [1, 1, 2]
  jaxpr = jax.make_jaxpr(fns.clean_forward, static_argnums=2)(
    weights, tokens, ("layers.1.mlp.up_proj",))
  emitted = [v.aval.shape for e in jaxpr.eqns if e.primitive.name == "scan"
             for v in e.outvars[1:]]
  assert emitted == [(1, B, T, CONFIG.d_model)]


def test_taps_are_the_residuals_and_site_activations(clean_passes):
  _, (_, taps) = clean_passes[:2]
  for i in range(CONFIG.n_layers):
    o = taps[f"{glu_weights.site_name(i, 'o')}.out"]
    down = taps[f"{glu_weights.site_name(i, 'down')}.out"]
    np.testing.assert_allclose(taps[f"resid.{i + 1}"],
                               taps[f"resid.{i}"] + o + down, atol=1e-5)
    np.testing.assert_array_equal(taps[glu_weights.site_name(i, "gate")],
                                  taps[glu_weights.site_name(i, "up")])


def test_unknown_tap_is_refused(model):
  fns, weights, _, tokens = model
  for key in ("resid.5", "layers.4.mlp.up_proj", "mlp.up"):
    with pytest.raises(ValueError, match="unknown tap key"):
      fns.clean_forward(weights, tokens, (key,))


@pytest.fixture(scope="module")
def starts(model):
  """Masked forwards from the prefix residual and from the tokens, in one
  jitted function, for deterministic and stochastic masks."""
  fns, weights, components, tokens = model
  wanted = tuple(f"{n}.out" for n in NAMES) + ("resid.3", "resid.4")

  @jax.jit
  def run(key):
    _, taps = fns.clean_forward(weights, tokens, fns.start_taps)
    stochastic = _stochastic_masks(fns, key)
    constant = {s.name: masks_lib.SiteMask(jnp.full((B, T, s.c), 0.5))
                for s in fns.sites}
    out = {}
    for name, masks in (("stochastic", stochastic), ("constant", constant)):
      out[name] = (
        fns.masked_forward_taps(weights, components, tokens, masks, taps,
                                wanted),
        fns.masked_forward_taps(weights, components, tokens, masks, {},
                                wanted))
    return out

  return run(jax.random.key(5))


@pytest.mark.parametrize("masks", ["stochastic", "constant"])
def test_prefix_residual_start_equals_input_start(starts, masks):  # I27
  (from_resid, from_tokens) = starts[masks]
  np.testing.assert_array_equal(from_resid[0], from_tokens[0])
  for key in from_tokens[1]:
    np.testing.assert_array_equal(from_resid[1][key], from_tokens[1][key])


def test_prefix_sharing_off_reruns_the_prefix_to_the_same_loss(model):  # I27
  fns, weights, components, tokens = model
  off = glu_target.target_fns(CONFIG, fns.sites, prefix_sharing=False)
  assert fns.start_taps and off.start_taps == ()
  # A wrong boundary proves the off variant never reads the clean taps.
  wrong = {f"resid.{SPLIT}": jnp.ones((B, T, CONFIG.d_model))}

  @jax.jit
  def run(key):
    clean, taps = fns.clean_forward(weights, tokens, fns.start_taps)
    masks = _stochastic_masks(fns, key)
    shared = fns.masked_forward_taps(weights, components, tokens, masks, taps,
                                     ())[0]
    rerun = off.masked_forward_taps(weights, components, tokens, masks, wrong,
                                    ())[0]
    return (shared, rerun, fns.divergence(shared, clean),
            off.divergence(rerun, clean))

  shared, rerun, shared_loss, rerun_loss = run(jax.random.key(7))
  assert float(shared_loss) > 1e-4
  # SPEC §3.5 D5: a differently compiled start agrees within 2e-5 abs.
  np.testing.assert_allclose(rerun_loss, shared_loss, rtol=0, atol=2e-5)
  np.testing.assert_allclose(rerun, shared, rtol=1e-5, atol=2e-5)


def test_masks_change_the_output(starts, clean_passes):
  plain = clean_passes[0][0]
  assert float(jnp.max(jnp.abs(starts["stochastic"][1][0] - plain))) > 1e-3


def test_residual_start_serves_its_block_and_refuses_below(model):  # I28
  fns, weights, components, tokens = model
  start = jnp.asarray(np.random.default_rng(6).standard_normal(
    (B, T, CONFIG.d_model)), jnp.float32)
  clean_taps = {f"resid.{SPLIT}": start}
  _, taps = jax.jit(fns.masked_forward_taps, static_argnums=5)(
    weights, components, tokens, {}, clean_taps, (f"resid.{SPLIT}",))
  np.testing.assert_array_equal(taps[f"resid.{SPLIT}"], start)
  for below in ("resid.0", glu_weights.site_name(0, "gate"),
                f"{glu_weights.site_name(0, 'down')}.out"):
    with pytest.raises(ValueError, match="I28"):
      fns.masked_forward_taps(weights, components, tokens, {}, clean_taps,
                              (below,))


def test_no_live_site_is_the_clean_forward_bit_for_bit(model):  # I2
  fns, weights, components, tokens = model
  wanted = tuple(f"{n}.out" for n in NAMES)

  @jax.jit
  def run():
    clean, taps = fns.clean_forward(weights, tokens,
                                    (*fns.start_taps, *wanted))
    masked, masked_taps = fns.masked_forward_taps(
      weights, components, tokens, {}, taps, wanted)
    return clean, taps, masked, masked_taps

  clean, taps, masked, masked_taps = run()
  np.testing.assert_array_equal(masked, clean)
  for key in wanted:
    np.testing.assert_array_equal(masked_taps[key], taps[key])


def test_exact_components_with_unit_masks_reproduce_the_model(model):  # I3
  fns, weights, _, tokens = model
  names = (glu_weights.site_name(1, "k"), glu_weights.site_name(2, "down"))
  specs = glu_sites.site_specs(CONFIG, names, 16)
  exact_fns = glu_target.target_fns(CONFIG, specs)
  eye = jnp.eye(16)[None]
  exact = {"k_proj": sites_lib.Factors(weights.span.k[:1], eye),
           "down_proj": sites_lib.Factors(weights.span.down[1:], eye)}
  masks = {s.name: masks_lib.SiteMask(jnp.ones((B, T, s.c))) for s in specs}

  @jax.jit
  def run():
    return (fns.clean_forward(weights, tokens, ())[0],
            exact_fns.masked_forward(weights, exact, tokens, masks))

  clean, masked = run()
  np.testing.assert_allclose(masked, clean, atol=1e-5)
  # The decomposed path is the one that ran: masking one component (one
  # output unit of k) moves the logits. Its rounding alone is no evidence,
  # since a compiler may reproduce the clean path bit for bit.
  k_site = specs[0]
  one_off = jnp.ones((B, T, k_site.c)).at[..., 0].set(0.0)
  dropped = {**masks, k_site.name: masks_lib.SiteMask(one_off)}
  moved = jax.jit(lambda: exact_fns.masked_forward(weights, exact, tokens,
                                                   dropped))()
  assert float(jnp.max(jnp.abs(moved - clean))) > 1e-3
  assert faithfulness.faithfulness_per_kind(
    exact_fns.frozen_stacks(weights), exact) < 1e-12


def test_a_site_live_on_one_span_layer_matches_its_own_span(model):
  # gate is live on layer 2 only: layer 1 of the span runs frozen through
  # `where`, which must equal a model whose span is layer 2 alone.
  fns, weights, components, tokens = model
  name = glu_weights.site_name(2, "gate")
  rng = np.random.default_rng(7)
  mask = {name: masks_lib.SiteMask(
    jnp.asarray(rng.uniform(size=(B, T, C)), jnp.float32),
    jnp.asarray(rng.uniform(size=(B, T)), jnp.float32))}
  (spec,) = glu_sites.site_specs(CONFIG, (name,), C)
  narrow_fns = glu_target.target_fns(CONFIG, (spec,))
  narrow_weights = glu_arrays.weights_from_arrays(
    _arrays(), CONFIG, glu_weights.Segments(CONFIG.n_layers, 2, 3))
  g = components["gate_proj"]

  @jax.jit
  def run():
    return (fns.masked_forward(weights, components, tokens, mask),
            narrow_fns.masked_forward(
              narrow_weights,
              {"gate_proj": sites_lib.Factors(g.v[1:], g.u[1:])}, tokens,
              mask))

  wide, narrow = run()
  np.testing.assert_allclose(wide, narrow, atol=1e-5)


def test_frozen_stacks_and_units(model):
  fns, weights, _, _ = model
  stacks = fns.frozen_stacks(weights)
  assert stacks["k_proj"].shape == (1, 16, 16)
  np.testing.assert_array_equal(stacks["k_proj"][0], weights.span.k[0])
  units = fns.nonlinear_units
  assert units[glu_weights.site_name(1, "gate")].kind == "neuron"
  assert units[glu_weights.site_name(1, "gate")].n_units == CONFIG.d_ff
  assert units[glu_weights.site_name(1, "q")].n_units == CONFIG.n_heads
  k = units[glu_weights.site_name(1, "k")]
  assert (k.kind, k.n_units, k.multiplicity) == ("attention_head", 2, 2.0)
  assert glu_weights.site_name(1, "down") not in units


def test_faithfulness_has_one_dot_per_kind(model):
  fns, weights, components, _ = model
  fn = jax.jit(lambda w, c: faithfulness.faithfulness_per_kind(
    fns.frozen_stacks(w), c))
  hlo = fn.lower(weights, components).compile().as_text()
  dots = [line for line in hlo.splitlines() if " dot(" in line]
  assert len(dots) == len(components)


def test_train_step_runs_and_changes_the_decomposition(model):
  # Two sites (a one-layer span in mid-model) keep the step's compile short.
  _, _, _, tokens = model
  names = (glu_weights.site_name(2, "q"), glu_weights.site_name(2, "down"))
  fns = glu_target.target_fns(CONFIG, glu_sites.site_specs(CONFIG, names, C))
  weights = glu_arrays.weights_from_arrays(
    _arrays(), CONFIG, glu_weights.Segments(CONFIG.n_layers, 2, 3))
  components = jax.jit(sites_lib.init_components, static_argnums=1)(
    jax.random.key(2), fns.sites)
  ci_fn = ci_fns.make_ci_fn(ci_fns.CIConfig("vector_mlp", (4,)), fns.sites)
  plan = recon.all_sites_plan(fns.sites, "uniform_k")
  loss_terms = (
    terms.faithfulness_term(1.0),
    terms.importance_minimality_term(1e-3, 1.0),
    terms.stochastic_recon_term("stochastic_recon", 1.0, plan, True))
  adam = optim.AdamWConfig(Schedule(1e-2))
  built = train_step.make_train_step(
    fns, ci_fn, loss_terms, step_records.StepConfig(3, adam, adam),
    sample_inputs=lambda key: jax.random.randint(key, (B, T), 0, 32))
  state = built.init(components, ci_fn.init(jax.random.key(12)),
                     jax.random.key(13), (B, T))
  assert step_streams.clean_tap_keys(ci_fn, fns, loss_terms)[-1] == "resid.2"
  start = jax.tree.map(np.asarray, state.components)
  for _ in range(2):
    state, metrics = built.step(state, weights, jax.random.key(14))
  assert all(np.isfinite(float(v)) for v in metrics.values())
  assert float(metrics["loss/stochastic_recon"]) > 0
  moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))),
                       start, jax.device_get(state.components))
  assert min(jax.tree.leaves(moved)) > 0


def test_inv_freq_llama3_bands():
  # Wavelengths 6.3, 20, 63, 199, ... with bands split at 16 and 64.
  scaling = glu_config.RopeScaling(8.0, 1.0, 4.0, 64)
  config = dataclasses.replace(CONFIG, head_dim=16, rope_theta=1e4,
                               rope_scaling=scaling)
  freq = glu_config.inv_freq(config)
  plain = glu_config.inv_freq(dataclasses.replace(config, rope_scaling=None))
  wavelen = 2 * np.pi / plain
  high, low = wavelen < 16, wavelen > 64
  mid = ~high & ~low
  assert high.sum() == 1 and mid.sum() == 2 and low.sum() == 5
  np.testing.assert_array_equal(freq[high], plain[high])
  np.testing.assert_allclose(freq[low], plain[low] / 8, rtol=1e-6)
  assert np.all(freq[mid] < plain[mid]) and np.all(freq[mid] > plain[mid] / 8)


def test_one_role_in_two_kinds_runs_each_on_its_layer(model):
  # up at layer 0 with C 24 and at layer 1 with C 25: two kinds of one role,
  # each active on its own layer of the span [0, 2). Exact factors (the
  # second padded with a zero component) reproduce the model.
  tokens = model[3]
  names = (glu_weights.site_name(0, "up"), glu_weights.site_name(1, "up"))
  specs = glu_sites.site_specs(CONFIG, names, {names[0]: 24, names[1]: 25})
  fns = glu_target.target_fns(CONFIG, specs)
  weights = glu_arrays.weights_from_arrays(
    _arrays(), CONFIG, glu_weights.Segments(CONFIG.n_layers, 0, 2))
  up = weights.span.up
  exact = {
    "up_proj.c24": sites_lib.Factors(up[:1], jnp.eye(24)[None]),
    "up_proj.c25": sites_lib.Factors(
      jnp.pad(up[1:], ((0, 0), (0, 0), (0, 1))),
      jnp.eye(25, 24)[None])}
  masks = {s.name: masks_lib.SiteMask(jnp.ones((B, T, s.c)))
           for s in specs}

  @jax.jit
  def run():
    return (fns.clean_forward(weights, tokens, ())[0],
            fns.masked_forward(weights, exact, tokens, masks),
            fns.masked_forward(weights, exact, tokens, {names[1]: masks[
              names[1]]._replace(mask=jnp.zeros((B, T, 25)))}))

  clean, masked, ablated = run()
  np.testing.assert_allclose(masked, clean, atol=1e-5)
  assert float(jnp.max(jnp.abs(ablated - clean))) > 1e-2


def test_the_transformer_ci_reads_each_decomposed_block_once():  # SPEC §4.3
  names = (glu_weights.site_name(1, "down"), glu_weights.site_name(0, "q"),
           glu_weights.site_name(1, "gate"))
  sites = glu_sites.site_specs(CONFIG, names, 4)
  chunks, widths = glu_sites.ci_chunks(CONFIG, sites)
  assert [(c.input_taps, c.output_sites) for c in chunks] == [
    (("resid.0",), (glu_weights.site_name(0, "q"),)),
    (("resid.1",), (glu_weights.site_name(1, "gate"),
                    glu_weights.site_name(1, "down")))]
  assert widths == (("resid.0", CONFIG.d_model), ("resid.1", CONFIG.d_model))
  toy_site = sites_lib.SiteSpec("linear1", "linear1", 0, 2, 2, 4)
  with pytest.raises(ValueError, match="'linear1' is not layers.<i>"):
    glu_sites.ci_chunks(CONFIG, (toy_site,))
