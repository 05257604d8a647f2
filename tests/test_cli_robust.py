"""The CLI against hostile input: markup in names and text, files that are not files, documents
too big, an unwritable $SEKV_HOME (tiny random models, real files)."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest
from rich.console import Console
from test_documents import deadline
from typer.testing import CliRunner

import sekv_cli.errors as errors
import sekv_cli.eta as eta
import sekv_cli.loading as loading
import sekv_cli.progress as progress_display
from sekv_cli.main import app

runner = CliRunner()
WIDE = {"COLUMNS": "1000"}  # no line wrapped inside a long path
MARKUP_NAME = "[bold]x[red].md"  # no closing tag: a name holds no "/"
MARKUP_TEXT = " ".join(f"Shelf {i} [/bold] holds [red]secret[/red] jar {i}." for i in range(30))
MODEL_COMMANDS = [
    ["ask", "{doc}", "What is on shelf 3?"],
    ["ingest", "{doc}"],
    ["inspect", "{doc}"],
]


def run(*args, input: str | None = None):
    return runner.invoke(app, [str(a) for a in args], input=input, env=WIDE)


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if any command gets as far as loading a model."""
    monkeypatch.setattr(loading, "load_model_quietly", lambda *a: pytest.fail("model loaded"))


def one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert result.stdout == ""
    return lines[0]


def plain(text: str) -> str:
    """Terminal text without inspect's span marks and anchor brackets."""
    return re.sub("[│«»]", "", text)


# --- markup: document text, file names and user input are printed as text ---


@pytest.fixture
def markup_doc(tmp_path) -> Path:
    doc = tmp_path / MARKUP_NAME
    doc.write_text(MARKUP_TEXT)
    return doc


def test_ask_prints_markup_in_the_document_as_text(markup_doc, tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    result = run(
        "ask", markup_doc, "What is on shelf 3?", "--model", model, "--max-new-tokens", "4",
        "--show-zoom", "--verbose", "--budget", "16",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    sources = result.stdout.partition("\nSources\n")[2]
    assert "[/bold]" in sources and "[red]secret[/red]" in sources


def test_ingest_and_inspect_print_markup_as_text(markup_doc, tiny_model_dirs):
    model = tiny_model_dirs["qwen2"]
    result = run("ingest", markup_doc, "--model", model)
    assert result.exit_code == 0, result.output
    assert str(markup_doc) in result.stdout  # the document row
    result = run("inspect", markup_doc, "--model", model)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(MARKUP_NAME + " · ")  # the header
    text = plain(result.stdout)
    assert "Shelf 3 [/bold] holds [red]secret[/red] jar 3." in text  # the document's text


def test_chat_prints_the_file_name_and_input_as_text(markup_doc, tiny_model_dirs):
    result = run(
        "chat", markup_doc, "--model", tiny_model_dirs["llama"], "--max-new-tokens", "3",
        input="[red]What[/red] is on shelf [/bold] 3?\n/budget [/bold]\n/sources\n/quit\n",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith(f"{MARKUP_NAME}: ")
    assert "unknown or malformed command '/budget [/bold]'" in result.stderr
    assert "[red]secret[/red]" in result.stdout  # the answer's sources


def test_warnings_and_progress_print_names_as_text(monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(errors, "err", Console(file=buffer, width=60))
    message = f"rebuilding the span store at /tmp/{MARKUP_NAME}: bad [/bold] tier " + "x" * 80
    errors.warn(message)
    assert buffer.getvalue() == f"Warning: {message}\n"  # one line, however long

    buffer = io.StringIO()  # a terminal: the bar's description is the name as it is
    monkeypatch.setattr(
        progress_display, "err", Console(file=buffer, force_terminal=True, width=200)
    )
    with progress_display.prefill_progress(f"Ingesting {MARKUP_NAME}") as progress:
        progress(0, 100)
        progress(50, 100)
    assert f"Ingesting {MARKUP_NAME}" in buffer.getvalue()


# --- progress without a terminal: plain log lines ---


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_log_lines_at_tenths_and_periodically():
    clock, lines = Clock(), []
    log = eta.ProgressLog("Ingesting b.md", lines.append, clock)
    log.update(0, 1000)
    clock.now = 1.0
    log.update(200, 1000)  # a tenth passed, but too soon after the start: nothing
    assert lines == []
    clock.now = 6.0
    log.update(250, 1000)
    assert lines == ["Ingesting b.md: 250/1,000 tokens (25%), 0:00:06 elapsed"]
    clock.now = 20.0
    log.update(290, 1000)  # the same tenth, not a minute on: nothing
    clock.now = 6.0 + eta.LOG_EVERY_S
    log.update(296, 1000)  # periodic, in the same tenth
    clock.now += 10
    log.update(1000, 1000)
    assert len(lines) == 3 and "296/1,000 tokens (30%)" in lines[1]
    assert lines[2].startswith("Ingesting b.md: 1,000/1,000 tokens (100%), 0:00:46 elapsed, ETA")


def test_a_resumed_ingest_logs_no_progress_at_once():
    clock, lines = Clock(), []
    log = eta.ProgressLog("Ingesting b.md", lines.append, clock)
    clock.now = 10.0
    log.update(800, 1000)  # the first update: what the interrupted run did
    clock.now = 11.0
    log.update(810, 1000)
    assert lines == []


def test_prefill_progress_logs_lines_when_stderr_is_no_terminal(monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(progress_display, "err", Console(file=buffer, width=40))  # not a terminal
    monkeypatch.setattr(eta, "LOG_GAP_S", 0.0)
    with progress_display.prefill_progress(f"Ingesting {MARKUP_NAME}") as progress:
        for done in range(0, 1001, 100):
            progress(done, 1000)
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 10  # one per tenth, each whole however narrow the console
    assert lines[-1].startswith(f"Ingesting {MARKUP_NAME}: 1,000/1,000 tokens (100%)")


# --- input limits: only regular files, a size and a token ceiling ---


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs and /dev")
@pytest.mark.parametrize("command", [*MODEL_COMMANDS, ["chat", "{doc}"]], ids=lambda c: c[0])
def test_fifo_device_and_directory_fail_at_once(command, tmp_path, no_model):
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    (tmp_path / "null.md").symlink_to("/dev/null")
    (tmp_path / "folder.md").mkdir()
    expected = {
        "pipe.txt": "is a FIFO (named pipe), not a regular file",
        "zero.txt": "is a device, not a regular file",
        "null.md": "is a device, not a regular file",
        "folder.md": "is a directory; pass a file",
    }
    if command[0] != "inspect":  # a folder is a collection: this one holds no document
        expected["folder.md"] = "no .pdf, .txt or .md file in that directory"
    for name, words in expected.items():
        with deadline(20):
            result = run(*[a.format(doc=tmp_path / name) for a in command], input="")
        assert words in one_error_line(result), name


@pytest.mark.parametrize(
    "command", [["ask", "", "q"], ["ingest", ""], ["chat", ""], ["ask", ".", "", "q"]]
)
def test_an_empty_path_is_refused_not_taken_for_this_folder(
    command, tmp_path, monkeypatch, no_model
):
    (tmp_path / "a.txt").write_text("A document that must not be read.")
    monkeypatch.chdir(tmp_path)  # an empty path was this folder: all below it was read
    line = one_error_line(run(*command, input=""))
    assert line.startswith("Error: the document path is empty; name a file or a folder")


@pytest.mark.parametrize("command", MODEL_COMMANDS, ids=lambda c: c[0])
def test_a_file_too_big_is_refused_before_it_is_read(command, tmp_path, no_model):
    big = tmp_path / "big.txt"
    with big.open("wb") as f:
        f.truncate(50_000_000)  # sparse
    line = one_error_line(run(*[a.format(doc=big) for a in command]))
    assert f"cannot read '{big}': it is 47.7 MiB, more than the 15.3 MiB read for " in line
    assert line.endswith("pass --max-tokens 12500000 or more")
    line = one_error_line(run(*[a.format(doc=big) for a in command], "--max-tokens", 12500000))
    assert "binary" in line  # read, once the limit allows it


def test_a_document_over_max_tokens_is_refused_before_its_prefill(
    tmp_path, tiny_model_dirs, sekv_home
):
    doc = tmp_path / "shelves.md"
    doc.write_text(" ".join(f"Shelf {i} holds {i * 3} jars." for i in range(25)))
    model = tiny_model_dirs["llama"]
    for command in (["ingest", doc], ["inspect", doc], ["chat", doc]):
        line = one_error_line(run(*command, "--model", model, "--max-tokens", 60, input=""))
        tokens = re.fullmatch(
            rf"Error: '{re.escape(str(doc))}' is ([\d,]+) tokens, more than --max-tokens 60 "
            r"allows; to read it anyway, pass --max-tokens (\d+)",
            line,
        )
        assert tokens and int(tokens[1].replace(",", "")) == int(tokens[2]) > 60, line
    assert not any(sekv_home.glob("stores/*")), "refused before any prefill"
    result = run("ingest", doc, "--model", model, "--max-tokens", tokens[2])
    assert result.exit_code == 0, result.output
    # built once, it is read again whatever the limit: nothing is left to prefill
    result = run("ingest", doc, "--model", model, "--max-tokens", 60)
    assert result.exit_code == 0 and "cache hit" in result.stdout, result.output
    result = run("chat", doc, "--model", model, "--max-tokens", 60, input="")
    assert result.exit_code == 0, result.output


# --- cheap checks first: SEKV_HOME before the model loads; HTML honours the umask ---


@pytest.fixture
def unwritable_home(tmp_path, monkeypatch) -> Path:
    if os.geteuid() == 0:  # root writes anywhere but in /proc
        if not Path("/proc/self").exists():
            pytest.skip("root without /proc: no unwritable directory to use")
        home = Path("/proc")
    else:
        home = tmp_path / "locked"
        home.mkdir()
        home.chmod(0o555)
    monkeypatch.setenv("SEKV_HOME", str(home))
    yield home
    if home != Path("/proc"):
        home.chmod(0o755)


@pytest.mark.parametrize("command", [*MODEL_COMMANDS, ["chat", "{doc}"]], ids=lambda c: c[0])
def test_an_unwritable_sekv_home_is_refused_before_the_model_loads(
    command, tmp_path, unwritable_home, no_model
):
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\nThe code word is heron.")
    line = one_error_line(run(*[a.format(doc=doc) for a in command], input=""))
    assert line == (
        f"Error: SEKV_HOME {unwritable_home} is not writable; set SEKV_HOME to a writable directory"
    )


def test_train_checks_sekv_home_before_the_model_loads(unwritable_home, monkeypatch):
    import sekv_cli.train as train

    monkeypatch.setattr(train, "load_model_quietly", lambda *a: pytest.fail("model loaded"))
    line = one_error_line(run("train", "--steps", "1"))
    assert line.startswith(f"Error: SEKV_HOME {unwritable_home} is not writable")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_an_unwritable_store_folder_is_refused_before_the_model_loads(
    tmp_path, sekv_home, no_model
):
    stores = sekv_home / "stores"
    stores.mkdir(parents=True)
    stores.chmod(0o555)
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\nThe code word is heron.")
    try:
        line = one_error_line(run("ingest", doc))
    finally:
        stores.chmod(0o755)
    assert line == (
        f"Error: SEKV_HOME {sekv_home} is not writable ({stores}); "
        "set SEKV_HOME to a writable directory"
    )


def test_the_question_is_checked_before_sekv_home(tmp_path, unwritable_home, no_model):
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\nThe code word is heron.")
    assert one_error_line(run("ask", doc, " ")).startswith("Error: the question is empty")


def test_inspect_html_honours_the_umask(tmp_path, tiny_model_dirs):
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\nThe code word is heron. " + MARKUP_TEXT)
    page = tmp_path / "report.html"
    previous = os.umask(0o027)
    try:
        result = run("inspect", doc, "--model", tiny_model_dirs["llama"], "--html", page)
    finally:
        os.umask(previous)
    assert result.exit_code == 0, result.output
    assert page.stat().st_mode & 0o777 == 0o640
    assert f"wrote {page}" in result.stderr
