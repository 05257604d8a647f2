"""`--help` reads like other tools': flags as flags, a version, shell completion."""

import re

import pytest
import typer
from typer.testing import CliRunner

from sekv_cli.help_format import sekv_version
from sekv_cli.main import app

runner = CliRunner()
COMMANDS = [
    [],
    ["ask"],
    ["chat"],
    ["ingest"],
    ["inspect"],
    ["train"],
    ["bench"],
    ["bench", "speed"],
    ["bench", "sources"],
    ["stores"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "sekv")
def test_flags_show_no_type_and_options_with_values_keep_theirs(command):
    result = runner.invoke(app, [*command, "--help"], terminal_width=120)
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output  # --json, --help, --show-zoom take no value
    if command == ["ask"]:
        assert "--show-zoom" in result.output and "<int" in result.output  # --budget <int…>
        assert "[default: 128]" in result.output  # --max-new-tokens


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"sekv {sekv_version()}"
    assert sekv_version()[0].isdigit()


def test_completion_can_be_installed():
    result = runner.invoke(app, ["--help"], terminal_width=120)
    assert "--install-completion" in result.output and "--show-completion" in result.output


def options(command, path=("sekv",)):
    """(command path, option) for every option of every command under ``command``."""
    for name, sub in getattr(command, "commands", {}).items():
        yield from options(sub, (*path, name))
    for param in getattr(command, "params", []):
        if param.param_type_name == "option":
            yield " ".join(path), param


def test_every_option_with_a_value_shows_its_default():
    for path, option in options(typer.main.get_command(app)):
        if option.is_flag or option.multiple or option.required or option.metavar == "OUT":
            continue  # flags are off unless given; --stop/--set repeat; an output file is asked
        told = "default" in (option.help or "").lower()
        shown = option.show_default is not False and option.default not in (None, "", [])
        assert told or shown, (path, option.opts)


@pytest.mark.parametrize("width", [80, 100, 120])
@pytest.mark.parametrize("group", [[], ["stores"], ["bench"]], ids=["sekv", "stores", "bench"])
def test_a_command_list_wraps_at_the_width_not_where_the_docstring_did(group, width):
    """Each command's text in its group's list fills the lines: a line ends only where the next
    word would not fit (a docstring's own line breaks once left a line holding just "a")."""
    result = runner.invoke(app, [*group, "--help"], env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    first = next(i for i, line in enumerate(lines) if "Commands" in line) + 1
    rows = [line[1:-1] for line in lines[first:] if line.startswith("│")]
    column = re.match(r" \S+\s+", rows[0]).end()  # where the commands' text starts
    room = width - 2 - column - 1  # the box's borders, the padding after the text
    for before, after in zip(rows, rows[1:], strict=False):
        if after[:column].strip():
            continue  # the next command
        text, word = before[column:].rstrip(), after[column:].split()[0]
        assert len(text) + 1 + len(word) > room - 1, f"{text!r} ended before {word!r}"
