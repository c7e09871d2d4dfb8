"""Every figure the README quotes comes from a committed output, and agrees with it.

A measured figure in README.md carries a footnote right after it (``640,896[^bench] B``,
``8.6%[^nb08]``); the footnote's definition names the committed files it is quoted from (a
notebook's executed outputs, ``docs/bench``). The figure agrees when one of the numbers in those
files, rounded to the digits the README shows, is the README's number. The benchmark table is
``docs/bench/bench.md``'s, row for row. A figure written with a decimal point, a thousands
separator, an exponent or a percent sign that has no footnote fails, unless ``NOT_MEASURED``
lists it with the reason (a setting, a tolerance, a specification) or it sits in a region marked
``<!-- not from an output: why -->`` ... ``<!-- /not from an output -->`` (which must say why).
Integers are not required to carry a footnote (most are counts and settings), but a tagged one is
checked like any figure. Nothing runs: this reads files.
"""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

import nbformat
import pytest

from tests.helpers import ROOT

README = ROOT / "README.md"
BENCH = ROOT / "docs" / "bench" / "bench.md"
NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:e[-+]?\d+)?"
# a figure: a number not inside a word, a version (3.11.7) or an address, then "%" or not; atomic,
# so that "640,896[^bench]" is never read as an untagged "640"
FIGURE = rf"(?<![\w.,^-])(?>(?P<number>{NUMBER})(?![\w]|\.\d)(?P<percent>%)?)"
TAGGED = re.compile(rf"{FIGURE}\[\^(?P<key>\w+)\]")
UNTAGGED = re.compile(rf"{FIGURE}(?!\[\^)")
DEFINITION = re.compile(r"^\[\^(\w+)\]:(.*)$", re.M)
# "Python 3.11, 3.12 or 3.13": versions, not figures
VERSIONS = re.compile(r"\bPython \d\.\d+(?:\.\d+)?(?:(?:, | or | to )\d\.\d+(?:\.\d+)?)*")
SOURCE_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
# Numbers the README writes that are not measurements, each with why.
NOT_MEASURED = {
    "0.1": "the DDP lab's bucket size, a setting",
    "1e-8": "AdamW's eps, a setting",
    "1e-5": "the course's tolerance against the reference (labs.train.rule, fp32)",
    "20%": "the threshold above which bench.md explains a slowdown",
    "0.97": "Llama-3.2-1B's parameter count, from its configuration",
    "5e-4": "TF32's rounding of a matmul's inputs (2^-11), a property of the format",
    "4,096": "a sequence length, a setting",
    "79.6": "an H100's memory in GiB as nvidia-smi reports it, a specification",
    "74.5": "80 GB in GiB, a unit conversion",
    "8,192": "a cluster's GPU count (the Llama 3 runs), a setting",
    "16,384": "a cluster's GPU count (the Llama 3 runs), a setting",
}
# A region of figures no committed output shows yet, with the reason: not checked for sources.
NOT_FROM_AN_OUTPUT = re.compile(
    r"^<!-- not from an output: (?P<why>.+?)-->.*?^<!-- /not from an output -->", re.S | re.M
)


def readme() -> str:
    return README.read_text()


def prose(text: str) -> str:
    """The README without code blocks, inline code, Python versions, headings, footnote
    definitions and the regions ``NOT_FROM_AN_OUTPUT`` marks."""
    text = NOT_FROM_AN_OUTPUT.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = VERSIONS.sub("Python", text)
    text = re.sub(r"`[^`\n]*`", "", text)
    return "\n".join(line for line in text.splitlines() if not line.startswith(("#", "[^")))


def output_text(path: Path) -> str:
    """The text a committed notebook shows under its code cells, or a file's text."""
    if path.suffix != ".ipynb":
        return path.read_text()
    parts = []
    for cell in nbformat.read(path, as_version=4).cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif out.output_type == "error":
                parts.append(out.evalue)
            else:
                data = out.get("data", {})
                parts += [data.get("text/plain", ""), data.get("text/markdown", "")]
    return "\n".join(parts)


def sources() -> dict[str, list[Path]]:
    """Footnote key -> the committed files its definition names (in backquotes)."""
    found = {}
    for key, definition in DEFINITION.findall(readme()):
        found[key] = [ROOT / name for name in re.findall(r"`([\w./-]+\.\w+)`", definition)]
    return found


def shown_digits(figure: str) -> int:
    """Significant digits the README shows: '0.045' 2, '640,896' 6, '43.0' 3, '1.8e-7' 2."""
    mantissa = figure.replace(",", "").split("e")[0].replace(".", "").lstrip("0")
    return max(len(mantissa), 1)


def agrees(figure: str, numbers: set[str]) -> bool:
    """A number of the source, rounded to the figure's significant digits, is the figure."""
    digits = shown_digits(figure)
    wanted = f"{Decimal(figure.replace(',', '')):.{digits - 1}e}"
    return any(f"{Decimal(n.replace(',', '')):.{digits - 1}e}" == wanted for n in numbers)


def test_every_footnote_names_committed_files():
    found = sources()
    assert found, "README.md has no footnotes naming its sources"
    for key, paths in found.items():
        assert paths, f"[^{key}] names no file"
        for path in paths:
            assert path.is_file(), f"[^{key}] names {path.relative_to(ROOT)}, which does not exist"
    used = {m["key"] for m in TAGGED.finditer(readme())}
    assert used <= set(found), f"footnotes without a definition: {sorted(used - set(found))}"


def test_every_tagged_figure_agrees_with_its_source():
    numbers = {
        key: set(SOURCE_NUMBER.findall("\n".join(output_text(p) for p in paths)))
        for key, paths in sources().items()
    }
    tagged = list(TAGGED.finditer(readme()))
    assert len(tagged) > 50, f"only {len(tagged)} tagged figures"
    wrong = [_where(m) for m in tagged if not agrees(m["number"], numbers[m["key"]])]
    assert not wrong, f"README figures that their source does not show: {wrong}"


def _where(match: re.Match) -> str:
    line = readme()[: match.start()].count("\n") + 1
    return f"{match['number']}{match['percent'] or ''}[^{match['key']}] (line {line})"


def test_every_measured_figure_has_a_source():
    bench_rows = {line for line in BENCH.read_text().splitlines() if line.startswith("|")}
    text = "\n".join(line for line in prose(readme()).splitlines() if line not in bench_rows)
    untagged = {m["number"] + (m["percent"] or "") for m in UNTAGGED.finditer(text)}
    measured = sorted(
        f for f in untagged - set(NOT_MEASURED) if re.search(r"[.,e%]", f) and f[0].isdigit()
    )
    assert not measured, (
        f"figures without a footnote naming their source: {measured}; add one, or list a "
        "setting in NOT_MEASURED with the reason"
    )
    stale = sorted(f for f in NOT_MEASURED if f not in untagged)
    assert not stale, f"NOT_MEASURED lists figures the README no longer writes: {stale}"


def test_regions_without_an_output_say_why():
    for region in NOT_FROM_AN_OUTPUT.finditer(readme()):
        assert len(region["why"].split()) >= 5, f"say why these figures have no output: {region[0]}"
    opened = len(re.findall(r"^<!-- not from an output:", readme(), re.M))
    assert opened == len(NOT_FROM_AN_OUTPUT.findall(readme())), "an unclosed region"


def test_the_benchmark_table_is_bench_md_row_for_row():
    table = [line for line in BENCH.read_text().splitlines() if line.startswith("|")]
    ours = readme().splitlines()
    assert table[0] in ours, "the README has no benchmark table (docs/bench/bench.md's header)"
    start = ours.index(table[0])
    assert ours[start : start + len(table)] == table, (
        "the README's benchmark table differs from docs/bench/bench.md's"
    )
    date = re.search(r"Latest run, (\d{4}-\d\d-\d\d \d\d:\d\d UTC)", readme())
    assert date and date.group(1) in BENCH.read_text().splitlines()[0]


@pytest.mark.parametrize(
    "figure, numbers, expected",
    [
        ("1.8e-7", {"1.8126205336010452e-07"}, True),
        ("640,896", {"640896.0"}, True),
        ("1,709.1", {"1,709.1"}, True),
        ("43.0", {"43.0"}, True),
        ("43.0", {"42.6"}, False),
        ("0.298", {"0.29759963371417375"}, True),
        ("0.30", {"0.29759963371417375"}, True),
        ("0.30", {"0.31"}, False),
        ("4.3e-5", {"4.3e-05"}, True),
        ("3161", {"3161", "1219"}, True),
        ("1219", {"3161"}, False),
    ],
)
def test_a_figure_agrees_at_the_precision_it_shows(figure, numbers, expected):
    assert agrees(figure, numbers) is expected


def test_an_untagged_measurement_is_found_and_a_tagged_one_is_not():
    text = "bytes 640,896 B, ratio 1.04[^nb02], bubble 8.6%[^nb08], Python 3.11.7 and 2.62×"
    assert {m["number"] for m in UNTAGGED.finditer(text)} >= {"640,896", "2.62"}
    assert {m["number"] + (m["percent"] or "") for m in TAGGED.finditer(text)} == {"1.04", "8.6%"}
    assert "3.11" not in {m["number"] for m in UNTAGGED.finditer(text)}
