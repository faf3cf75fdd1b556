"""recipe/terms: the one table of loss terms drives the assembly and the
rider checks (its flags and console line: tests/bin/test_term_flags.py)."""

import pytest

from decompax.recipe import assembly
from decompax.recipe import terms as term_table

# resid_mlp1 declares nonlinear units, so every term of the table can be on.
EVERY_TERM = (
  "--target=resid_mlp1", "--c=8", "--batch_size=4", "--frequency_coeff=1",
  "--subset_coeff=1", "--groups_coeff=1", "--pgd_coeff=1", "--merged_coeff=1",
  "--fresh_pgd_coeff=1", "--nonlinearity_coeff=1",
  "--recon_groups=layers.0.mlp_in+layers.0.mlp_out")


# Every term of a targeted run: the plain ones (faithfulness aside) on the
# target stream, and the non-target stream's.
EVERY_TARGETED_TERM = (
  "--target=induction", "--c=4", "--target_task=addsub",
  "--nontarget_task=copy", "--target_batch_size=2",
  "--nontarget_batch_size=2", "--faithfulness_coeff=0",
  "--frequency_coeff=1", "--subset_coeff=1", "--groups_coeff=1",
  "--pgd_coeff=1", "--merged_coeff=1", "--fresh_pgd_coeff=1",
  "--nonlinearity_coeff=1",
  "--recon_groups=layers.0.mlp.up_proj+layers.0.mlp.down_proj",
  "--nontarget_recon_coeff=1", "--nontarget_unmasked_coeff=1",
  "--nontarget_importance_coeff=1", "--nontarget_pgd_coeff=1",
  "--nontarget_merged_coeff=1")
PLAIN = tuple(t for t in term_table.TERMS if not t.stream)


def _terms(config):
  toy, target, _ = assembly.resolve_target(config)
  return assembly.parts(config, toy, target).terms


def test_names_short_forms_and_flags_are_unique():
  for field in ("name", "coeff_flag"):
    values = [getattr(t, field) for t in term_table.TERMS]
    assert len(values) == len(set(values)), field
  # Short forms show behind their stream's name on the console.
  shorts = [(t.stream, t.short) for t in term_table.TERMS]
  assert len(shorts) == len(set(shorts))


def test_every_term_builds_under_its_name_in_table_order(parse):
  terms = _terms(parse(*EVERY_TERM))
  assert [t.name for t in terms] == [t.name for t in PLAIN]
  assert all(not t.stream for t in terms)


def test_a_targeted_run_builds_every_term_on_its_stream(parse):
  terms = _terms(parse(*EVERY_TARGETED_TERM))
  assert [t.name for t in terms] == [
    t.name for t in term_table.TERMS if t.name != "faithfulness"]
  for built, row in zip(terms, (t for t in term_table.TERMS
                                if t.name != "faithfulness")):
    assert built.stream == (row.stream or "target")


@pytest.mark.parametrize("term", PLAIN, ids=lambda t: t.name)
def test_a_zero_coefficient_leaves_its_term_out(parse, term):
  names = [t.name for t in _terms(parse(*EVERY_TERM, f"--{term.coeff_flag}=0"))]
  assert names == [t.name for t in PLAIN if t != term]


def test_the_rider_rides_only_on_the_terms_it_names(parse):
  config = parse(*EVERY_TERM, "--hidden_coeff=1",
                 "--hidden_terms=stochastic_recon,merged_recon")
  with_taps = {t.name for t in _terms(config) if t.clean_taps}
  assert with_taps == {"stochastic_recon", "merged_recon"}


def test_rider_terms_are_the_table_rows_that_take_one():
  assert list(term_table.RIDER_TERMS) == [
    "stochastic_recon", "stochastic_recon_per_site",
    "stochastic_recon_subset", "stochastic_recon_groups",
    "persistent_pgd_recon", "merged_recon"]


def test_a_rider_on_a_term_without_one_names_the_rider_terms(parse):
  with pytest.raises(ValueError) as info:
    parse("--hidden_coeff=1", "--hidden_terms=fresh_pgd_recon")
  assert ", ".join(term_table.RIDER_TERMS) in str(info.value)


def test_no_recon_term_names_every_recon_coefficient(parse):
  off = [f"--{t.coeff_flag}=0" for t in PLAIN if t.recon]
  with pytest.raises(ValueError) as info:
    parse(*off)
  for term in term_table.TERMS:
    named = f"--{term.coeff_flag}" in str(info.value)
    assert named == (term.recon and not term.stream)
