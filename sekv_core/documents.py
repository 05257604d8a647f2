"""Load PDF, plain-text and Markdown documents into normalised text with a page map.

A :class:`Document` holds the whole text of a file after light normalisation (hyphenated line
breaks joined, running PDF headers/footers removed, whitespace tidied) and the character offset at
which each page begins, so that any token of the tokenised text can be traced back to its page
(:func:`token_pages`). Problems the user can fix (missing, encrypted, scanned, empty or binary
input) raise :class:`~sekv_core.errors.SekvError` with a one-line message naming the file.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sekv_core.errors import SekvError

SUPPORTED_SUFFIXES = {".pdf": "pdf", ".txt": "txt", ".md": "md"}

_HEADER_MAX_CHARS = 100  # running headers/footers are short lines

_SPACES = re.compile(r"[ \t\f\v\u00a0]+")
_TRAILING_SPACE = re.compile(r" +\n")
_HYPHEN_BREAK = re.compile(r"(?<=[^\W\d_])-\n(?=[a-z])")
_MANY_NEWLINES = re.compile(r"\n{3,}")
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class Document:
    """A loaded document.

    Attributes
    ----------
    path : Path
        The file it was read from.
    sha256 : str
        Hex SHA-256 of the file's raw bytes (identifies the document in caches).
    text : str
        Normalised full text; pages are separated by a blank line.
    page_starts : tuple of int
        Character offset in ``text`` where each page begins (non-decreasing, first is 0);
        one entry per page (a single page for .txt / .md).
    kind : str
        ``"pdf"``, ``"txt"`` or ``"md"``.
    """

    path: Path
    sha256: str
    text: str
    page_starts: tuple[int, ...]
    kind: str

    @property
    def pages(self) -> int:
        """Number of pages."""
        return len(self.page_starts)

    def page_of_char(self, i: int) -> int:
        """1-based page number holding character offset ``i`` of ``text``.

        Offsets before the start or past the end are clamped to the first / last page.
        """
        return min(max(bisect_right(self.page_starts, i), 1), self.pages)


def token_pages(doc: Document, offsets: Sequence[tuple[int, int]]) -> list[int]:
    """1-based page for each token.

    Parameters
    ----------
    doc : Document
        The document the tokens come from.
    offsets : sequence of (int, int), shape (T, 2)
        Tokenizer offset mapping: (char start, char end) of each token in ``doc.text``
        (a list of pairs, a numpy array or a tensor). Special tokens with (0, 0) map to page 1.

    Returns
    -------
    list of int, length T
        The page of each token's first character, clamped to ``[1, doc.pages]``.
    """
    starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]  # (T,)
    pages = np.searchsorted(np.asarray(doc.page_starts), starts, side="right")  # (T,)
    return np.clip(pages, 1, doc.pages).tolist()


def load_document(path: str | Path) -> Document:
    """Read a .pdf, .txt or .md file into a :class:`Document`.

    Raises
    ------
    SekvError
        If the file is missing, a directory, of an unsupported type, encrypted with a password,
        unreadable, has no extractable text (scanned PDF), is empty, or is binary.
    """
    path = Path(path)
    name = str(path)
    if not path.exists():
        raise SekvError(f"cannot read '{name}': no such file")
    if path.is_dir():
        raise SekvError(f"cannot read '{name}': it is a directory; pass a file")
    kind = SUPPORTED_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        supported = ", ".join(SUPPORTED_SUFFIXES)
        raise SekvError(f"cannot read '{name}': unsupported file type; supported: {supported}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SekvError(f"cannot read '{name}': {exc.strerror or exc}") from exc
    if not raw.strip():
        raise SekvError(f"cannot read '{name}': the file is empty")

    pages = _pdf_pages(raw, name) if kind == "pdf" else [_decode_text(raw, name)]
    pages = [_normalise(p) for p in pages]
    text, page_starts = _join_pages(pages)
    if not text:
        if kind == "pdf":
            raise SekvError(
                f"cannot read '{name}': it has no extractable text (scanned or image-only?); "
                "run OCR first (e.g. ocrmypdf in.pdf out.pdf)"
            )
        raise SekvError(f"cannot read '{name}': it contains only whitespace")
    return Document(
        path=path,
        sha256=hashlib.sha256(raw).hexdigest(),
        text=text,
        page_starts=page_starts,
        kind=kind,
    )


def _decode_text(raw: bytes, name: str) -> str:
    """Decode a text file as UTF-8 (BOM allowed); reject binary content."""
    if b"\x00" in raw:
        raise SekvError(f"cannot read '{name}': it looks binary (contains NUL bytes), not text")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SekvError(
            f"cannot read '{name}': it is not valid UTF-8 text (bad byte at offset {exc.start}); "
            "convert it to UTF-8 first"
        ) from exc


@contextmanager
def _quiet_pypdf() -> Iterator[None]:
    """Hide pypdf's warnings about malformed files: the user gets one error line, not a log."""
    logger = logging.getLogger("pypdf")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _pdf_pages(raw: bytes, name: str) -> list[str]:
    """Extract the text of each page of a PDF, with running headers/footers removed."""
    from pypdf import PdfReader  # imported lazily: only PDFs need it

    with _quiet_pypdf():
        try:
            reader = PdfReader(io.BytesIO(raw))
        except Exception as exc:  # pypdf raises many types for malformed files
            raise SekvError(f"cannot read '{name}': not a readable PDF ({_short(exc)})") from exc
        if reader.is_encrypted:
            try:
                opened = bool(reader.decrypt(""))  # an empty user password opens many PDFs
            except Exception:  # e.g. AES without a crypto backend
                opened = False
            if not opened:
                raise SekvError(
                    f"cannot read '{name}': it is encrypted; decrypt it first "
                    "(e.g. qpdf --decrypt in.pdf out.pdf)"
                )
        try:
            texts = [page.extract_text() or "" for page in reader.pages]
        except Exception as exc:
            raise SekvError(f"cannot read '{name}': the PDF is damaged ({_short(exc)})") from exc
    lines = [_normalise(t).split("\n") for t in texts]
    return ["\n".join(page) for page in _strip_running_lines(lines)]


def _short(exc: Exception) -> str:
    """One line describing ``exc``."""
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0]}" if msg else type(exc).__name__


def _normalise(text: str) -> str:
    """Tidy whitespace, join words hyphenated across line ends, keep paragraphs."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _SPACES.sub(" ", text)  # runs of spaces/tabs -> one space
    text = _TRAILING_SPACE.sub("\n", text)
    text = _HYPHEN_BREAK.sub("", text)
    text = _MANY_NEWLINES.sub("\n\n", text)
    return text.strip()


def _line_key(line: str) -> str:
    """Compare header/footer candidates ignoring digits (page numbers) and case."""
    return _DIGITS.sub("#", line.strip()).lower()


def _strip_running_lines(pages: list[list[str]]) -> list[list[str]]:
    """Remove a first/last line that repeats (digits ignored) on most pages.

    Only applied to documents of 3+ pages, where "most" (more than half of the pages that have
    text) can be told apart from coincidence.
    """
    pages = [_trim_blank(p) for p in pages]
    if sum(1 for p in pages if p) < 3:
        return pages
    for edge in (0, -1):  # top, then bottom
        keys = [_line_key(p[edge]) for p in pages if p]
        if not keys:
            break
        key, count = Counter(keys).most_common(1)[0]
        if count * 2 <= len(keys) or len(key) > _HEADER_MAX_CHARS:
            continue
        drop = slice(1, None) if edge == 0 else slice(None, -1)
        pages = [_trim_blank(p[drop]) if p and _line_key(p[edge]) == key else p for p in pages]
    return pages


def _trim_blank(lines: list[str]) -> list[str]:
    """Drop blank lines at both ends of a page."""
    start, end = 0, len(lines)
    while start < end and not lines[start].strip():
        start += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return lines[start:end]


def _join_pages(pages: list[str]) -> tuple[str, tuple[int, ...]]:
    """Join page texts with a blank line; return the text and each page's start offset."""
    parts: list[str] = []
    starts: list[int] = []
    length = 0
    for page in pages:
        if page and length:
            parts.append("\n\n")
            length += 2
        starts.append(length)
        parts.append(page)
        length += len(page)
    return "".join(parts), tuple(starts)
