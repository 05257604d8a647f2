"""`sekv inspect`: the report's data, the HTML page and the terminal view (tiny random models)."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from fpdf import FPDF
from safetensors.torch import load_file
from typer.testing import CliRunner

from sekv_cli.main import app
from sekv_core.documents import load_document
from sekv_core.report import span_index, token_texts

runner = CliRunner()
CHROMIUM = Path("/usr/bin/chromium")
PAGES = [
    "Harbour log, first page. The ferry Corran left at 07:40 with 212 passengers and a cargo "
    "of slate. Wind from the south-west, force four, rising in the afternoon. " * 3,
    "Second page. The vault code is 7781; the spare key hangs in the tide office behind the "
    "chart of the outer islands. Budget for the quarter: 14,300 pounds. " * 3,
    "Third page. Visitors: a school group of eight, two ornithologists, the inspector from "
    "the Trust on 4 March. The lamp was cleaned twice and the log signed by Orla. " * 3,
]


def run(*args) -> object:
    return runner.invoke(app, ["inspect", *(str(a) for a in args)])


def make_pdf(path: Path) -> Path:
    pdf = FPDF()
    for text in PAGES:
        pdf.add_page()
        pdf.set_font("Helvetica", size=12)
        pdf.multi_cell(0, 8, text)
    pdf.output(str(path))
    return path


def make_md(path: Path) -> Path:
    path.write_text(
        "# Notes <script>alert(1)</script>\n\n"
        "AT&T and \"quotes\" and 'apostrophes' <b>bold</b>.\n\n" + "\n\n".join(PAGES)
    )
    return path


def test_json_report(tmp_path, tiny_model_dirs):
    pdf = make_pdf(tmp_path / "log.pdf")
    result = run(pdf, "--json", "--model", tiny_model_dirs["llama"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # one JSON object, nothing else on stdout

    stats = report["stats"]
    assert {"anchors_pct", "span_len", "threshold_nats", "spans"} <= stats.keys()
    assert {"min", "p50", "mean", "max"} <= stats["span_len"].keys()
    assert report["document"]["pages"] == 3
    assert report["bytes"]["full_kv_fp16"] > 0
    assert 0 < report["ratios"]["offloaded"] and 0 < report["ratios"]["resident"]

    tokens, spans = report["tokens"], report["spans"]
    doc_start = report["document"]["doc_start"]
    assert len(tokens) == report["document"]["context_tokens"]
    assert "".join(t["text"] for t in tokens[doc_start:]) == load_document(pdf).text
    assert {t["role"] for t in tokens} <= {"sink", "anchor", "span"}
    assert {t["page"] for t in tokens[doc_start:]} == {1, 2, 3}

    resident = load_file(Path(report["store"]["path"]) / "resident.safetensors")
    starts, ends = resident["span_starts"].tolist(), resident["span_ends"].tolist()
    assert [(s["start"], s["end"]) for s in spans] == list(zip(starts, ends, strict=True))
    assert len(spans) == stats["spans"] > 1
    for s in spans:
        inside = tokens[s["start"] : s["end"]]
        assert all(t["span"] == s["id"] and t["role"] == "span" for t in inside)
        assert s["length"] == s["end"] - s["start"]
        assert len(s["preview"]) <= 60
    in_spans = sum(s["length"] for s in spans)
    assert sum(t["span"] is not None for t in tokens) == in_spans
    assert all(t["role"] != "span" for t in tokens if t["span"] is None)
    offload = Path(report["store"]["path"]) / "offload.safetensors"
    assert report["bytes"]["offloaded"] == offload.stat().st_size  # the manifest: the file
    # each span's records as answers read them (the file holds them entropy-coded)
    assert sum(s["offloaded_bytes"] for s in spans) == report["bytes"]["offload_records"]


def test_html_page_is_self_contained(tmp_path, tiny_model_dirs):
    doc = make_md(tmp_path / "notes.md")
    out = tmp_path / "page.html"
    result = run(doc, "--html", out, "--json", "--model", tiny_model_dirs["qwen2"])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stderr and str(out) in result.stderr.replace("\n", "")
    report = json.loads(result.stdout)
    page = out.read_text()
    assert page.startswith("<!doctype html>")
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"\bsrc\s*=", page), "nothing may be loaded from elsewhere"
    assert all(h.startswith("#") for h in re.findall(r'href="([^"]*)"', page))
    assert "@import" not in page and "url(" not in page
    assert "<svg" in page
    assert len(re.findall(r'id="span-\d+"', page)) == len(report["spans"]) > 1
    # the document's markup is text: escaped (span tags may cut through it), never live
    assert "<script>alert" not in page and "<b>bold" not in page
    text = html.unescape(re.sub(r"<[^>]+>", "", page))
    assert "<script>alert(1)</script>" in text and "AT&T" in text and "<b>bold</b>" in text
    assert not list(tmp_path.glob(".page.html.*")), "no temporary file left behind"


def test_terminal_view(tmp_path, tiny_model_dirs):
    doc = make_md(tmp_path / "notes.md")
    result = run(doc, "--model", tiny_model_dirs["llama"])
    assert result.exit_code == 0, result.output
    assert "│" in result.stdout and "Spans" in result.stdout
    assert "memory: resident" in result.stdout and "full KV" in result.stdout
    assert "Error" not in result.stderr


def test_bad_input_and_bad_output(tmp_path, tiny_model_dirs, sekv_home):
    result = run(tmp_path / "absent.pdf", "--model", tiny_model_dirs["llama"])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and result.stdout == ""

    doc = make_md(tmp_path / "notes.md")
    result = run(doc, "--html", tmp_path / "no" / "such" / "x.html")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: cannot write '{tmp_path / 'no/such/x.html'}': no such directory "
        f"'{tmp_path / 'no/such'}'"
    ]
    assert not any(sekv_home.glob("stores/*")), "failing early: no model work, no store"


def test_token_texts_tile_the_text():
    text = "ab  cd\n\né!"
    # a prompt-head token, then tokens with trimmed offsets and two sharing one character
    offsets = np.array([[-1, -1], [0, 2], [4, 6], [8, 9], [8, 9], [9, 10]])
    ids = np.array([7, 1, 2, 3, 4, 5])

    class Tok:
        def decode(self, ids):
            return f"<{ids[0]}>"

    texts = token_texts(text, offsets, ids, 1, Tok())
    assert texts == ["<7>", "ab", "  cd", "\n\né", "", "!"]
    assert "".join(texts[1:]) == text


def test_span_index():
    starts, ends = np.array([2, 6, 9]), np.array([5, 9, 10])
    assert span_index(starts, ends, 11).tolist() == [-1, -1, 0, 0, 0, -1, 1, 1, 1, 2, -1]


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium with a throwaway profile and no network extras (the pages' checks)."""
    profile = tmp_path / "chromium-profile"
    try:
        return subprocess.run(
            [
                str(CHROMIUM),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                *args,
            ],
            check=True,
            timeout=120,
            capture_output=True,
            text=True,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium")
def test_html_renders_in_headless_chromium(tmp_path, tiny_model_dirs):
    from PIL import Image  # fpdf2 depends on Pillow

    doc = make_md(tmp_path / "notes.md")
    html = tmp_path / "page.html"
    assert run(doc, "--html", html, "--model", tiny_model_dirs["llama"]).exit_code == 0
    png = tmp_path / "page.png"
    chromium(tmp_path, "--window-size=1200,1400", f"--screenshot={png}", html.as_uri())
    assert png.stat().st_size > 20_000
    with Image.open(png) as image:
        assert image.size == (1200, 1400)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 200, "a rendered page, not a blank one"
