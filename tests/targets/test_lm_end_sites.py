"""The token embedding and the unembedding as sites of a decoder LM
(design §3.7, §9.2): their specs, segments and taps, the masked forward's
semantics (I2, I53), tied heads, and what refuses them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns
from decompax.core import masks as masks_lib
from decompax.core import sites as sites_lib
from decompax.targets import (
  glu_arrays, glu_lm, glu_sites, glu_target, glu_weights)

from .test_glu_lm import CONFIG, _arrays

B, T, C = 2, 6, 5
EMBED, HEAD = glu_weights.EMBED_SITE, glu_weights.HEAD_SITE
TIED = dataclasses.replace(CONFIG, tied=True)
CHOICES = {
  "embed": (EMBED,),
  "head": (HEAD,),
  "both_with_a_layer": (EMBED, "layers.1.mlp.up_proj", HEAD),
  "head_with_a_layer": ("layers.2.self_attn.v_proj", HEAD),
}


def _model(config, names):
  sites = glu_sites.site_specs(config, names, C)
  fns = glu_target.target_fns(config, sites)
  seg = glu_sites.span_segments(config, sites)
  weights = glu_arrays.weights_from_arrays(_arrays(config), config, seg)
  components = sites_lib.init_components(jax.random.key(2), sites)
  tokens = jnp.asarray(np.random.default_rng(3).integers(
    0, config.vocab_size, (B, T)), jnp.int32)
  return fns, weights, components, tokens


def _ones(fns, delta=True):
  return {s.name: masks_lib.SiteMask(
    jnp.ones((B, T, s.c)), jnp.ones((B, T)) if delta else None)
    for s in fns.sites}


def test_names_specs_and_order():
  names = glu_sites.selectable_site_names(CONFIG)
  assert names[0] == EMBED and names[-1] == HEAD
  assert names[1:-1] == glu_sites.all_site_names(CONFIG)
  sites = glu_sites.site_specs(
    CONFIG, (HEAD, "layers.1.mlp.up_proj", EMBED), C)
  assert [s.name for s in sites] == [EMBED, "layers.1.mlp.up_proj", HEAD]
  embed, _, head = sites
  assert (embed.kind, embed.row, embed.d_in, embed.d_out, embed.op) == (
    EMBED, 0, CONFIG.vocab_size, CONFIG.d_model, sites_lib.EMBEDDING)
  assert (head.kind, head.row, head.d_in, head.d_out, head.op) == (
    HEAD, 0, CONFIG.d_model, CONFIG.vocab_size, sites_lib.LINEAR)
  assert len(set(sites_lib.draw_paths(sites).values())) == 3


@pytest.mark.parametrize("names, bounds", [
  ((EMBED,), (0, 0)), ((HEAD,), (4, 4)),
  ((EMBED, "layers.2.mlp.up_proj"), (0, 3)),
  (("layers.2.mlp.up_proj", HEAD), (2, 3))])
def test_the_embedding_starts_the_span_and_the_head_adds_no_layer(
    names, bounds):
  sites = glu_sites.site_specs(CONFIG, names, C)
  seg = glu_sites.span_segments(CONFIG, sites)
  assert (seg.split, seg.tail) == bounds
  fns = glu_target.target_fns(CONFIG, sites)
  # No prefix to share under a decomposed embedding.
  assert fns.start_taps == (() if bounds[0] == 0 else (f"resid.{bounds[0]}",))


def test_the_end_taps_are_the_sites_inputs():
  fns, weights, _, tokens = _model(CONFIG, CHOICES["head"])
  logits, taps = fns.clean_forward(weights, tokens, (EMBED, HEAD))
  np.testing.assert_array_equal(taps[EMBED], tokens)
  np.testing.assert_allclose(glu_lm.head_logits(weights, taps[HEAD]),
                             logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("config", [CONFIG, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("choice", sorted(CHOICES))
def test_unit_masks_with_delta_give_the_clean_forward(config, choice):  # I2
  fns, weights, components, tokens = _model(config, CHOICES[choice])
  clean, taps = fns.clean_forward(weights, tokens, fns.start_taps)
  masked, _ = fns.masked_forward_taps(weights, components, tokens,
                                      _ones(fns), taps, ())
  np.testing.assert_allclose(masked, clean, rtol=1e-5, atol=1e-5)
  # The decomposed path ran: without the delta the random factors alone
  # give other logits.
  alone = fns.masked_forward(weights, components, tokens,
                             _ones(fns, delta=False))
  assert float(jnp.max(jnp.abs(alone - clean))) > 1e-2


def _without(masks, name, c):
  m = masks[name]
  return {**masks, name: m._replace(mask=m.mask.at[..., c].set(0.0))}


def _piece(components, name, c):
  f = components[name]
  return jnp.outer(f.v[0][:, c], f.u[0][c])


@pytest.mark.parametrize("config", [CONFIG, TIED], ids=["untied", "tied"])
def test_zeroing_an_embedding_component_removes_its_piece(config):  # I53
  """Only the lookup loses `V[:, c]·U[c]`; a tied head keeps reading the
  whole table."""
  fns, weights, components, tokens = _model(config, (EMBED,))
  masked = fns.masked_forward(weights, components, tokens,
                              _without(_ones(fns), EMBED, 3))
  want = weights._replace(
    embed=weights.embed - _piece(components, EMBED, 3),
    head=glu_lm.head_matrix(weights))
  np.testing.assert_allclose(masked, fns.clean_forward(want, tokens, ())[0],
                             rtol=1e-5, atol=1e-5)
  clean = fns.clean_forward(weights, tokens, ())[0]
  assert float(jnp.max(jnp.abs(masked - clean))) > 1e-3


@pytest.mark.parametrize("config", [CONFIG, TIED], ids=["untied", "tied"])
def test_zeroing_a_head_component_removes_its_piece(config):
  """`W = headᵀ` loses `V[:, c]·U[c]`; a tied model's lookup keeps the
  whole table."""
  fns, weights, components, tokens = _model(config, (HEAD,))
  clean, taps = fns.clean_forward(weights, tokens, fns.start_taps)
  masked, _ = fns.masked_forward_taps(weights, components, tokens,
                                      _without(_ones(fns), HEAD, 1), taps, ())
  want = weights._replace(
    head=glu_lm.head_matrix(weights) - _piece(components, HEAD, 1).T)
  np.testing.assert_allclose(masked, fns.clean_forward(want, tokens, ())[0],
                             rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(masked - clean))) > 1e-3


def test_a_tied_model_s_two_sites_factor_one_matrix_each_their_way():
  fns, weights, _, _ = _model(TIED, (EMBED, HEAD))
  assert weights.head is None
  stacks = fns.frozen_stacks(weights)
  np.testing.assert_array_equal(stacks[EMBED][0], weights.embed)
  np.testing.assert_array_equal(stacks[HEAD][0], weights.embed.T)


def test_masking_reaches_and_hidden_points():
  sites = glu_sites.site_specs(CONFIG, (EMBED,), C)
  reaches = glu_sites.masking_reaches(CONFIG, sites)
  assert reaches("resid.0") and reaches("layers.0.self_attn.q_proj")
  assert reaches(HEAD) and not reaches(EMBED)
  assert reaches(f"{EMBED}.out") and reaches(f"{HEAD}.out")
  assert glu_sites.hidden_pass_points(CONFIG, sites)[0] == (
    "layers.0.mlp.down_proj.out")
  head = glu_sites.site_specs(CONFIG, (HEAD,), C)
  reaches = glu_sites.masking_reaches(CONFIG, head)
  assert not any(reaches(t) for t in ("resid.4", HEAD, EMBED,
                                      f"{EMBED}.out"))
  assert reaches(f"{HEAD}.out")
  assert glu_sites.hidden_pass_points(CONFIG, head) == ()
  assert glu_sites.nonlinear_units(CONFIG, sites + head) == {}


def test_the_transformer_ci_reads_the_last_residual_for_the_head():
  sites = glu_sites.site_specs(CONFIG, ("layers.1.mlp.up_proj", HEAD), C)
  chunks, taps = glu_sites.ci_chunks(CONFIG, sites)
  assert [c.input_taps for c in chunks] == [("resid.1",), ("resid.4",)]
  assert taps == (("resid.1", CONFIG.d_model), ("resid.4", CONFIG.d_model))


def test_the_mlp_ci_reads_the_embedding_s_rows_and_the_head_s_input():
  fns, weights, components, tokens = _model(CONFIG, (EMBED, HEAD))
  ci = ci_fns.make_ci_fn(ci_fns.CIConfig("site_mlp", (8,)), fns.sites)
  assert ci.input_taps == (EMBED, HEAD)
  _, taps = fns.clean_forward(weights, tokens, ci.input_taps)
  out = ci.apply(ci.init(jax.random.key(0)), taps, components)
  assert {k: v.shape for k, v in out.items()} == {
    EMBED: (B, T, C), HEAD: (B, T, C)}
  with pytest.raises(ValueError, match="embedding sites"):
    ci_fns.make_ci_fn(ci_fns.CIConfig("transformer"), fns.sites)


def test_the_chunked_head_refuses_a_decomposed_head():
  sites = glu_sites.site_specs(CONFIG, (HEAD,), C)
  with pytest.raises(ValueError, match="--output_chunk=0"):
    glu_target.target_fns(CONFIG, sites, output_chunk=4)
  embed = glu_sites.site_specs(CONFIG, (EMBED,), C)
  assert glu_target.target_fns(CONFIG, embed, output_chunk=4).split_head


def test_the_chunked_head_runs_a_decomposed_embedding():
  fns, weights, components, tokens = _model(CONFIG, (EMBED,))
  chunked = glu_target.target_fns(CONFIG, fns.sites, output_chunk=4)
  split = chunked.split_head
  clean_x, taps = split.clean_forward(weights, tokens, ())
  masked_x, _ = split.masked_forward_taps(
    weights, components, tokens, _ones(fns), taps, ())
  np.testing.assert_allclose(masked_x, clean_x, rtol=1e-5, atol=1e-5)


def test_the_end_sites_outputs_are_the_rows_and_the_logits():
  fns, weights, components, tokens = _model(CONFIG, CHOICES["embed"])
  outs = (f"{EMBED}.out", f"{HEAD}.out")
  logits, taps = fns.clean_forward(weights, tokens, outs)
  np.testing.assert_array_equal(taps[f"{EMBED}.out"], weights.embed[tokens])
  np.testing.assert_array_equal(taps[f"{HEAD}.out"], logits)
  masks = _without(_ones(fns), EMBED, 0)
  masked, masked_taps = fns.masked_forward_taps(
    weights, components, tokens, masks, taps, outs)
  np.testing.assert_allclose(
    masked_taps[f"{EMBED}.out"],
    (weights.embed - _piece(components, EMBED, 0))[tokens], atol=1e-5)
  np.testing.assert_array_equal(masked_taps[f"{HEAD}.out"], masked)
  head = _model(CONFIG, CHOICES["head"])
  with pytest.raises(ValueError, match="below the residual start"):
    head[0].masked_forward_taps(head[1], head[2], head[3], {},
                                head[0].clean_forward(
                                  head[1], head[3], head[0].start_taps)[1],
                                (f"{EMBED}.out",))
