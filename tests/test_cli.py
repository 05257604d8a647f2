"""The CLI contract: exit codes, `Error:` lines, --json keys (tiny random models, no download)."""

import json
import os
import re

import pytest
from fpdf import FPDF
from typer.testing import CliRunner

from sekv_cli.main import app

runner = CliRunner()
FILLER = " ".join(f"Shelf {i} holds {i * 3} jars." for i in range(40))
CONTRACT = {
    "answer",
    "method",
    "model",
    "document",
    "memory",
    "timings",
    "store",
    "sources",
    "zoom",
}


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def make_pdf(path, pages=None, encrypt=False):
    pdf = FPDF()
    if encrypt:
        pdf.set_encryption(owner_password="owner", user_password="secret")
    for text in pages or []:
        pdf.add_page()
        pdf.set_font("Helvetica", size=12)
        pdf.multi_cell(0, 8, text)
    if not pages:
        pdf.add_page()
        pdf.rect(20, 20, 80, 60, style="F")  # a drawing, no text: like a scan
    pdf.output(str(path))
    return path


def bad_inputs(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n\n ")
    (tmp_path / "binary.txt").write_bytes(b"\x00\x01\x02PK\x03\x04" * 50)
    (tmp_path / "corrupt.pdf").write_bytes(b"%PDF-1.4 not really a pdf \x00\xff" * 20)
    (tmp_path / "notes.docx").write_text("hello")
    (tmp_path / "folder.md").mkdir()
    make_pdf(tmp_path / "locked.pdf", ["Secret plans for the harbour."], encrypt=True)
    make_pdf(tmp_path / "scan.pdf")
    return {
        "missing.pdf": "not found|does not exist|no such",
        "empty.txt": "empty",
        "binary.txt": "binary|not.*text|UTF-8",
        "corrupt.pdf": "corrupt|cannot read|unreadable|damaged",
        "notes.docx": r"\.pdf",
        "folder.md": "directory",
        "locked.pdf": "encrypted",
        "scan.pdf": "no extractable text|image|OCR",
    }


def test_bad_inputs_fail_cleanly(tmp_path, tiny_model_dirs, sekv_home):
    for name, pattern in bad_inputs(tmp_path).items():
        result = run("ask", tmp_path / name, "What?", "--model", tiny_model_dirs["llama"])
        assert result.exit_code == 1, (name, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), (name, result.stderr)
        assert re.search(pattern, lines[0], flags=re.I), (name, lines[0])
        assert result.stdout == ""
    assert not any(sekv_home.glob("stores/*")), "a failed ask must not write a store"


def test_document_longer_than_the_window_is_refused(tmp_path, tiny_model_dirs):
    long = tmp_path / "long.txt"
    long.write_text(" ".join(f"Entry {i} lies in box {i % 13}." for i in range(2000)))
    result = run(
        "ask", long, "Where is entry 5?", "--model", tiny_model_dirs["qwen2"], "--method", "full"
    )
    assert result.exit_code == 1
    assert "reads at most 2,048 tokens" in result.stderr


def test_missing_model_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\nThe code word is heron.")
    result = run("ask", doc, "What is the code word?", "--model", "nobody/absent-model")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: --model 'nobody/absent-model' not found")


def test_usage_errors_exit_2(tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("Some text.")
    assert run("ask", doc, "q", "--method", "bogus").exit_code == 2
    assert run("ask", doc).exit_code == 2
    assert run("ask", doc, "q", "--budget", "0").exit_code == 2
    for command in (["ask", doc, "q"], ["chat", doc], ["ingest", doc], ["train"]):
        assert run(*command, "--threads", "0").exit_code == 2
    for gone in ("--summaries", "--near", "--kv-bits"):  # experiments not adopted: no options
        assert run("ask", doc, "q", gone, "8").exit_code == 2
    # benchmark knobs live in `sekv bench`, not in a user's commands
    for command in (["ask", doc, "q"], ["chat", doc]):
        for knob in ("--router auto", "--set budget=8", "--memory 0.1", "--stop x"):
            assert run(*command, *knob.split()).exit_code == 2, knob
        for knob in ("--no-sources", "--allow-repeats", "--repetition-penalty=1.2"):
            assert run(*command, knob).exit_code == 2, knob


def test_ask_without_a_question_says_the_question_is_missing(tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("Some text.")
    for args, missing in (
        ([doc], "a question after the document"),
        ([], "a document and a question"),
    ):
        result = run("ask", *args)
        assert result.exit_code == 2, result.output
        shown = " ".join(result.stderr.replace("│", " ").split())
        assert f'give {missing}: sekv ask doc.md "What …?"' in shown
        assert "PATH" not in shown.partition("Error")[2]


def test_ask_offers_what_a_user_needs_only():
    """`sekv ask`'s options: the document, the question, and what a user sets."""
    from typer.main import get_command

    ask = get_command(app).commands["ask"]
    options = {o for p in ask.params for o in p.opts if o.startswith("--")}
    assert options == {
        "--model", "--method", "--budget", "--show-zoom", "--verbose", "--html", "--json",
        "--max-new-tokens", "--temperature", "--top-p", "--seed", "--threads", "--max-tokens",
    }  # fmt: skip


def test_verbose_without_show_zoom_is_a_usage_error(tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("Some text.")
    result = run("ask", doc, "q", "-v")
    assert result.exit_code == 2
    assert "pass both" in result.output and "--show-zoom" in result.output


MODEL_COMMANDS = [
    ["ask", "{doc}", "q"],
    ["chat", "{doc}"],
    ["ingest", "{doc}"],
    ["inspect", "{doc}"],
    ["train"],
    ["bench", "suite"],
    ["bench", "fidelity"],
    ["bench", "ingest", "{doc}"],
    ["bench", "needle"],
    ["bench", "qa", "{doc}"],
    ["bench", "books"],
]


@pytest.mark.parametrize("command", MODEL_COMMANDS, ids=" ".join)
def test_threads_reach_torch_before_the_model_loads(command, tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SEKV_THREADS", "1")
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\nThe code word is heron.")
    args = [a.format(doc=doc) for a in command]
    before = torch.get_num_threads()
    try:
        result = run(*args, "--model", "nobody/absent", "--threads", "2")
        assert result.exit_code == 1 and "not found" in result.stderr  # after the threads
        assert torch.get_num_threads() == 2  # the option beats $SEKV_THREADS
    finally:
        torch.set_num_threads(before)


def test_a_bad_sekv_threads_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SEKV_THREADS", "many")
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\nThe code word is heron.")
    result = run("ingest", doc, "--model", "nobody/absent")
    assert result.exit_code == 1
    assert result.stderr == "Error: SEKV_THREADS must be a positive whole number, not 'many'\n"


def test_an_empty_question_is_refused_before_anything_is_built(tmp_path, monkeypatch, sekv_home):
    import sekv_cli.loading as loading

    monkeypatch.setattr(loading, "load_model_quietly", lambda *a: pytest.fail("model loaded"))
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\nThe code word is heron.")
    result = run("ask", doc, "  ")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: the question is empty")
    assert not (sekv_home / "stores").exists()


@pytest.mark.parametrize("method", ["full", "sekv"])
def test_json_contract(tmp_path, tiny_model_dirs, method):
    pdf = make_pdf(
        tmp_path / "two.pdf",
        [f"First page: the vault code is 7781. {FILLER}", f"Second page: the end. {FILLER}"],
    )
    result = run(
        "ask",
        pdf,
        "What is the vault code?",
        "--json",
        "--model",
        tiny_model_dirs["llama"],
        "--max-new-tokens",
        "5",
        "--method",
        method,
        *(["--budget", "32"] if method == "sekv" else []),
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert CONTRACT <= data.keys()
    assert data["method"] == method
    assert data["document"]["pages"] == 2 and data["document"]["tokens"] > 10
    assert len(data["document"]["sha256"]) == 64
    mem = data["memory"]
    assert {"resident_bytes", "offloaded_bytes", "full_kv_bytes"} <= mem.keys()
    assert {"total_s", "first_token_s", "threads"} <= data["timings"].keys()
    assert {"path", "cache_hit"} <= data["store"].keys()
    assert 0 < data["tokens_generated"] <= 5
    if data["answer"]:  # any answer drew on some passage of the document
        assert 1 <= len(data["sources"]) <= 5
    for source in data["sources"]:
        assert {"page", "start", "end", "chars", "text", "share", "matched"} <= source.keys()
        assert source["page"] in (1, 2) and 0 < source["share"] <= 1
        assert source["end"] > source["start"] and source["chars"][1] > source["chars"][0]
    assert sum(s["share"] for s in data["sources"]) <= 1 + 1e-6
    if method == "full":
        assert data["zoom"] == [] and mem["resident_bytes"] == mem["full_kv_bytes"]
        return
    assert 0 < mem["resident_bytes"] < mem["full_kv_bytes"] and mem["offloaded_bytes"] > 0
    assert data["store"]["path"] and data["store"]["cache_hit"] is False
    assert data["zoom"], "a question over a multi-span document zooms somewhere"
    for z in data["zoom"]:
        assert {
            "span",
            "start",
            "end",
            "page",
            "preview",
            "layers",
            "heads",
            "score",
            "threshold",
            "attention",
        } <= z.keys()
        assert z["page"] in (1, 2) and z["end"] > z["start"] and z["score"] >= z["threshold"]
    assert data["routing"]["zoomed_tokens_max"] <= 32


def test_plain_output_is_the_answer_then_its_sources(tmp_path, tiny_model_dirs):
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\nThe code word is heron.")
    ask = ["ask", doc, "Code word?", "--model", tiny_model_dirs["qwen2"], "--max-new-tokens", "4"]
    result = run(*ask)
    assert result.exit_code == 0, result.output
    answer, _, sources = result.stdout.partition("\nSources\n")
    assert answer.strip() and sources.startswith('[1] p. 1  "')
    assert "Error" not in result.stdout


def test_ask_html_writes_the_answer_view(tmp_path, tiny_model_dirs):
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\nThe code word is heron. <script>alert(1)</script>")
    page = tmp_path / "answer.html"
    result = run(
        "ask", doc, "Code word?", "--model", tiny_model_dirs["llama"], "--max-new-tokens", "4",
        "--html", page,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    html = page.read_text()
    assert html.startswith("<!doctype html>") and "Code word?" in html
    assert 'id="source-1"' in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert f"wrote {page}" in result.stderr
    assert page.stat().st_mode & 0o777 == 0o666 & ~current_umask()


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_ask_html_into_a_missing_directory_fails_before_the_model_loads(tmp_path, monkeypatch):
    import sekv_cli.loading as loading

    monkeypatch.setattr(loading, "load_model_quietly", lambda *a: pytest.fail("model loaded"))
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\nThe code word is heron.")
    result = run("ask", doc, "Code word?", "--html", tmp_path / "nowhere" / "a.html")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: cannot write") and "no such directory" in result.stderr


def test_ingest_twice_is_a_cache_hit(tmp_path, tiny_model_dirs, sekv_home):
    doc = tmp_path / "report.md"
    doc.write_text(
        " ".join(f"Line {i}: the {i % 7}th gate opens at {i % 24}:00." for i in range(25))
    )
    args = ("ingest", doc, "--json", "--model", tiny_model_dirs["llama"])
    first = run(*args)
    assert first.exit_code == 0, first.output
    data = json.loads(first.stdout)
    assert data["store"]["cache_hit"] is False
    assert data["timings"]["threads"] >= 1
    assert data["spans"] > 0 and data["tokens"] > data["document"]["tokens"]
    mem = data["memory"]
    assert 0 < mem["resident_bytes"] < mem["full_kv_bytes"]
    assert mem["offloaded_bytes"] > 0
    assert {"anchors_pct", "span_len"} <= data["stats"].keys()
    second = json.loads(run(*args).stdout)
    assert second["store"] == {"path": data["store"]["path"], "cache_hit": True}
    assert len(list((sekv_home / "stores").iterdir())) == 1


def test_ingest_bad_input_writes_nothing(tmp_path, tiny_model_dirs, sekv_home):
    bad = tmp_path / "empty.md"
    bad.write_text("")
    result = run("ingest", bad, "--model", tiny_model_dirs["llama"])
    assert result.exit_code == 1 and result.stderr.startswith("Error: ")
    assert not (sekv_home / "stores").exists()


def test_chat_answers_two_questions_with_one_model_load(tmp_path, tiny_model_dirs, monkeypatch):
    import sekv_cli.loading as loading

    loads = []
    real = loading.load_model_quietly
    monkeypatch.setattr(
        loading, "load_model_quietly", lambda m, threads: loads.append(m) or real(m, threads)
    )
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\n" + FILLER)
    stdin = (
        "Which shelf holds 9 jars?\n/budget 16\n/zoom\nAnd shelf 4?\n/sources\n"
        "/bogus [/bold]\n/quit\n"
    )
    result = runner.invoke(
        app,
        ["chat", str(doc), "--model", str(tiny_model_dirs["llama"]), "--max-new-tokens", "3"],
        input=stdin,
    )
    assert result.exit_code == 0, result.output
    assert len(loads) == 1
    answers = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(answers) >= 2  # two answers (+ the zoom explanation after the second)
    assert "zoom: at most" in result.stdout or "No spans zoomed" in result.stdout
    assert "memory: resident" in result.stdout
    # sources after each answer, and /sources shows the last ones again
    assert result.stdout.count("Sources\n") == 3
    assert "budget 16 tokens" in result.stderr
    assert "unknown or malformed command '/bogus [/bold]'" in result.stderr  # not markup
    assert "> Which shelf holds 9 jars?\n" in result.stdout  # piped input echoed


def test_chat_keeps_its_history_under_sekv_home(sekv_home):
    import readline

    from sekv_cli.chat import keep_history

    readline.clear_history()
    save = keep_history()
    readline.add_history("Who is the keeper?")
    save()
    readline.clear_history()
    keep_history()  # the next chat reads it back
    assert (sekv_home / "chat_history").is_file()
    last = readline.get_history_item(readline.get_current_history_length())
    assert last == "Who is the keeper?"


def test_chat_exits_cleanly_on_eof(tmp_path, tiny_model_dirs):
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\n" + FILLER)
    result = runner.invoke(
        app, ["chat", str(doc), "--model", str(tiny_model_dirs["qwen2"])], input=""
    )
    assert result.exit_code == 0 and result.stdout == ""


def test_unusable_sekv_home_is_an_error(tmp_path, tiny_model_dirs, monkeypatch):
    bad = tmp_path / "a-file"
    bad.write_text("x")
    monkeypatch.setenv("SEKV_HOME", str(bad / "sub"))
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\n" + FILLER)
    result = run("ingest", doc, "--model", tiny_model_dirs["llama"])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: cannot use") and "SEKV_HOME" in result.stderr
