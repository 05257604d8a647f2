"""Typed settings: segmentation, the span store, streamed ingest, answering, block retrieval.

Every setting has one name, used alike by the code, the CLI (``sekv bench --set KEY=VALUE``
reaches any of them by its dotted path) and the JSON reports. Two units never mix:

- ``budget`` counts *tokens* reconstructed per layer and KV head when zooming;
- ``memory_share`` is a resident-memory target as a share of the document's full KV cache
  counted in fp16 (the one unit of every memory share sekv reports).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .code_specs import check_code
from .errors import ArgumentError, SekvError

# documents of more tokens are refused unless asked for (--max-tokens): on a CPU a streamed
# ingest of a million tokens is hours of work and GBs of store
MAX_TOKENS = 1_000_000
ANSWER_RESERVE = 32  # tokens kept free in the window for the question and an answer's start
# SeKV reads a context beyond this many tokens as a book (bounded positions, passages pinned
# for the question) even where the model's window is longer: a 32K-window model zooming a 16K
# document token by token copies a neighbouring fact of the same form (docs/design.md)
BOOK_WINDOW = 8192
DEFAULT_BUDGET = 256  # zoomed tokens per layer and KV head when nothing else is asked
# the offload tier's codes (sekv_core.code_specs): keys on one even grid per (layer, KV head),
# values at 4 bits on every direction with a row scale (either may be *x16: lossless); why
# these: docs/design.md
KEY_CODE = "even:0.175"
VALUE_CODE = "*x4"


@dataclass(frozen=True)
class SegmentSettings:
    """Entropy segmentation (:mod:`sekv_core.segment`)."""

    alpha: float = 1.0  # boundary threshold: mu + alpha * sigma of document surprisal
    min_len: int = 4  # a peak opens a new span only after this many span tokens
    max_len: int = 8  # spans are cut at this length at the latest
    sinks: int = 4  # document tokens kept as attention sinks after the prompt head
    anchor_cap: float = 0.01  # at most this share of document tokens become anchors

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StreamSettings:
    """Streamed ingest of a context beyond the model window (:mod:`sekv_core.store.stream`).

    Each chunk attends to the sinks, the previous ``window`` tokens at full resolution and
    ``budget`` tokens per (layer, KV head) zoomed from the store built so far, routed by
    ``route_queries`` of its queries.
    """

    window: int = 2048
    budget: int = 512
    route_queries: int = 16
    always: bool = False  # stream even a context that fits the window (tests, comparisons)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StoreSettings:
    """Everything that changes a span store's content (part of its key on disk). SekvError
    naming the setting where a code is not one of its kind's."""

    segment: SegmentSettings = field(default_factory=SegmentSettings)
    # the offload tier's codes of span keys (pre-RoPE) and values (sekv_core.code_specs)
    key_code: str = KEY_CODE
    value_code: str = VALUE_CODE
    sketch_dim: int = 32  # routing sketch dims per span token (even: 4-bit pairs)
    sketch_bits: int = 4  # its quantisation (4: two values per byte; 8: int8)
    prefill_chunk: int = 512
    stream: StreamSettings = field(default_factory=StreamSettings)

    def __post_init__(self) -> None:
        for name, kind in (("key_code", "key"), ("value_code", "value")):
            try:
                check_code(getattr(self, name), kind)
            except ValueError as exc:
                raise SekvError(f"store.{name}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BlockSettings:
    """What changes a block store's content (:mod:`sekv_core.methods.blocks`; part of its key)."""

    block_size: int = 16
    sinks: int = 4  # document tokens kept resident after the prompt head (as SeKV's sinks)
    prefill_chunk: int = 512

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "blocks", **asdict(self)}


@dataclass
class MethodSettings:
    """How a method answers; each method reads the fields it understands.

    budget : zoomed tokens per (layer, KV head); None: ``DEFAULT_BUDGET``, except that an answer
        whose memory target starves the zoom takes all the target leaves.
    memory_share : resident-memory target, a share of the fp16 full KV cache (the benchmarks
        hold every method to it; each method turns it into its own knob).
    router : the trained router the SeKV methods that use one route with: ``auto`` (yours
        from ``sekv train``, else the one shipped for the model; none: training-free) or the
        path of a router file from ``sekv train``. The method decides whether it routes with a
        trained router (``sekv``, ``sekv-trained``) or not (``sekv-training-free``).
    margin : a span is zoomed only within this many nats of the best span (training-free rule).
    neighbours : a span scores the best of itself and this many spans on each side.
    passages : books (beyond the window): tokens of whole-sentence passages every layer reads
        for the answer, chosen by the question's words and its attention beyond a neutral
        question's (:mod:`sekv_core.passages`); a
        ``budget`` given sets it too.
    sources : full KV (and retrieve, over its window) records the attention its answer pays the
        document, to name the answer's sources (:mod:`sekv_core.sources`; one more product per
        layer and step). SeKV's come with its attention at no cost.
    """

    budget: int | None = None
    memory_share: float | None = None
    router: str = "auto"
    margin: float = 6.0
    neighbours: int = 1
    passages: int = 512
    sources: bool = True
    prefill_chunk: int = 512
    store: StoreSettings = field(default_factory=StoreSettings)
    blocks: BlockSettings = field(default_factory=BlockSettings)
    warn: Callable[[str], None] | None = None  # told about stale stores being rebuilt


def exceeds_window(window: int, context_tokens: int) -> bool:
    """A context that leaves no room for a question in a ``window``-token model."""
    return context_tokens + ANSWER_RESERVE > window


def reading_window(window: int) -> int:
    """The positions SeKV reads a span store within: the model's ``window``, at most
    :data:`BOOK_WINDOW`."""
    return min(window, BOOK_WINDOW)


def is_book(window: int, context_tokens: int) -> bool:
    """Whether SeKV reads a context as a book in a ``window``-token model: streamed into a
    store with bounded positions and read by passages."""
    return exceeds_window(reading_window(window), context_tokens)


def override(settings: Any, assignments: Iterable[str]) -> Any:
    """``settings`` (a dataclass) with ``KEY=VALUE`` assignments applied, KEY a dotted field path
    (``neighbours=0``, ``store.segment.max_len=16``); values are parsed as the field's type.
    Raises SekvError naming the assignment a user must fix."""
    for text in assignments:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise SekvError(f"{text!r} is not KEY=VALUE (e.g. neighbours=0)")
        settings = _assign(settings, key.strip().split("."), value.strip(), key.strip())
    store = getattr(settings, "store", settings)
    if isinstance(store, StoreSettings):
        check_store(store)
    return settings


def check_store(settings: StoreSettings) -> None:
    """Raise SekvError naming the first store setting a user must fix."""
    seg = settings.segment
    if not 1 <= seg.min_len <= seg.max_len:
        raise SekvError(
            f"span lengths need 1 <= min_len <= max_len, not {seg.min_len}, {seg.max_len}"
        )
    if settings.sketch_dim < 2 or settings.sketch_dim % 2:
        raise SekvError("store.sketch_dim must be even (4-bit rows pack two dims per byte)")
    if settings.sketch_bits not in (4, 8):
        raise SekvError("store.sketch_bits is 4 or 8")


def setting_names(settings: Any, prefix: str = "") -> list[str]:
    """Every dotted setting path of a settings dataclass (what ``override`` accepts)."""
    names = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if dataclasses.is_dataclass(value):
            names += setting_names(value, f"{prefix}{f.name}.")
        elif not callable(value) and f.name != "warn":
            names.append(prefix + f.name)
    return names


def _assign(obj: Any, path: list[str], value: str, full: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else {}
    name = path[0]
    if name not in fields or name == "warn":
        known = ", ".join(setting_names(obj)) if fields else "none"
        raise SekvError(f"unknown setting {full!r}; settings here: {known}")
    current = getattr(obj, name)
    if len(path) > 1:
        return replace(obj, **{name: _assign(current, path[1:], value, full)})
    if dataclasses.is_dataclass(current):
        raise SekvError(f"{full!r} is a group of settings; set one of its fields")
    hint = typing.get_type_hints(type(obj))[name]
    return replace(obj, **{name: _parse(value, hint, full)})


def _parse(value: str, hint: Any, full: str) -> Any:
    kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if type(None) in kinds and value.lower() in ("none", "null", ""):
        return None
    for kind in (k for k in kinds if k is not type(None)):
        try:
            if kind is bool:
                if value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                    return value.lower() in ("1", "true", "yes", "on")
                continue
            if kind in (int, float, str):
                return kind(value)
        except ValueError:
            continue
    raise SekvError(f"{full}={value!r}: expected {getattr(hint, '__name__', hint)}")


def check_int(name: str, value: object, least: int) -> None:
    """TypeError unless ``value`` is an int (a bool is not), ArgumentError below ``least``;
    both name the argument ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < least:
        raise ArgumentError(f"{name} must be at least {least}, not {value}")


def check_real(name: str, value: object, low: float, high: float, low_open: bool) -> None:
    """TypeError unless ``value`` is a real number (a bool is not), ArgumentError outside
    ``low``..``high`` (``low`` itself excluded when ``low_open``; NaN is outside)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if not ((low < value) if low_open else (low <= value)) or not value <= high:
        where = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ArgumentError(f"{name} must be in {where}, not {value}")


def check_settings(settings: MethodSettings) -> None:
    """Raise TypeError or ArgumentError (a ValueError) naming the first of ``settings``'s
    numbers out of range: ``budget``, ``memory_share``, ``margin``, ``neighbours``,
    ``passages``."""
    if not isinstance(settings, MethodSettings):
        raise TypeError(f"settings must be a MethodSettings, not {type(settings).__name__}")
    if settings.budget is not None:
        check_int("settings.budget", settings.budget, 1)
    if settings.memory_share is not None:
        check_real("settings.memory_share", settings.memory_share, 0, 1, low_open=True)
    check_real("settings.margin", settings.margin, 0, float("inf"), low_open=False)
    check_int("settings.neighbours", settings.neighbours, 0)
    check_int("settings.passages", settings.passages, 1)


def check_question(question: str) -> None:
    """Refuse a question that is not text (TypeError) or is empty (the engine, and the CLI
    before the model loads)."""
    if not isinstance(question, str):
        raise TypeError(f"question must be a str, not {type(question).__name__}")
    if not question.strip():
        raise ArgumentError("the question is empty; ask something about the document")
