"""Dual-role CI in a run's settings: the hidden-pass copies of the terms,
the hidden points a target defaults to, and the points it refuses."""

import dataclasses

import pytest

from decompax.core import ci_fns, sites as sites_lib
from decompax.recipe import engine, terms
from decompax.recipe.config import TrainConfig
from decompax.targets import glu_config, glu_sites, glu_weights

SITES = (sites_lib.SiteSpec("a", "a", 0, 3, 4, 5),)
INPUTS = terms.TermInputs(SITES, 8, None, (8,))
TARGETED = dict(target_task="addsub", nontarget_task="copy",
                faithfulness_coeff=0.0, nontarget_recon_coeff=1.0,
                nontarget_importance_coeff=1e-3, nontarget_unmasked_coeff=0.1)


def _built(**fields):
  config = TrainConfig(**{"ci_roles": ci_fns.ROLES, **fields})
  leads = {"target": (8, 5), "nontarget": (4, 6)}
  return terms.build_terms(config, {
    s: terms.TermInputs(SITES, 8, None, lead) for s, lead in leads.items()})


def test_every_recon_and_importance_term_gets_a_hidden_copy_after_the_rest():
  built = _built(**TARGETED, stochastic_coeff=2.0, per_site_coeff=0.0,
                 hidden_pass_coeff=0.5)
  names = [t.name for t in built]
  output = [t for t in built if t.role == ci_fns.OUTPUT]
  copies = [t for t in built if t.role == ci_fns.HIDDEN]
  # Copies come last, so every output-role term keeps its key.
  assert names[:len(output)] == [t.name for t in output]
  assert [t.name for t in copies] == [
    "importance_minimality_hidden", "stochastic_recon_hidden",
    "nontarget_recon_hidden", "nontarget_importance_minimality_hidden"]
  by_name = {t.name: t for t in built}
  # Recon copies at --hidden_pass_coeff times the term's; minimality as is.
  assert by_name["stochastic_recon_hidden"].coeff == pytest.approx(1.0)
  assert by_name["importance_minimality_hidden"].coeff == pytest.approx(
    by_name["importance_minimality"].coeff)
  assert by_name["nontarget_recon_hidden"].stream == "nontarget"
  # Faithfulness-free unmasked recon has no CI to read: no copy.
  assert "nontarget_unmasked_recon_hidden" not in by_name


def test_a_one_role_run_builds_no_copies():
  built = terms.build_terms(TrainConfig(), INPUTS)
  assert [t.name for t in built] == [
    "faithfulness", "importance_minimality", "stochastic_recon",
    "stochastic_recon_per_site"]
  assert all(t.role == ci_fns.OUTPUT for t in built)


def test_the_console_line_shows_hidden_copies_behind_h():
  parts = terms.console_losses(
    {"target/loss/stochastic_recon": 1.0,
     "target/loss/stochastic_recon_hidden": 2.0}, targeted=True)
  assert parts == ["target: recon 1.000e+00", "recon_h 2.000e+00"]


MODEL = glu_config.GluConfig(
  n_layers=4, d_model=8, n_heads=2, n_kv_heads=2, head_dim=4, d_ff=8,
  vocab_size=8, rope_theta=1e4, rms_eps=1e-6, tied=True, qk_norm=False)


def _sites(*names):
  return tuple(sites_lib.SiteSpec(n, n.split(".")[-1], 0, 8, 8, 2)
               for n in names)


def test_glu_hidden_points_run_from_the_first_decomposed_layer_to_the_last():
  sites = _sites("layers.1.mlp.up_proj", "layers.2.mlp.down_proj")
  assert glu_sites.hidden_pass_points(MODEL, sites) == tuple(
    f"layers.{i}.mlp.down_proj.out" for i in (1, 2, 3))


@pytest.mark.parametrize("tap,reached", [
  ("layers.1.mlp.down_proj.out", True),
  ("layers.1.mlp.up_proj.out", True),
  ("layers.1.mlp.gate_proj.out", False),  # beside up_proj, not after it
  ("layers.1.mlp.down_proj", True),
  ("layers.1.self_attn.o_proj.out", False),
  ("layers.0.mlp.down_proj.out", False),
  ("resid.1", False),
  ("resid.2", True),
  ("attn.2", True),
])
def test_glu_masking_reaches_only_what_reads_a_decomposed_site(tap, reached):
  reaches = glu_sites.masking_reaches(MODEL, _sites("layers.1.mlp.up_proj"))
  assert reaches(tap) is reached


class _Target:
  """The fields `hidden_pass_points` reads of a target (a toy's defaults)."""

  def __init__(self, sites, glu=True):
    self.sites = sites
    self.masked_forward_taps = object()
    self.hidden_pass_points = (
      glu_sites.hidden_pass_points(MODEL, sites) if glu else ())
    self.masking_reaches = (
      glu_sites.masking_reaches(MODEL, sites) if glu else None)


def test_a_hidden_point_masking_cannot_reach_is_refused_in_one_line():
  target = _Target(_sites("layers.2.mlp.gate_proj"))
  roles = TrainConfig(ci_roles=ci_fns.ROLES)
  assert engine.hidden_pass_points(roles, target) == (
    "layers.2.mlp.down_proj.out", "layers.3.mlp.down_proj.out")
  bad = dataclasses.replace(
    roles, hidden_pass_points=("layers.1.mlp.down_proj.out",))
  with pytest.raises(ValueError, match="cannot reach 'layers.1.mlp.down_"):
    engine.hidden_pass_points(bad, target)
  with pytest.raises(ValueError, match="unknown tap key"):
    engine.hidden_pass_points(dataclasses.replace(
      roles, hidden_pass_points=("layers.9.mlp.down_proj.out",)), target)
  assert engine.hidden_pass_points(TrainConfig(), target) == ()


def test_a_toy_reaches_its_site_outputs_only():
  toy = _Target(SITES, glu=False)
  roles = TrainConfig(ci_roles=ci_fns.ROLES)
  assert engine.hidden_pass_points(roles, toy) == ("a.out",)
  with pytest.raises(ValueError, match="cannot reach 'a'"):
    engine.hidden_pass_points(
      dataclasses.replace(roles, hidden_pass_points=("a",)), toy)


def test_glu_lm_tap_names_match_the_default_points():
  # The default points are taps the LM forward knows: every block's MLP
  # output from the decomposed one on.
  points = glu_sites.hidden_pass_points(
    MODEL, _sites("layers.0.mlp.down_proj"))
  assert [glu_weights.parse_tap(point, MODEL.n_layers) for point in points] == [
    ("down.out", i) for i in range(MODEL.n_layers)]
