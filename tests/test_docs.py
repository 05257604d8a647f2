"""The README and docs/: sizes, one set of figures, links that resolve, commands that run.

Fast: reads text and the benchmark data under docs/bench/, introspects the CLI (no model).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_DOCS = [README, BENCHMARKS]  # their `sekv …` lines must run as written

GRID_HEADER = "| method | memory target | correct of 34 |"
# each row of the results table and the answers (one JSON line each) its figures come from
GRID_ROWS = {
    "full KV": ("docs/bench/results.jsonl", "full"),
    "SeKV, trained router": ("docs/bench/grid-sekv/results.jsonl", "sekv-trained"),
    "SeKV, training-free router": ("docs/bench/grid-sekv/results.jsonl", "sekv-training-free"),
    "SnapKV": ("docs/bench/results.jsonl", "snapkv"),
    "ChunkKV": ("docs/bench/results.jsonl", "chunkkv"),
}
GENERATED = {"needle", "multikey"}  # the grid's generated tasks; "qa": the sample documents


def numbers(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", cell)]


def grid_table(path: Path) -> dict[str, dict[str, str]]:
    """The results table of ``path``: row label -> {column header: cell}."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(GRID_HEADER))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip().replace("**", "") for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


def measured(data: str, method: str) -> list[dict]:
    """Per memory target (ascending; None for full KV): the answers' correct counts overall,
    generated and QA, the mean resident share in per cent, and the target in per cent."""
    rows = [json.loads(line) for line in (ROOT / data).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["method"] == method]
    assert rows, f"{data} holds no answers of {method!r}"
    out = []
    for share in sorted({r["memory_share"] for r in rows}, key=lambda s: s or 0):
        cell = [r for r in rows if r["memory_share"] == share]
        out.append(
            {
                "correct": sum(bool(r["correct"]) for r in cell),
                "generated": sum(bool(r["correct"]) for r in cell if r["task"] in GENERATED),
                "qa": sum(bool(r["correct"]) for r in cell if r["task"] not in GENERATED),
                "resident": 100 * sum(r["resident_share"] for r in cell) / len(cell),
                "target": None if share is None else 100 * share,
            }
        )
    return out


def test_sizes():
    assert len(README.read_bytes()) <= 9216
    assert len(BENCHMARKS.read_bytes()) <= 24576


def test_readme_results_table_equals_the_benchmarks_table():
    readme, bench = grid_table(README), grid_table(BENCHMARKS)
    assert readme, "README has no results table"
    for label, cells in readme.items():
        assert label in bench, f"README row {label!r} is not in docs/benchmarks.md"
        for column, cell in cells.items():
            assert bench[label].get(column) == cell, (label, column, cell, bench[label].get(column))


@pytest.mark.parametrize("path", [README, BENCHMARKS], ids=["README", "benchmarks"])
def test_results_table_figures_are_the_data(path):
    table = grid_table(path)
    assert set(table) <= set(GRID_ROWS), f"rows without data: {set(table) - set(GRID_ROWS)}"
    for label, cells in table.items():
        cuts = measured(*GRID_ROWS[label])
        assert numbers(cells["correct of 34"]) == [c["correct"] for c in cuts], label
        resident = numbers(cells["resident, measured"])
        assert resident == pytest.approx([c["resident"] for c in cuts], abs=0.051), label
        targets = [c["target"] for c in cuts if c["target"] is not None]
        assert numbers(cells["memory target"]) == pytest.approx(targets), label
        if "generated / QA" in cells:
            split = [c["generated"] for c in cuts] + [c["qa"] for c in cuts]
            assert numbers(cells["generated / QA"]) == split, label


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_relative_links_resolve(path):
    # docs/store-format.md is linked before it is written: this fails until it lands
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{path.name}: links to nothing: {broken}"


def code_blocks(path: Path, kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", path.read_text(), re.S)


def commands(path: Path) -> list[list[str]]:
    """Every shell command of ``path``'s bash blocks as words (continuations joined)."""
    out = []
    for block in code_blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
                words = words[1:]
            if words:
                out.append(words)
    return out


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M))


def test_readme_make_commands_are_makefile_targets():
    made = [w[1] for w in commands(README) if w[0] == "make"]
    assert {"demo", "test"} <= set(made), "README's two commands: make demo, make test"
    assert set(made) <= make_targets()
    question = re.search(r"^QUESTION \?= (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert question and question.group(1) in README.read_text(), "the demo's question"


@pytest.mark.parametrize("path", COMMAND_DOCS, ids=["README", "benchmarks"])
def test_sekv_commands_and_paths_exist(path):
    import typer

    from sekv_cli.main import app

    root = typer.main.get_command(app)
    for words in commands(path):
        for word in words:
            if re.match(r"(sample_docs|scripts)/", word):
                assert (ROOT / word).exists(), f"{path.name}: no {word}"
        if words[0] != "sekv":
            continue
        command, rest = root, words[1:]
        while rest and hasattr(command, "commands") and rest[0] in command.commands:
            command, rest = command.commands[rest[0]], rest[1:]
        assert not hasattr(command, "commands"), f"{path.name}: {' '.join(words)}: no command"
        options = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        for word in rest:
            if word.startswith("-") and not re.fullmatch(r"-\d.*", word):
                assert word.split("=")[0] in options | {"--help", "-h"}, (path.name, words, word)
