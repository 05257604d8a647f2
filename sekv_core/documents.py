"""Load PDF, plain-text and Markdown documents into normalised text with a page map.

A :class:`Document` holds the whole text of a file after light normalisation (hyphenated line
breaks joined, running PDF headers/footers removed, whitespace tidied) and the character offset at
which each page begins, so that any token of the tokenised text can be traced back to its page
(:func:`token_pages`). Problems the user can fix (missing, not a regular file, too big,
encrypted, scanned, empty or binary input) raise :class:`~sekv_core.errors.SekvError` with a
one-line message naming the file.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import stat
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sekv_core.config import MAX_TOKENS
from sekv_core.errors import SekvError

SUPPORTED_SUFFIXES = {".pdf": "pdf", ".txt": "txt", ".md": "md"}
# Before it is read, a file is refused above max_tokens (config.MAX_TOKENS unless asked for) times
# these bytes per token: text is ~4 bytes per token; a PDF's bytes are mostly fonts and images.
TEXT_BYTES_PER_TOKEN = 16
TYPICAL_TEXT_BYTES_PER_TOKEN = 4
PDF_BYTES_PER_TOKEN = 256

_HEADER_MAX_CHARS = 100  # running headers/footers are short lines

# a run of spaces and tabs that is not a single space (those stay as they are)
_SPACES = re.compile(r"[\t\f\v\u00a0][ \t\f\v\u00a0]*| [ \t\f\v\u00a0]+")
_TRAILING_SPACE = re.compile(r" +\n")
_HYPHEN_BREAK = re.compile(r"-\n(?=[a-z])")  # joined where a letter precedes it
_LETTER = re.compile(r"[^\W\d_]")
_MANY_NEWLINES = re.compile(r"\n{3,}")
# where a long text is cut to be tidied piece by piece: after a line end that has a character
# other than white space or a hyphen before it and one other than white space after it (no
# pattern above matches across such a place)
_PIECE_CUT = re.compile(r"(?<=[^\s-])\n(?=\S)")
NORMALISE_PIECE = 1 << 20  # characters tidied at a time (a Ctrl-C waits for one piece at most)
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


def load_document(path: str | Path, max_tokens: int | None = MAX_TOKENS) -> Document:
    """Read a .pdf, .txt or .md file into a :class:`Document`.

    Only a regular file is read (a FIFO, a device or a symlink to one is refused without being
    opened for reading), and only one of at most :func:`max_bytes` for ``max_tokens`` (None: no
    limit), checked before it is read.

    Raises
    ------
    SekvError
        If the file is missing, a directory or not a regular file, of an unsupported type, too
        big, encrypted with a password, unreadable, has no extractable text (scanned PDF), is
        empty, or is binary.
    """
    path = Path(path)
    name = str(path)
    kind = SUPPORTED_SUFFIXES.get(path.suffix.lower())
    raw = _read_regular(path, name, kind, max_tokens)
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


def max_bytes(kind: str, max_tokens: int) -> int:
    """The largest file of ``kind`` read for a document of at most ``max_tokens`` tokens."""
    return max_tokens * (PDF_BYTES_PER_TOKEN if kind == "pdf" else TEXT_BYTES_PER_TOKEN)


def check_tokens(document: Document, tokens: int, max_tokens: int | None = MAX_TOKENS) -> None:
    """Refuse a document of more than ``max_tokens`` tokens (None: no limit), saying how to go
    ahead; called once it is tokenised, before any prefill."""
    if max_tokens is not None and tokens > max_tokens:
        raise SekvError(
            f"'{document.path}' is {tokens:,} tokens, more than --max-tokens {max_tokens:,} "
            f"allows; to read it anyway, pass --max-tokens {tokens}"
        )


def _read_regular(path: Path, name: str, kind: str | None, max_tokens: int | None) -> bytes:
    """The bytes of ``path`` if it is a regular file of a supported kind within the limit.

    The file is stat-ed before it is opened, and opened non-blocking (a FIFO swapped in after
    the check does not hang), then checked again on the open descriptor.
    """
    try:
        what = _not_regular(os.stat(path).st_mode)
    except FileNotFoundError:
        raise SekvError(f"cannot read '{name}': no such file") from None
    except OSError as exc:
        raise SekvError(f"cannot read '{name}': {exc.strerror or exc}") from None
    if what == "a directory":
        raise SekvError(f"cannot read '{name}': it is a directory; pass a file")
    if what:
        raise SekvError(f"cannot read '{name}': it is {what}, not a regular file; pass a file")
    if kind is None:
        supported = ", ".join(SUPPORTED_SUFFIXES)
        raise SekvError(f"cannot read '{name}': unsupported file type; supported: {supported}")
    limit = None if max_tokens is None else max_bytes(kind, max_tokens)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if what := _not_regular(st.st_mode):
                raise SekvError(f"cannot read '{name}': it is {what}, not a regular file")
            if limit is not None and st.st_size > limit:
                _too_big(name, kind, st.st_size, limit, max_tokens)
            raw = f.read() if limit is None else f.read(limit + 1)
    except OSError as exc:
        raise SekvError(f"cannot read '{name}': {exc.strerror or exc}") from None
    if limit is not None and len(raw) > limit:  # it grew while being read
        _too_big(name, kind, len(raw), limit, max_tokens)
    return raw


def _not_regular(mode: int) -> str:
    """What a file of ``mode`` is when it is not a regular file ('' when it is)."""
    if stat.S_ISREG(mode):
        return ""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a file"


def _too_big(name: str, kind: str, size: int, limit: int, max_tokens: int) -> None:
    """Refuse a file over ``limit`` bytes, suggesting a --max-tokens that reads it."""
    per_token = PDF_BYTES_PER_TOKEN if kind == "pdf" else TYPICAL_TEXT_BYTES_PER_TOKEN
    suggest = max(-(-size // per_token), max_tokens + 1)
    raise SekvError(
        f"cannot read '{name}': it is {_size(size)}, more than the {_size(limit)} read for "
        f"--max-tokens {max_tokens:,}; to read it anyway, pass --max-tokens {suggest} or more"
    )


def _size(n: int) -> str:
    return f"{n:,} bytes" if n < 2**20 else f"{n / 2**20:,.1f} MiB"


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
    """Tidy whitespace, join words hyphenated across line ends, keep paragraphs. A long text
    is tidied in pieces of about ``NORMALISE_PIECE`` characters, cut where no rule applies
    across the cut (the same text as in one go)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    pieces, start = [], 0
    while len(text) - start > NORMALISE_PIECE:
        cut = _PIECE_CUT.search(text, start + NORMALISE_PIECE)
        if cut is None:
            break
        pieces.append(_tidy(text[start : cut.end()]))
        start = cut.end()
    pieces.append(_tidy(text[start:]))
    return "".join(pieces).strip()


def _tidy(text: str) -> str:
    text = _SPACES.sub(" ", text)  # runs of spaces/tabs -> one space
    if " \n" in text:
        text = _TRAILING_SPACE.sub("\n", text)
    text = _join_hyphenated(text)
    return _MANY_NEWLINES.sub("\n\n", text)


def _join_hyphenated(text: str) -> str:
    """Remove ``-\n`` between a letter and a lower-case letter (a word broken at a line end)."""
    out, last = [], 0
    for m in _HYPHEN_BREAK.finditer(text):
        if m.start() > 0 and _LETTER.match(text, m.start() - 1):
            out.append(text[last : m.start()])
            last = m.end()
    out.append(text[last:])
    return "".join(out)


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
