"""Chunkwise transformer CI function (SPEC §4.3, I7, I8)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decompax.core import ci_fns, ci_transformer as ct, optim, train_step
from decompax.core import step_records
from decompax.core import sites as sites_lib
from decompax.core.schedules import Schedule
from decompax.core.masks import SiteMask

D = 8  # width of the residual taps
B, T = 2, 5
# Two "blocks", each with a query-like and an MLP-like site of different C,
# so a chunk's output slots have distinct widths.
SITES = (
  sites_lib.SiteSpec("b0.q", "q", 0, D, D, 3),
  sites_lib.SiteSpec("b0.up", "up", 0, D, 12, 5),
  sites_lib.SiteSpec("b1.q", "q", 1, D, D, 3),
  sites_lib.SiteSpec("b1.up", "up", 1, D, 12, 5),
)
CHUNKS = ct.chunks_by_tap(SITES, lambda s: f"resid.{s.name[1]}")
WIDTHS = (("resid.0", D), ("resid.1", D))


def _config(**overrides):
  fields = dict(chunks=CHUNKS, tap_widths=WIDTHS, d_model=8, n_blocks=2,
                n_heads=4, n_kv_heads=2, d_mlp=16)
  return ct.TransformerCIConfig(**(fields | overrides))


def _taps(key=1):
  k0, k1 = jax.random.split(jax.random.key(key))
  return {"resid.0": jax.random.normal(k0, (B, T, D)),
          "resid.1": jax.random.normal(k1, (B, T, D))}


@pytest.fixture(scope="module")
def built():
  config = _config()
  fn = ci_fns.make_ci_fn(ci_fns.CIConfig("transformer", transformer=config),
                         SITES)
  params = jax.jit(fn.init)(jax.random.key(0))
  return config, fn, params, jax.jit(fn.apply)


def test_i7_outputs_partition_sites_with_shapes_and_taps(built):
  _, fn, params, apply = built
  pre = apply(params, _taps(), None)
  assert list(pre) == [s.name for s in SITES]
  for site in SITES:
    assert pre[site.name].shape == (B, T, site.c)
    assert pre[site.name].dtype == jnp.float32
  assert fn.input_taps == ("resid.0", "resid.1")
  assert CHUNKS == (ct.Chunk(("resid.0",), ("b0.q", "b0.up")),
                    ct.Chunk(("resid.1",), ("b1.q", "b1.up")))
  leaves = jax.tree.leaves(params)
  assert all(leaf.shape[0] == 2 for leaf in leaves)  # one row per chunk


def test_extra_batch_axes_are_flattened_and_restored(built):
  _, _, params, apply = built
  taps = _taps()
  pre = apply(params, taps, None)
  nested = apply(params, {k: v.reshape(1, B, T, D) for k, v in taps.items()},
                 None)
  for name in pre:
    np.testing.assert_array_equal(nested[name][0], pre[name])


@pytest.mark.parametrize("chunks,match", [
  ((ct.Chunk(("resid.0",), ("b0.q", "b0.up")),
    ct.Chunk(("resid.1",), ("b1.up", "b1.q"))), "homogeneous"),
  ((ct.Chunk(("resid.0",), ("b0.q", "b0.up")),
    ct.Chunk(("resid.0", "resid.1"), ("b1.q", "b1.up"))), "homogeneous"),
  ((ct.Chunk(("resid.0",), ("b0.q", "b0.up", "b1.q")),
    ct.Chunk(("resid.1",), ("b1.up",))), "homogeneous"),
  ((ct.Chunk(("resid.0",), ("b0.q", "b0.up")),), "in no chunk"),
  ((ct.Chunk(("resid.0",), ("b0.q", "b0.up", "b1.q")),
    ct.Chunk(("resid.1",), ("b1.q", "b1.up"))), "in two chunks"),
  (CHUNKS + (ct.Chunk(("resid.1",), ("b9.q",)),), "unknown"),
  ((ct.Chunk(("resid.0",), ("b0.q", "b0.up")),
    ct.Chunk(("resid.7",), ("b1.q", "b1.up"))), "no width"),
])
def test_i7_bad_chunks_are_refused_before_init(chunks, match):
  config = ci_fns.CIConfig("transformer", transformer=_config(chunks=chunks))
  with pytest.raises(ValueError, match=match) as error:
    ci_fns.make_ci_fn(config, SITES)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("overrides,match", [
  (dict(attention="flash"), "unknown CI attention"),
  (dict(n_heads=3), "even integer head dim"),
  (dict(d_model=12, n_heads=2, n_kv_heads=4), "multiple of n_kv_heads"),
  (dict(n_blocks=-1), "n_blocks"),
  (dict(d_mlp=0), "d_mlp"),
])
def test_config_refuses_bad_sizes(overrides, match):
  with pytest.raises(ValueError, match=match):
    _config(**overrides)


def _numpy_chunk(p, u, config):
  # Independent per-head, per-position definition of one chunk (§4.3).
  def rms(x):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 2.0**-23)

  def gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))

  hd, heads, kv = config.head_dim, config.n_heads, config.kv_heads
  inv_freq = 10000.0 ** (-2 * np.arange(hd // 2) / hd)
  pos = np.arange(u.shape[1])[:, None] * inv_freq
  cos, sin = (np.concatenate([f(pos)] * 2, -1) for f in (np.cos, np.sin))

  def rope(x):  # [b, t, hd]
    half = hd // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin

  h = u @ p.w_in + p.b_in
  for i in range(config.n_blocks):
    x = rms(h)
    q, k, v = x @ p.blocks.wq[i], x @ p.blocks.wk[i], x @ p.blocks.wv[i]
    heads_out = []
    for n in range(heads):
      j = n // (heads // kv)
      qn = rope(q[..., n * hd:(n + 1) * hd])
      kj = rope(k[..., j * hd:(j + 1) * hd])
      logits = np.einsum("bqh,bsh->bqs", qn, kj) / math.sqrt(hd)
      w = np.exp(logits - logits.max(-1, keepdims=True))
      w /= w.sum(-1, keepdims=True)
      heads_out.append(w @ v[..., j * hd:(j + 1) * hd])
    h = h + np.concatenate(heads_out, -1) @ p.blocks.wo[i]
    h = h + gelu(rms(h) @ p.blocks.w1[i] + p.blocks.b1[i]) @ p.blocks.w2[i]
    h = h + p.blocks.b2[i]
  return h @ p.w_out + p.b_out


def _chunk(params, i):
  return jax.tree.map(lambda leaf: np.asarray(leaf[i], np.float64), params)


def _assert_matches_numpy(config, params, apply):
  taps = _taps()
  pre = apply(params, taps, None)
  for i, chunk in enumerate(CHUNKS):
    x = np.asarray(taps[chunk.input_taps[0]], np.float64)
    u = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 2.0**-23)
    want = _numpy_chunk(_chunk(params, i), u, config)
    got = np.concatenate([pre[n] for n in chunk.output_sites], -1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_matches_a_per_head_numpy_definition(built):
  config, _, params, apply = built
  _assert_matches_numpy(config, params, apply)


def test_vmap_over_chunks_equals_a_loop(built):
  config, _, params, apply = built
  taps = _taps()
  pre = apply(params, taps, None)
  plan = ct.plan_chunks(config, SITES)
  u = ct.chunk_inputs(plan, taps)
  inv_freq = ct.rope_inv_freq(config.head_dim)
  for i, chunk in enumerate(CHUNKS):
    one = jax.tree.map(lambda leaf: leaf[i], params)
    trunk = jax.jit(ct.chunk_trunk, static_argnums=2)(
      one, u[i], config, inv_freq)
    want = trunk @ one.w_out + one.b_out
    got = jnp.concatenate([pre[n] for n in chunk.output_sites], -1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_chunks_are_independent(built):
  _, _, params, apply = built
  taps = _taps()
  pre = apply(params, taps, None)
  bumped = jax.tree.map(lambda leaf: leaf.at[0].add(0.5), params)
  after = apply(bumped, taps, None)
  for name in ("b0.q", "b0.up"):
    assert not np.allclose(after[name], pre[name])
  for name in ("b1.q", "b1.up"):
    np.testing.assert_array_equal(after[name], pre[name])
  grads = jax.jit(jax.grad(lambda p: sum(jnp.sum(apply(p, taps, None)[n])
                                         for n in ("b1.q", "b1.up"))))(params)
  for leaf in jax.tree.leaves(grads):
    assert not np.any(leaf[0]) and np.any(leaf[1])
  moved = dict(taps, **{"resid.0": taps["resid.0"] + 1.0})
  np.testing.assert_array_equal(apply(params, moved, None)["b1.up"],
                                pre["b1.up"])


def test_attention_is_bidirectional(built):
  _, _, params, apply = built
  taps = _taps()
  pre = apply(params, taps, None)
  late = dict(taps, **{"resid.0": taps["resid.0"].at[:, -1].add(1.0)})
  after = apply(params, late, None)
  # Position 0 sees the change at position T-1 ...
  assert not np.allclose(after["b0.up"][:, 0], pre["b0.up"][:, 0])
  # ... but without blocks nothing mixes positions.
  config = _config(n_blocks=0)
  no_blocks = params._replace(
    blocks=jax.tree.map(lambda leaf: leaf[:, :0], params.blocks))
  apply0 = jax.jit(ct.apply, static_argnums=(2, 3))
  plan = ct.plan_chunks(config, SITES)
  before0 = apply0(no_blocks, taps, config, plan)
  after0 = apply0(no_blocks, late, config, plan)
  np.testing.assert_array_equal(after0["b0.up"][:, :-1],
                                before0["b0.up"][:, :-1])


def _with_kv_heads(params, config, n_kv_heads):
  # Fresh k/v projections of the width `n_kv_heads` needs, from numpy so no
  # init has to be compiled again.
  width = (n_kv_heads or config.n_heads) * config.head_dim
  rng = np.random.default_rng(n_kv_heads or 0)
  shape = (*params.blocks.wk.shape[:-1], width)
  wk, wv = (jnp.asarray(rng.uniform(-0.35, 0.35, shape), jnp.float32)
            for _ in range(2))
  return params._replace(blocks=params.blocks._replace(wk=wk, wv=wv))


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
def test_dot_product_attention_matches_reference(built, n_kv_heads):
  config, _, params, _ = built
  params = _with_kv_heads(params, config, n_kv_heads)
  plan = ct.plan_chunks(config, SITES)
  taps = _taps()
  outs = {}
  for attention in ("reference", "xla", "auto"):
    cfg = _config(attention=attention, n_kv_heads=n_kv_heads)
    outs[attention] = jax.jit(ct.apply, static_argnums=(2, 3))(
      params, taps, cfg, plan)
  for impl in ("xla", "auto"):
    for name in outs["reference"]:
      np.testing.assert_allclose(outs[impl][name], outs["reference"][name],
                                 rtol=1e-5, atol=1e-5)


def test_remat_changes_neither_values_nor_grads(built):
  config, _, params, _ = built
  plan = ct.plan_chunks(config, SITES)
  taps = _taps()

  def loss(p, cfg):
    return sum(jnp.sum(jnp.square(v)) for v in ct.apply(p, taps, cfg,
                                                         plan).values())

  value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  plain = value_and_grad(params, config)
  remat = value_and_grad(params, _config(remat=True))
  np.testing.assert_allclose(remat[0], plain[0], rtol=1e-6)
  # Recomputation may reassociate sums; the grads are O(10).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-4),
               remat[1], plain[1])


def test_init_scales_follow_spec():
  config = _config(d_model=64, n_heads=4, n_kv_heads=None, d_mlp=256,
                   n_blocks=1)
  p = jax.jit(ct.init_chunk, static_argnums=(1, 2, 3))(
    jax.random.key(0), config, 128, 96)
  np.testing.assert_allclose(jnp.std(p.w_in), math.sqrt(2 / 128), rtol=0.05)
  np.testing.assert_allclose(jnp.std(p.blocks.w1), math.sqrt(2 / 64),
                             rtol=0.05)
  np.testing.assert_allclose(jnp.std(p.blocks.w2), 1 / 16, rtol=0.05)
  np.testing.assert_allclose(jnp.std(p.w_out), 1 / 8, rtol=0.05)
  bound = 1 / 8
  for w in (p.blocks.wq, p.blocks.wk, p.blocks.wv, p.blocks.wo):
    assert float(jnp.max(jnp.abs(w))) <= bound
    np.testing.assert_allclose(jnp.std(w), bound / math.sqrt(3), rtol=0.05)
  for bias in (p.b_in, p.blocks.b1, p.blocks.b2, p.b_out):
    assert not np.any(bias)


def test_chunk_i_initialises_from_fold_in_key_i(built):
  config, _, params, _ = built
  plan = ct.plan_chunks(config, SITES)
  one = jax.jit(ct.init_chunk, static_argnums=(1, 2, 3))(
    jax.random.fold_in(jax.random.key(0), 1), config, plan.d_u,
    sum(plan.c_slots))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[1], b),
               params, one)


def _field_names(tree):
  return {jax.tree_util.keystr(path)
          for path, _ in jax.tree_util.tree_leaves_with_path(tree)}


def test_i8_inv_freq_is_a_constant_outside_params_and_optimizer(built):
  config, _, params, apply = built
  hd = config.head_dim
  want = 10000.0 ** (-2 * np.arange(hd // 2) / hd)
  np.testing.assert_allclose(ct.rope_inv_freq(hd), want, rtol=1e-6)
  assert not any("freq" in name for name in _field_names(params))
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)
  mu = opt_state[0].mu
  assert _field_names(mu) == _field_names(params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = tx.update(grads, opt_state, params)
  stepped = optax.apply_updates(params, updates)
  # Every trained leaf moved...
  for before, after in zip(jax.tree.leaves(params), jax.tree.leaves(stepped)):
    assert not np.allclose(after, before)
  # ...while the forward still rotates by the fixed frequencies: with the
  # stepped weights it matches the numpy definition, which hard-codes them.
  _assert_matches_numpy(config, stepped, apply)


def test_i8_plugs_into_the_train_step(chain):
  """One real step on the chain target fed `[B, T, d]` inputs, with the
  default chunks: one per site, reading that site's input."""
  target, weights = chain
  config = ct.TransformerCIConfig(d_model=8, n_heads=2, n_blocks=1, d_mlp=8)
  ci = ci_fns.make_ci_fn(ci_fns.CIConfig("transformer", transformer=config),
                         target.sites)
  assert ci.input_taps == ("l0", "l1", "head")

  def recon(ctx, key):
    del key
    out = ctx.masked_forward(
      {s.name: SiteMask(ctx.ci.lower[s.name]) for s in ctx.target.sites})
    return jnp.mean(jnp.square(out - ctx.clean_output))

  built = train_step.make_train_step(
    target, ci, (step_records.simple_term("recon", 1.0, recon),),
    step_records.StepConfig(
        total_steps=4,
        components_opt=optim.AdamWConfig(Schedule(1e-2)),
        ci_opt=optim.AdamWConfig(Schedule(1e-2))))
  components = sites_lib.init_components(jax.random.key(0), target.sites)
  state = built.init(components, jax.jit(ci.init)(jax.random.key(1)),
                     jax.random.key(2))
  before = jax.tree.map(np.asarray, state.ci_params)
  x = jax.random.normal(jax.random.key(3), (B, T, 4))
  new, metrics = built.step(state, weights, x)  # donates `state`
  assert np.isfinite(float(metrics["loss/total"]))
  assert before.w_in.shape == (3, 4, 8)  # three chunks of d_in 4
  assert not np.allclose(new.ci_params.w_in, before.w_in)
  assert jax.tree.structure(new.ci_params) == jax.tree.structure(before)
  assert not any("freq" in name for name in _field_names(new.ci_opt))
