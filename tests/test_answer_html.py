"""The answer view (:mod:`sekv_cli.html_answer`): escaping, source highlights, page markers,
zoom shading, and the page as a browser parses and draws it (tiny random models)."""

from __future__ import annotations

import dataclasses
import html
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from test_inspect import CHROMIUM, chromium, make_md, make_pdf

from sekv_cli.html_answer import render_answer_html
from sekv_cli.html_style import SCRIPT
from sekv_core.documents import load_document
from sekv_core.engine import Answer, Session
from sekv_core.models import load_model

QUESTION = "What is the vault code?"
EVIL = "<script>alert(1)</script> and <img src=x onerror=alert(1)>"


def ask(model_dir: Path, path: Path, method: str = "sekv") -> tuple[Answer, Session]:
    session = Session(load_model(str(model_dir), device="cpu"), load_document(path), method)
    return session.ask(QUESTION, max_new_tokens=8), session


def page_for(answer: Answer, session: Session, question: str = QUESTION) -> str:
    return render_answer_html(answer, session.document, session.context, question)


def with_source(answer: Answer, text: str, phrase: str, page: int = 1) -> Answer:
    """``answer`` with one source: the characters of ``phrase`` in ``text``."""
    c0 = text.index(phrase)
    source = {
        "page": page,
        "start": 0,
        "end": 1,
        "chars": [c0, c0 + len(phrase)],
        "text": phrase,
        "share": 0.42,
        "matched": ["7781"],
    }
    return dataclasses.replace(answer, answer="The code is 7781.", sources=[source])


def plain(fragment: str) -> str:
    """The text a browser shows for ``fragment`` (tags dropped, entities decoded)."""
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def highlight(page: str, n: int) -> str:
    """The inner HTML of source ``n``'s highlight (its zoom shading nested inside)."""
    m = re.search(rf'<mark class="src" id="source-{n}"[^>]*>(.*?)</mark>', page, re.S)
    assert m, f"no highlight for source {n}"
    return m.group(1)


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        if self.tags and self.tags[-1][0] == "script" and data.strip():
            self.scripts.append(data)


def test_markup_in_document_question_and_answer_stays_text(tmp_path, tiny_model_dirs):
    doc = make_md(tmp_path / "notes.md")
    doc.write_text(doc.read_text() + f"\n\nEvil line: {EVIL}\n")
    answer, session = ask(tiny_model_dirs["llama"], doc)
    text = session.document.text
    answer = dataclasses.replace(with_source(answer, text, EVIL), answer=f"It says {EVIL}")
    page = page_for(answer, session, question=f"Why {EVIL}?")

    parser = Tags()
    parser.feed(page)
    assert {tag for tag, _ in parser.tags}.isdisjoint({"img", "b", "iframe", "object"})
    assert [tag for tag, _ in parser.tags].count("script") == 1 and parser.scripts == [SCRIPT]
    assert not [a for _, attrs in parser.tags for a in attrs if a.startswith("on")]
    assert "<script>alert" not in page and "<img" not in page
    shown = plain(page)
    assert f"Why {EVIL}?" in shown and f"It says {EVIL}" in shown
    assert "<b>bold</b>" in shown and "AT&T" in shown
    assert plain(highlight(page, 1)) == EVIL
    # self-contained: nothing from elsewhere, every link inside the page
    assert "http://" not in page and "https://" not in page and "url(" not in page
    assert all(h.startswith("#") for h in re.findall(r'href="([^"]*)"', page))


def test_source_highlight_wraps_its_characters_and_links_both_ways(tmp_path, tiny_model_dirs):
    answer, session = ask(tiny_model_dirs["llama"], make_pdf(tmp_path / "log.pdf"))
    text = session.document.text
    phrase = "The vault code is 7781"
    page = page_for(with_source(answer, text, phrase, page=2), session)

    assert plain(highlight(page, 1)) == phrase
    assert page.count('id="source-1"') == 1 and 'id="source-2"' not in page
    assert '<a href="#source-1">[1] p. 2</a>' in page and "42.0% of attention" in page
    assert '<li id="cite-1">' in page and '<a class="badge" href="#cite-1">1</a>' in page
    assert '<div class="a">The code is 7781.</div>' in page  # the answer as it is
    assert "No sources" not in page


def test_a_source_in_another_file_is_listed_not_highlighted(tmp_path, tiny_model_dirs):
    """A collection's answer may cite files other than the one whose text the page shows: those
    are listed with their file, and nothing of the text shown is marked for them."""
    answer, session = ask(tiny_model_dirs["llama"], make_pdf(tmp_path / "log.pdf"))
    text = session.document.text
    here = dataclasses.replace(
        with_source(answer, text, "The vault code is 7781", page=2),
        document={**answer.document, "path": str(session.document.path)},
    )
    other = {**here.sources[0], "path": str(tmp_path / "other.md"), "page": 1}
    mine = {**here.sources[0], "path": str(session.document.path)}
    both = dataclasses.replace(here, sources=[other, mine])
    page = render_answer_html(both, session.document, session.context, QUESTION, [])
    assert 'id="source-1"' not in page and 'href="#source-1"' not in page
    assert "[1] p. 1" in page and html.escape(str(tmp_path / "other.md")) in page
    assert plain(highlight(page, 2)) == "The vault code is 7781"
    assert '<a href="#source-2">[2] p. 2</a>' in page


def test_an_answer_without_sources_says_so(tmp_path, tiny_model_dirs):
    answer, session = ask(tiny_model_dirs["llama"], make_md(tmp_path / "notes.md"))
    page = page_for(dataclasses.replace(answer, sources=[]), session)
    assert "No sources: the answer points to no passage of the document." in page
    assert '<mark class="src" id=' not in page


def test_page_markers_divide_a_multi_page_pdf(tmp_path, tiny_model_dirs):
    answer, session = ask(tiny_model_dirs["llama"], make_pdf(tmp_path / "log.pdf"))
    document = session.document
    page = page_for(dataclasses.replace(answer, sources=[]), session)
    doc = page[page.index('<div class="doc">') :].split("</div>")[0]
    marked = re.sub(r'<span class="pagebreak" id="page-(\d+)">page \1</span>', "\x00\\1\x00", doc)
    _, *parts = re.split("\x00(\\d+)\x00", plain(marked))
    numbers, texts = parts[::2], parts[1::2]
    assert numbers == ["1", "2", "3"]
    assert "".join(texts) == document.text
    # each marker stands exactly where its page's text begins
    assert [sum(map(len, texts[:i])) for i in range(3)] == list(document.page_starts)


def test_zoomed_spans_shaded_for_sekv_only(tmp_path, tiny_model_dirs):
    pdf = make_pdf(tmp_path / "log.pdf")
    answer, session = ask(tiny_model_dirs["llama"], pdf, "sekv")
    assert answer.zoom, "the tiny model's SeKV answer zooms some spans"
    page = page_for(answer, session)
    shaded = re.findall(r'<span class="z z(\d)" title="([^"]*)">', page)
    assert shaded and {int(k) for k, _ in shaded} <= set(range(5))
    top = max(answer.zoom, key=lambda z: z["attention"])
    assert any(k == "4" and t.startswith(f"span {top['span']} · ") for k, t in shaded)
    assert re.fullmatch(r"span \d+ · \d+\.\d% of attention · zoomed in \d+ layers?", shaded[0][1])
    assert "share of the answer's attention: low" in page

    full, session = ask(tiny_model_dirs["llama"], pdf, "full")
    assert full.zoom == []
    page = page_for(with_source(full, session.document.text, "The vault code is 7781"), session)
    assert 'class="z ' not in page and "attention: low" not in page
    assert plain(highlight(page, 1)) == "The vault code is 7781"


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium")
def test_answer_page_renders_in_headless_chromium(tmp_path, tiny_model_dirs):
    from PIL import Image  # fpdf2 depends on Pillow

    answer, session = ask(tiny_model_dirs["llama"], make_pdf(tmp_path / "log.pdf"))
    answer = with_source(answer, session.document.text, "The vault code is 7781", page=2)
    out = tmp_path / "answer.html"
    out.write_text(page_for(answer, session))

    png = tmp_path / "answer.png"
    chromium(tmp_path, "--window-size=1200,1400", f"--screenshot={png}", out.as_uri())
    assert png.stat().st_size > 20_000
    with Image.open(png) as image:
        assert image.size == (1200, 1400)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 200, "a rendered page, not a blank one"

    dom = chromium(tmp_path, "--dump-dom", out.as_uri()).stdout  # after the browser parsed it
    assert plain(highlight(dom, 1)) == "The vault code is 7781"
    assert '<a href="#source-1">[1] p. 2</a>' in dom
    assert 'data-tip="span ' in dom  # the tooltip script ran over the shaded spans


def test_spans_the_answer_barely_read_stay_unshaded():
    from sekv_cli.html_answer import UNSHADED, shade

    assert shade(1.0, 1.0) == 4 and shade(0.25, 1.0) == 2
    assert shade(UNSHADED * 0.9, 1.0) is None and shade(0.0, 0.0) is None
