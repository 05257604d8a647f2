"""What the CLI writes, against hostile input and a hostile terminal: never over its input,
never a document's escape sequences raw, a full or closed stdout, 80 columns (tiny random
models, real files)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import typer
from rich.cells import cell_len
from rich.text import Text
from test_documents import deadline
from typer.testing import CliRunner

import sekv_cli.errors as errors
import sekv_cli.loading as loading
import sekv_cli.output as output
import sekv_cli.progress as progress_display
from sekv_cli.main import app
from sekv_cli.render import source_line, zoom_table
from sekv_cli.terminal import console, printable

runner = CliRunner()
WIDE = {"COLUMNS": "1000"}
RED = "The keeper is \x1b[31mRed Rosa\x1b[0m, and the bell rings \x07 twice.\x1b]0;owned\x07"


def run(*args, input: str | None = None, env=WIDE):
    return runner.invoke(app, [str(a) for a in args], input=input, env=env)


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


# --- 1. no command writes over its input ---


@pytest.fixture
def doc(tmp_path) -> Path:
    path = tmp_path / "v.md"
    path.write_text("# Station\n\nThe station dog is called Biscuit.\n")
    return path


def outputs_that_are_the_input(doc: Path) -> dict[str, Path]:
    hard = doc.with_name("hard.md")
    os.link(doc, hard)
    soft = doc.with_name("soft.html")
    soft.symlink_to(doc)
    return {"same path": doc, "hard link": hard, "symlink": soft}


@pytest.mark.parametrize("command", ["ask", "inspect"])
def test_html_over_the_input_is_refused_and_nothing_written(command, doc, no_model):
    before = doc.read_bytes()
    for how, out in outputs_that_are_the_input(doc).items():
        args = [doc, "What is the dog called?"] if command == "ask" else [doc]
        line = one_error_line(run(command, *args, "--html", out))
        assert "is the input document" in line and str(out) in line, how
        assert doc.read_bytes() == before and out.read_bytes() == before, how
    assert not list(doc.parent.glob(".*.tmp"))


def test_html_over_a_document_of_the_folder_asked_is_refused(doc, no_model):
    line = one_error_line(run("ask", doc.parent, "What is the dog called?", "--html", doc))
    assert "a document of the input folder" in line


def test_train_out_over_a_file_that_is_no_router_writes_nothing(doc, tiny_model_dirs):
    before = doc.read_bytes()
    result = run("train", "--model", tiny_model_dirs["llama"], "--steps", "1", "--out", doc)
    assert result.exit_code == 1 and result.stderr.startswith("Error: ")
    assert doc.read_bytes() == before


def html_targets(tmp_path: Path, pipe_fd: int) -> dict[str, Path]:
    """Output files that are no regular file (a link to /dev/null, a FIFO, a link to an open
    pipe's descriptor in /proc) and a link to a regular file."""
    targets = {
        "device": tmp_path / "null.html",
        "fifo": tmp_path / "fifo.html",
        "proc": tmp_path / "pipe.html",
        "link": tmp_path / "link.html",
    }
    targets["device"].symlink_to(os.devnull)
    os.mkfifo(targets["fifo"])
    targets["proc"].symlink_to(f"/proc/self/fd/{pipe_fd}")
    (tmp_path / "page.html").write_text("an older page")
    targets["link"].symlink_to(tmp_path / "page.html")
    return targets


def read_all(source: Path | int, into: list[bytes]) -> threading.Thread:
    """A thread that reads ``source`` (a FIFO's path, or a descriptor) to its end."""

    def drain() -> None:
        fd = os.open(source, os.O_RDONLY) if isinstance(source, Path) else source
        while chunk := os.read(fd, 1 << 16):
            into.append(chunk)
        os.close(fd)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    return thread


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs FIFOs and /proc")
@pytest.mark.parametrize("command", ["ask", "inspect"])
def test_html_onto_a_device_fifo_or_proc_link_is_written_into_never_replaced(
    command, doc, tmp_path, tiny_model_dirs
):
    args = [doc, "Who?", "--max-new-tokens", "2"] if command == "ask" else [doc]
    read, write = os.pipe()
    targets = html_targets(tmp_path, write)
    kinds = {name: os.lstat(out).st_mode for name, out in targets.items()}
    fifo, pipe = [], []
    readers = [read_all(targets["fifo"], fifo), read_all(read, pipe)]
    for name, out in targets.items():
        with deadline(60):
            result = run(command, *args, "--model", tiny_model_dirs["llama"], "--html", out)
        assert result.exit_code == 0, (name, result.output)
        assert os.lstat(out).st_mode == kinds[name], f"{name}: replaced"
    os.close(write)
    for thread in readers:
        thread.join(10)
    for name, received in (("fifo", fifo), ("proc", pipe)):
        assert b"".join(received).startswith(b"<!doctype html>"), name
    assert (tmp_path / "page.html").read_text().startswith("<!doctype html>")  # the link kept
    assert Path(os.devnull).is_char_device()
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_html_onto_a_full_device_is_one_error(doc, tmp_path, tiny_model_dirs):
    full = tmp_path / "full.html"
    full.symlink_to("/dev/full")
    result = run("inspect", doc, "--model", tiny_model_dirs["llama"], "--html", full)
    assert result.exit_code == 1
    assert result.stderr.strip() == f"Error: cannot write '{full}': No space left on device"
    assert full.is_symlink() and Path("/dev/full").is_char_device()


def test_train_out_onto_a_device_is_refused_before_the_model_loads(doc, monkeypatch):
    import sekv_cli.train as train

    monkeypatch.setattr(train, "load_model_quietly", lambda *a: pytest.fail("model loaded"))
    out = doc.with_name("router.safetensors")
    out.symlink_to(os.devnull)
    line = one_error_line(run("train", "--steps", "1", "--out", out))
    assert line == f"Error: cannot write a router to '{out}': it is not a regular file; " + (
        "pass a file name"
    )
    assert out.is_symlink()


# --- 2. a document's control characters never reach the terminal raw ---


def test_printable_escapes_controls_and_keeps_text():
    assert printable("a\x1b[31mb\tc\nd\x9b\u202e") == "a\\x1b[31mb\tc\nd\\x9b\\u202e"
    assert printable("one\ntwo", newlines=False) == "one\\x0atwo"
    assert printable("Grüße – ok") == "Grüße – ok"


def test_consoles_escape_what_they_print_inside_tables_too():
    buffer = io.StringIO()
    screen = console(file=buffer, width=80, force_terminal=True)
    screen.print(Text(RED, style="bold"))
    screen.print(zoom_table([zoom_row(RED)]))
    shown = buffer.getvalue()
    assert "\x1b[31m" not in shown and "\x07" not in shown and "\x1b]0;" not in shown
    assert "\\x1b[31mRed Rosa" in shown
    assert "\x1b[1m" in shown  # the console's own styles are kept


def test_streamed_answer_text_is_escaped(capsys):
    output.stream_text("is \x1b[31mRed\x1b[0m")
    assert capsys.readouterr().out == "is \\x1b[31mRed\\x1b[0m"


def test_an_error_naming_a_file_is_one_escaped_line(tmp_path, no_model):
    line = one_error_line(run("ask", tmp_path / "a\x1b[2Jb\nc.md", "q"))
    assert "a\\x1b[2Jb\\x0ac.md" in line


def test_a_file_name_that_is_not_utf8_shows_its_bytes_escaped(tmp_path, tiny_model_dirs):
    raw = os.path.join(os.fsencode(tmp_path), b"r\xe9port.md")
    try:
        with open(raw, "w") as f:
            f.write("# Station\n\nThe station dog is called Biscuit.\n")
    except OSError:
        pytest.skip("this file system takes UTF-8 names only")
    doc, page = Path(os.fsdecode(raw)), tmp_path / "page.html"
    shown = str(tmp_path / "r\\xe9port.md")
    model = ["--model", tiny_model_dirs["llama"]]
    for args in (
        ["ask", doc, "Who?", *model, "--max-new-tokens", "2", "--html", page, "--json"],
        ["inspect", doc, *model, "--html", page, "--json"],
    ):
        result = run(*args)
        assert result.exit_code == 0, result.output
        assert "\\ud" not in result.stdout  # strict JSON readers refuse a lone surrogate
        data = json.loads(result.stdout)
        assert shown in (data["document"].get("path"), data["document"].get("name"))
        assert "r\\xe9port.md" in page.read_text(encoding="utf-8")
    result = run("ingest", doc, *model)
    assert result.exit_code == 0 and shown in result.stdout, result.output


@pytest.fixture
def red_doc(tmp_path) -> Path:
    path = tmp_path / "a.txt"
    path.write_text(RED + "\n" + "The lamp is lit at dusk. " * 20)
    return path


def test_inspect_shows_escape_sequences_escaped_and_json_exact(red_doc, tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    shown = run("inspect", red_doc, "--model", model)
    assert shown.exit_code == 0, shown.output
    assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout
    text = re.sub("[│«»]", "", shown.stdout)  # without the span marks and anchor brackets
    assert "The keeper is \\x1b[31mRed Rosa\\x1b[0m" in text
    data = json.loads(run("inspect", red_doc, "--model", model, "--json").stdout)
    assert "".join(t["text"] for t in data["tokens"][data["document"]["doc_start"] :]).startswith(
        RED
    )


def test_ask_and_chat_sources_show_escape_sequences_escaped(red_doc, tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    for result in (
        run("ask", red_doc, "Who is the keeper?", "--model", model, "--max-new-tokens", "8",
            "--show-zoom", "-v"),
        run("chat", red_doc, "--model", model, "--max-new-tokens", "8",
            input="Who is \x1b[31mthe keeper?\n/sources\n/quit\n"),
    ):  # fmt: skip
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout, result.stdout
        assert "\x1b" not in result.stderr


# --- 5. a full or closed standard output ---


def writes_then_fails(exc: OSError):
    @errors.handle_errors
    def command() -> None:
        sys.stdout.write("answer\n")
        sys.stdout.flush()

    class Failing(io.StringIO):
        def write(self, text: str) -> int:
            raise exc

    return command, Failing()


@pytest.mark.parametrize(
    "exc, code, stderr",
    [
        (OSError(28, "No space left on device"), 1,
         "Error: cannot write to standard output: No space left on device\n"),
        (BrokenPipeError(32, "Broken pipe"), 141, ""),
    ],
    ids=["full", "closed"],
)  # fmt: skip
def test_a_full_stdout_is_one_error_a_closed_one_quiet(exc, code, stderr, monkeypatch, capfd):
    command, failing = writes_then_fails(exc)
    monkeypatch.setattr(sys, "stdout", failing)
    with pytest.raises(typer.Exit) as exit_:
        command()
    assert exit_.value.exit_code == code
    assert capfd.readouterr().err == stderr


def sekv(args: list[str], stdout, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SEKV_HOME": str(home), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "sekv_cli", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        timeout=60,
    )


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_dev_full_and_a_closed_pipe_as_processes(sekv_home):
    with open("/dev/full", "w") as full:
        for args in (["stores", "list"], ["stores", "list", "--json"]):
            proc = sekv(args, full, sekv_home)
            assert proc.returncode == 1, proc.stderr
            assert proc.stderr == (
                "Error: cannot write to standard output: No space left on device\n"
            )
    read, write = os.pipe()
    os.close(read)  # the reader left before anything was written
    with os.fdopen(write, "w") as closed:
        proc = sekv(["stores", "list"], closed, sekv_home)
    assert proc.returncode == 141 and proc.stderr == ""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_help_and_version_onto_a_full_stdout_are_one_error(sekv_home):
    with open("/dev/full", "w") as full:
        for args in (["--help"], ["--version"], ["ask", "--help"]):
            proc = sekv(args, full, sekv_home)
            assert proc.returncode == 1, proc.stderr
            assert proc.stderr == (
                "Error: cannot write to standard output: No space left on device\n"
            )


# --- 12. readable at 80 columns ---


def commands(command, path=()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))


def test_help_at_80_columns_cuts_no_option_name_and_no_word():
    for path, command in commands(typer.main.get_command(app)):
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        shown = result.stdout
        assert max(len(line) for line in shown.splitlines()) <= 80
        written = " ".join(
            [command.help or ""] + [p.help or "" for p in getattr(command, "params", [])]
        )
        assert shown.count("…") <= written.count("…"), (path, shown)  # none added by a cut
        for param in getattr(command, "params", []):
            for name in [*param.opts, *param.secondary_opts]:
                if name.startswith("--"):
                    assert name in shown, (path, name)


def zoom_row(preview: str) -> dict:
    return dict(span=208, page=12, start=12290, end=12360, attention=0.014, layers=30,
                heads=86, score=11.4, threshold=0.0, preview=preview)  # fmt: skip


def test_zoom_previews_keep_their_width_at_80_columns():
    buffer = io.StringIO()
    console(file=buffer, width=80).print(zoom_table([zoom_row("tower stands on the western")]))
    rows = [line for line in buffer.getvalue().splitlines() if "12290" in line]
    assert len(rows) == 1 and "tower stands on" in rows[0] and len(rows[0]) <= 80


def test_stores_list_is_one_line_per_store_at_80_columns(doc, tiny_model_dirs, sekv_home):
    long_name = doc.with_name("a document with a rather long name for the list.md")
    long_name.write_text(doc.read_text())
    for path in (doc, long_name):
        assert run("ingest", path, "--model", tiny_model_dirs["llama"]).exit_code == 0
    result = run("stores", "list", env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    keys = [s["key"] for s in json.loads(run("stores", "list", "--json").stdout)["stores"]]
    assert len(lines) == 1 + len(keys) + 1  # header, one line per store, total
    assert all(len(line) <= 80 for line in lines[:-1])
    for key in keys:  # the key shown is a prefix `stores rm` takes
        shown = next(line.split()[-1] for line in lines[1:-1] if key.startswith(line.split()[-1]))
        assert len(shown) >= 16


def test_stores_list_keeps_one_line_per_store_for_newlines_and_wide_names(
    tmp_path, tiny_model_dirs, sekv_home
):
    names = ["two\nlines.md", "東京の灯台の記録.md"]
    for n, name in enumerate(names):
        path = tmp_path / name
        path.write_text(f"The station dog is called Biscuit {n}.")
        assert run("ingest", path, "--model", tiny_model_dirs["llama"]).exit_code == 0
    result = run("stores", "list", env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 1 + len(names) + 1  # header, one line per store, total
    assert any("two\\x0alines.md" in line for line in lines)
    assert len({cell_len(line) for line in lines[:-1]}) == 1  # columns line up on screen
    assert lines[-1].startswith("2 stores, ")


def test_a_source_line_is_one_line_whatever_its_file_name():
    buffer = io.StringIO()
    source = {"path": "/notes/two\nlines.md", "page": 3, "text": "The dog is Biscuit."}
    console(file=buffer, width=200).print(source_line(1, source, with_file=True))
    assert buffer.getvalue() == '[1] /notes/two\\x0alines.md p. 3  "The dog is Biscuit."\n'


# --- 7. a long document: progress from the first second, in plain lines off a terminal ---


def test_a_long_document_says_it_is_read_and_tokenised_before_anything_else(
    tmp_path, tiny_model_dirs, monkeypatch
):
    doc = tmp_path / "long.txt"
    doc.write_text("The keeper is named Orla and the lamp is lit at dusk. " * 12_000)  # 660K chars
    monkeypatch.setattr(progress_display, "READING_NOTICE_S", 0.0)  # reading takes less here
    for command in (["ingest", doc], ["ask", doc, "Who is the keeper?"]):
        result = run(*command, "--model", tiny_model_dirs["llama"], "--max-tokens", "41250")
        lines = result.stderr.splitlines()
        assert lines[0] == "Reading long.txt (0.6 MiB)…", lines
        assert "long.txt (tokenizing): 0.3M/0.6M characters…" in lines[1], lines
        assert result.exit_code == 1 and lines[-1].startswith("Error: ")  # too many tokens


def test_the_ingest_log_starts_at_once_for_a_long_document(monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(progress_display, "err", console(file=buffer, width=80))  # not a terminal
    with progress_display.prefill_progress("Ingesting book.txt") as progress:
        progress(0, 1000)  # short: nothing yet
    assert buffer.getvalue() == ""
    with progress_display.prefill_progress("Ingesting book.txt") as progress:
        progress(0, 14_000_000)
    assert buffer.getvalue() == "Ingesting book.txt: 0/14,000,000 tokens…\n"


def test_the_router_is_named_by_its_file_unless_sekv_shipped_it(tmp_path):
    from sekv_cli.render import router_words
    from sekv_core.router_files import SHIPPED

    shipped = {"router": "trained", "router_file": str(SHIPPED / "smollm2.safetensors")}
    mine = {"router": "trained", "router_file": str(tmp_path / "mine.safetensors")}
    assert router_words(shipped) == "trained router (shipped)"
    assert router_words(mine) == f"trained router {tmp_path / 'mine.safetensors'}"
    assert router_words({"router": "training-free", "router_file": None}) == (
        "training-free router"
    )
