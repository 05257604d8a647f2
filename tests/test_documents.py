"""Tests for sekv_core.documents: loading, normalisation, page map and user-facing errors."""

from __future__ import annotations

import hashlib
import os
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from fpdf import FPDF

from sekv_core.config import MAX_TOKENS
from sekv_core.documents import Document, check_tokens, load_document, max_bytes, token_pages
from sekv_core.errors import SekvError

HEADER = "Acme Handbook - internal"


def make_pdf(
    path: Path,
    pages: list[str],
    running: bool = True,
    user_password: str | None = None,
    owner_password: str | None = None,
) -> Path:
    """Write a PDF with one multi_cell of text per page, optionally with header/footer."""

    class _PDF(FPDF):
        def header(self) -> None:
            if running:
                self.set_font("Helvetica", size=8)
                self.cell(0, 6, HEADER, align="C")
                self.ln(10)

        def footer(self) -> None:
            if running:
                self.set_y(-15)
                self.set_font("Helvetica", size=8)
                self.cell(0, 6, f"Page {self.page_no()} of {{nb}}", align="C")

    pdf = _PDF()
    if owner_password is not None:
        pdf.set_encryption(owner_password=owner_password, user_password=user_password)
    for text in pages:
        pdf.add_page()
        pdf.set_font("Helvetica", size=11)
        pdf.multi_cell(0, 6, text)
    pdf.output(str(path))
    return path


BODY = "Ordinary body text that differs from page to page, number {n}, about topic {t}."
MARKERS = ["ALPACA", "BARNACLE", "CORMORANT"]


@pytest.fixture
def three_page_pdf(tmp_path: Path) -> Path:
    pages = [
        f"{BODY.format(n=i, t=m.lower())} The marker word is {m}.\nMore text {i} here."
        for i, m in enumerate(MARKERS, start=1)
    ]
    return make_pdf(tmp_path / "three.pdf", pages)


def test_txt_loads_as_one_page(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(b"Hello   world.\t\tTabs  too.   \n\n\n\nNext paragraph.\n")
    doc = load_document(str(path))
    assert doc.kind == "txt"
    assert doc.text == "Hello world. Tabs too.\n\nNext paragraph."
    assert doc.page_starts == (0,) and doc.pages == 1
    assert doc.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert doc.path == path
    assert doc.page_of_char(0) == 1 and doc.page_of_char(len(doc.text)) == 1


def test_md_kind_and_bom(tmp_path: Path) -> None:
    path = tmp_path / "README.MD"
    path.write_bytes("\ufeff# Title\n\nCaf\u00e9 text.".encode())
    doc = load_document(path)
    assert doc.kind == "md"
    assert doc.text == "# Title\n\nCaf\u00e9 text."


def test_hyphenation_joined_only_across_line_ends(tmp_path: Path) -> None:
    path = tmp_path / "h.txt"
    path.write_text("a hyphen-\nated word, a well-known fact,\nand Anglo-\nSaxon names.")
    text = load_document(path).text
    assert "hyphenated word" in text
    assert "well-known" in text
    assert "Anglo-\nSaxon" in text  # a capitalised continuation is a real compound


def test_pdf_pages_header_footer_removed(three_page_pdf: Path) -> None:
    doc = load_document(three_page_pdf)
    assert doc.kind == "pdf" and doc.pages == 3
    assert doc.page_starts[0] == 0
    assert HEADER not in doc.text
    assert not re.search(r"Page \d of", doc.text)
    assert doc.text.count("Ordinary body text") == 3
    for page, marker in enumerate(MARKERS, start=1):
        i = doc.text.index(marker)
        assert doc.page_of_char(i) == page
        assert doc.text[doc.page_starts[page - 1] :].startswith("Ordinary body text")
    assert "\n\n\n" not in doc.text


def test_pdf_hyphenation_and_short_pdf_keeps_first_lines(tmp_path: Path) -> None:
    # fewer than 3 pages: no header detection, so identical first lines stay
    path = make_pdf(tmp_path / "two.pdf", ["Same first line\nsplit hyphen-\nated"] * 2, False)
    doc = load_document(path)
    assert doc.pages == 2
    assert doc.text.count("Same first line") == 2
    assert "split hyphenated" in doc.text


def test_token_pages_fake_offsets() -> None:
    doc = Document(Path("x.txt"), "0" * 64, "a" * 30, (0, 10, 20), "pdf")
    offsets = [(0, 0), (0, 3), (9, 10), (10, 12), (19, 21), (25, 30), (30, 30)]
    assert token_pages(doc, offsets) == [1, 1, 1, 2, 2, 3, 3]
    assert token_pages(doc, np.array(offsets)) == [1, 1, 1, 2, 2, 3, 3]
    assert token_pages(doc, []) == []
    assert [doc.page_of_char(i) for i in (-5, 9, 10, 20, 99)] == [1, 1, 2, 3, 3]


def test_token_pages_finds_each_marker_page(three_page_pdf: Path) -> None:
    doc = load_document(three_page_pdf)
    words = list(re.finditer(r"\S+", doc.text))  # a word-level "tokenizer"
    pages = token_pages(doc, [m.span() for m in words])
    assert pages == sorted(pages) and set(pages) == {1, 2, 3}
    for page, marker in enumerate(MARKERS, start=1):
        (k,) = [k for k, m in enumerate(words) if m.group().startswith(marker)]
        assert pages[k] == page


def test_pdf_with_empty_user_password_is_read(tmp_path: Path) -> None:
    path = make_pdf(tmp_path / "owner.pdf", ["Readable secret-free text."], owner_password="own")
    assert "Readable" in load_document(path).text


def _error(path: Path | str, max_tokens: int | None = MAX_TOKENS) -> str:
    with pytest.raises(SekvError) as info:
        load_document(path, max_tokens)
    message = str(info.value)
    assert "\n" not in message
    assert Path(path).name in message
    return message


def test_encrypted_pdf_errors(tmp_path: Path) -> None:
    path = make_pdf(
        tmp_path / "locked.pdf", ["Top secret."], user_password="secret", owner_password="owner"
    )
    message = _error(path)
    assert "encrypted" in message and "qpdf" in message


def test_image_only_pdf_errors(tmp_path: Path) -> None:
    pdf = FPDF()
    pdf.add_page()
    pdf.rect(20, 20, 100, 60, style="F")
    path = tmp_path / "scan.pdf"
    pdf.output(str(path))
    message = _error(path)
    assert "no extractable text" in message and "OCR" in message


def test_corrupt_pdf_errors(tmp_path: Path) -> None:
    path = tmp_path / "broken.pdf"
    path.write_bytes(np.random.default_rng(0).bytes(2048))
    assert "PDF" in _error(path)


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("empty.txt", b"", "empty"),
        ("blank.md", b" \n\t\n ", "empty"),
        ("empty.pdf", b"", "empty"),
        ("binary.txt", b"abc\x00\x01\x02def", "binary"),
        ("latin1.md", "caf\u00e9 cr\u00e8me".encode("latin-1"), "UTF-8"),
    ],
)
def test_bad_text_files_error(tmp_path: Path, name: str, content: bytes, expected: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    assert expected in _error(path)


def test_missing_directory_and_unsupported(tmp_path: Path) -> None:
    assert "no such file" in _error(tmp_path / "nope.pdf")
    folder = tmp_path / "folder.txt"
    folder.mkdir()
    assert "directory" in _error(folder)
    other = tmp_path / "report.docx"
    other.write_bytes(b"PK\x03\x04")
    message = _error(other)
    assert ".pdf" in message and ".txt" in message and ".md" in message


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail with TimeoutError instead of hanging (a blocking open of a FIFO)."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs and /dev")
def test_only_regular_files_are_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    (tmp_path / "null.md").symlink_to("/dev/null")
    (tmp_path / "dangling.md").symlink_to(tmp_path / "gone.md")
    with deadline(10):
        assert "a FIFO (named pipe), not a regular file" in _error(tmp_path / "pipe.txt")
        assert "a device, not a regular file" in _error(tmp_path / "zero.txt")
        assert "a device, not a regular file" in _error(tmp_path / "null.md")
    assert "no such file" in _error(tmp_path / "dangling.md")
    real = tmp_path / "real.txt"
    real.write_text("Text behind a link.")
    (tmp_path / "link.md").symlink_to(real)
    assert load_document(tmp_path / "link.md").text == "Text behind a link."


def test_a_file_too_big_for_max_tokens_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    with big.open("wb") as f:  # sparse: NUL bytes, refused as binary were it read
        f.truncate(max_bytes("txt", MAX_TOKENS) + 1)
    message = _error(big)
    assert f"it is {big.stat().st_size / 2**20:,.1f} MiB" in message
    assert re.search(r"pass --max-tokens \d+ or more$", message), message
    assert "binary" in _error(big, max_tokens=MAX_TOKENS * 2)  # read once the limit allows it

    small = tmp_path / "small.md"
    small.write_text("A few words. " * 10)  # 130 bytes
    message = _error(small, max_tokens=4)
    assert "it is 130 bytes, more than the 64 bytes read for --max-tokens 4" in message
    suggested = int(re.search(r"--max-tokens (\d+) or more", message).group(1))
    assert load_document(small, max_tokens=suggested).text.startswith("A few words.")
    assert load_document(small, max_tokens=None).kind == "md"
    pdf = tmp_path / "doc.pdf"
    pdf.write_bytes(b"%PDF" + b" " * 5000)
    assert "5,004 bytes, more than the 2,560 bytes" in _error(pdf, max_tokens=10)  # 256 per token


def test_check_tokens_says_how_to_go_ahead(tmp_path: Path) -> None:
    doc = tmp_path / "notes.txt"
    doc.write_text("Some notes.")
    document = load_document(doc)
    check_tokens(document, 100, 100)
    check_tokens(document, 10**9, None)
    with pytest.raises(SekvError) as info:
        check_tokens(document, 1_234_567, 1_000_000)
    assert str(info.value) == (
        f"'{doc}' is 1,234,567 tokens, more than --max-tokens 1,000,000 allows; to read it "
        "anyway, pass --max-tokens 1234567"
    )


def _tidy_in_one_go(text: str) -> str:
    """The normalisation rules applied to the whole text at once (the reference)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t\f\v\u00a0]+", " ", text)
    text = re.sub(r" +\n", "\n", text)
    text = re.sub(r"(?<=[^\W\d_])-\n(?=[a-z])", "", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def test_long_text_is_tidied_in_pieces_to_the_same_text(monkeypatch) -> None:
    """A long text is tidied piece by piece (a Ctrl-C waits for one piece at most), cut where
    no rule applies across the cut: the result is the whole text's."""
    import random

    import sekv_core.documents as documents

    parts = ["ab", "Zé", "12", "_", "-", " ", "  ", "\t", "\n", "\n\n\n", "\r\n", " \n", "-\n"]
    parts += ["x-\ny", "\u00a0", ".", "\f", "Über"]
    rng = random.Random(0)
    for piece in (5, 17, 64, 1 << 20):
        monkeypatch.setattr(documents, "NORMALISE_PIECE", piece)
        for _ in range(60):
            text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 800)))
            assert documents._normalise(text) == _tidy_in_one_go(text), (piece, text)
