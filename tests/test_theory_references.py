"""The calculators against the published references they reproduce, each row named by its source
(labs.theory.published.reference_checks): the Ultra-Scale Playbook's memory table, the ZeRO
paper's Figure 1, parameter counts of Llama 3 and Mixtral, the bubble formulas, the ring
all-reduce. Decimal GB only where the source prints them. Theory only: not marked exercise."""

import pytest

from labs.theory.activations import layer_terms, playbook_layer_bytes, terms_bytes
from labs.theory.planner.published import format_references, reference_checks
from labs.theory.presets import PRESETS

ROWS = reference_checks()


@pytest.mark.parametrize("row", ROWS, ids=[r["reference"] for r in ROWS])
def test_the_calculator_reproduces_the_published_figure(row):
    assert row["ours"] == pytest.approx(row["published"], rel=1e-9, abs=1e-12), row


def test_the_table_names_its_sources_and_units():
    text = format_references(ROWS)
    for source in ("Playbook memory table", "ZeRO paper, Fig. 1", "Mixtral", "ZB-H1"):
        assert source in text
    assert {r["unit"] for r in ROWS if "memory" in r["reference"] or "ZeRO" in r["reference"]} == {
        "GB"
    }


def test_the_playbook_activation_formula_for_gpt_style_layers():
    """The Ultra-Scale Playbook's m_act = L·seq·bs·h·(34 + 5·n_heads·seq/h), for GPT-2 small."""
    spec = PRESETS["gpt2-small"]
    seq, mbs, h, a = 1024, 4, 768, 12
    ours = terms_bytes(layer_terms(spec, seq=seq, dtype_bytes=2), seq=seq, mbs=mbs)
    assert ours == seq * mbs * h * (34 + 5 * a * seq / h)
    assert ours == playbook_layer_bytes(seq=seq, mbs=mbs, hidden=h, heads=a)
