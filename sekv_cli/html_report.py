"""One self-contained HTML page of a span store report (:func:`sekv_core.report.build_report`).

The page loads nothing from the network: CSS and the tooltip script are inline, the surprisal plot
is inline SVG and text uses the system's fonts. Every piece of document text is escaped.
"""

from __future__ import annotations

import html
import re
from typing import Any

from .html_style import CSS, SCALE, SCRIPT
from .words import how_many, human_bytes

PLOT_W, PLOT_H = 1120, 230
PAD_L, PAD_R, PAD_T, PAD_B = 44, 12, 14, 40


def render_html(report: dict[str, Any]) -> str:
    """The whole page for one report (a string of HTML, nothing external)."""
    doc = report["document"]
    title = f"sekv inspect · {doc['name']}"
    body = "\n".join(
        [
            f"<h1>{_e(doc['name'])}</h1>",
            f'<div class="sub">{_e(report["model"])} · store <code>'
            f"{_e(report['store']['path'])}</code></div>",
            _cards(report),
            _memory(report),
            _plot(report),
            _text(report),
            _table(report),
            _footer(report),
        ]
    )
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{_e(title)}</title><style>{CSS}</style></head>\n"
        f"<body><main>\n{body}\n</main>"
        f'<div id="tip" hidden></div><script>{SCRIPT}</script></body></html>\n'
    )


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _cards(report: dict[str, Any]) -> str:
    doc, st, b, r = report["document"], report["stats"], report["bytes"], report["ratios"]
    sl = st["span_len"]
    pages = how_many(doc["pages"], "page")
    fp32 = human_bytes(b["full_kv_fp32"])
    cards = [
        ("tokens", f"{doc['tokens']:,}", f"{pages} · +{doc['doc_start']} prompt head"),
        ("spans", f"{st['spans']:,}", f"length {sl['min']}–{sl['max']}, p50 {sl['p50']:g}"),
        (
            "anchors",
            f"{st['anchors_pct']:g}%",
            f"{how_many(st['anchors'], 'token')} · {how_many(st['sinks'], 'sink')}",
        ),
        ("threshold", f"{st['threshold_nats']:.2f}", "nats (μ + α·σ)"),
        (
            "code k / v",
            f"{_num(st['key_bits'])} / {_num(st['value_bits'])}",
            "bits per offloaded number (fp16: 16)",
        ),
        ("resident", human_bytes(b["resident"]), f"{r['resident']:.1%} of fp16 full KV"),
        ("offloaded", human_bytes(b["offloaded"]), f"{r['offloaded']:.1%} of fp16 full KV"),
        ("on disk", human_bytes(b["store"]), f"{r['store']:.1%} of fp16 full KV"),
        ("full KV", human_bytes(b["full_kv_fp16"]), f"fp16 · {fp32} fp32"),
    ]
    inner = "".join(
        f'<div class="card"><div class="k">{_e(k)}</div><div class="v">{_e(v)}</div>'
        f'<div class="d">{_e(d)}</div></div>'
        for k, v, d in cards
    )
    return f'<div class="cards">{inner}</div>'


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


def _memory(report: dict[str, Any]) -> str:
    b = report["bytes"]
    full = max(b["full_kv_fp32"], 1)
    rows = [
        ("resident (device)", b["resident"], "#2455c3"),
        ("offloaded (CPU/disk)", b["offloaded"], "#7c3aed"),
        ("trace (explanations)", b["trace"], "#94a3b8"),
        ("full KV fp16", b["full_kv_fp16"], "#f59e0b"),
        ("full KV fp32", b["full_kv_fp32"], "#fcd34d"),
    ]
    fp16 = max(b["full_kv_fp16"], 1)
    cells = "".join(
        f"<div>{_e(name)}</div><div class='track'><div class='fill' style='width:"
        f"{max(100 * n / full, 0.3):.2f}%;background:{color}'></div></div>"
        f"<div class='n'>{_e(human_bytes(n))} · {n / fp16:.1%}</div>"
        for name, n, color in rows
    )
    return (
        "<section><h2>Memory per tier</h2>"
        f'<div class="mem">{cells}</div>'
        '<div class="sub" style="margin:10px 0 0">Percentages are of an fp16 full KV cache of '
        "the same context; bars are to scale.</div></section>"
    )


def _plot(report: dict[str, Any]) -> str:
    tokens, spans = report["tokens"], report["spans"]
    n = max(len(tokens), 1)
    hs = [t["surprisal"] for t in tokens]
    top = max(max(hs, default=1.0), report["stats"]["threshold_nats"]) * 1.05
    iw, ih = PLOT_W - PAD_L - PAD_R, PLOT_H - PAD_T - PAD_B
    y0 = PAD_T + ih

    def x(i: float) -> float:
        return PAD_L + iw * i / n

    def y(h: float) -> float:
        return y0 - ih * h / top

    parts = [
        f'<svg viewBox="0 0 {PLOT_W} {PLOT_H}" role="img" '
        f'aria-label="Surprisal per token with span boundaries">'
    ]
    # span bands (alternating) with a tooltip each, sinks shaded
    for s in spans:
        fill = "#eef2ff" if s["id"] % 2 else "#f0fdfa"
        parts.append(
            f'<rect x="{x(s["start"]):.2f}" y="{PAD_T}" width="{x(s["end"]) - x(s["start"]):.2f}" '
            f'height="{ih}" fill="{fill}"><title>span {s["id"]} · tokens {s["start"]}–'
            f"{s['end']} · page {s['page']}</title></rect>"
        )
    sinks = sum(1 for t in tokens if t["role"] == "sink")
    parts.append(
        f'<rect x="{PAD_L}" y="{PAD_T}" width="{x(sinks) - PAD_L:.2f}" height="{ih}" '
        'fill="#e5e7eb"><title>sinks (prompt head and first document tokens)</title></rect>'
    )
    # y grid
    step = 5 if top > 12 else 2
    for v in range(0, int(top) + 1, step):
        parts.append(
            f'<line x1="{PAD_L}" x2="{PLOT_W - PAD_R}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
            f'stroke="#e5e7eb" stroke-width="0.6"/><text x="{PAD_L - 6}" y="{y(v) + 4:.1f}" '
            f'text-anchor="end">{v}</text>'
        )
    # surprisal bars: one path, a vertical stroke per token
    bw = max(min(iw / n * 0.8, 4), 0.6)
    bars = "".join(f"M{x(i + 0.5):.1f} {y0}V{y(h):.1f}" for i, h in enumerate(hs))
    parts.append(f'<path d="{bars}" stroke="#fb923c" stroke-width="{bw:.2f}" fill="none"/>')
    # moving mean (16 tokens) to show the trend
    w = 16
    acc, pts = 0.0, []
    for i, h in enumerate(hs):
        acc += h - (hs[i - w] if i >= w else 0.0)
        pts.append(f"{x(i + 0.5):.1f},{y(acc / min(i + 1, w)):.1f}")
    parts.append(
        f'<polyline points="{" ".join(pts)}" fill="none" stroke="#7c2d12" stroke-width="1.2" '
        'stroke-opacity="0.7"/>'
    )
    # anchors
    for i, t in enumerate(tokens):
        if t["role"] == "anchor":
            parts.append(
                f'<circle cx="{x(i + 0.5):.1f}" cy="{y(t["surprisal"]):.1f}" r="2.6" '
                f'fill="#2455c3"><title>anchor {_e(t["text"].strip())} · '
                f"{t['surprisal']:.2f} nats</title></circle>"
            )
    # threshold
    th = report["stats"]["threshold_nats"]
    parts.append(
        f'<line x1="{PAD_L}" x2="{PLOT_W - PAD_R}" y1="{y(th):.1f}" y2="{y(th):.1f}" '
        'stroke="#dc2626" stroke-width="1.2" stroke-dasharray="5 4"/>'
        f'<text x="{PLOT_W - PAD_R - 4}" y="{y(th) - 5:.1f}" text-anchor="end" '
        f'class="halo" style="fill:#dc2626">threshold {th:.2f} nats</text>'
    )
    # span boundary ticks under the axis, token index labels
    ticks = "".join(f"M{x(s['start']):.1f} {y0}v7" for s in spans)
    parts.append(
        f'<line x1="{PAD_L}" x2="{PLOT_W - PAD_R}" y1="{y0}" y2="{y0}" stroke="#9ca3af"/>'
        f'<path d="{ticks}" stroke="#475569" stroke-width="1"/>'
    )
    for v in _nice_ticks(n):
        parts.append(f'<text x="{x(v):.1f}" y="{y0 + 20}" text-anchor="middle">{v:,}</text>')
    parts.append(
        f'<text x="{PAD_L + iw / 2:.1f}" y="{PLOT_H - 4}" text-anchor="middle">token index '
        "(ticks: span starts; bands: spans; dots: anchors; line: 16-token mean)</text>"
        f'<text x="12" y="{PAD_T + ih / 2:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 12 {PAD_T + ih / 2:.1f})">nats</text></svg>'
    )
    return "<section><h2>Surprisal along the context</h2>" + "".join(parts) + "</section>"


def _nice_ticks(n: int) -> list[int]:
    raw = n / 8
    step = next(s for s in (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 10**9) if s >= raw)
    return list(range(0, n + 1, step))


def scale_top(report: dict[str, Any]) -> float:
    """Surprisal (nats) at the top of the colour scale: the 99th percentile, at least 1.2x the
    threshold so that anchors and near-threshold tokens stay apart."""
    return max(report["surprisal"]["p99"], report["stats"]["threshold_nats"] * 1.2, 1e-6)


def _bin(h: float, top: float) -> int:
    return max(0, min(len(SCALE) - 1, int(len(SCALE) * h / top)))


def _text(report: dict[str, Any]) -> str:
    tokens = report["tokens"]
    doc_start = report["document"]["doc_start"]
    top = scale_top(report)
    head = "".join(_token(t, t["text"], top) for t in tokens[:doc_start])
    boxes = _SpanBoxes({s["id"]: s for s in report["spans"]})
    page = 1
    for t in tokens[doc_start:]:
        boxes.enter(t["span"])
        for piece in _NEWLINES.split(t["text"]):
            if piece.startswith("\n"):  # line breaks sit between boxes, never inside one
                boxes.close()
                boxes.out.append(piece)
            elif piece:
                if t["page"] != page:  # a page marker where a new page's text begins
                    page = t["page"]
                    boxes.out.append(f'<span class="page">page {page}</span>')
                boxes.open()
                boxes.out.append(_token(t, piece, top))
    boxes.close()
    out = boxes.out
    ramp = "".join(f'<i style="background:{c}"></i>' for c in SCALE)
    legend = (
        '<div class="legend">'
        f"<span>surprisal 0<span class='ramp'>{ramp}</span>{top:.1f}+ nats</span>"
        '<span><span class="span" data-id="n">span</span> boxed</span>'
        '<span><span class="anchor">anchor</span> full resolution</span>'
        '<span><span class="sink">sink</span> attention sink</span>'
        "<span>hover for spans and surprisal</span></div>"
    )
    head_block = (
        f'<div class="head" title="prompt head: {doc_start} sink tokens before the document">'
        f"{head}</div>"
        if head
        else ""
    )
    return (
        "<section><h2>Document, segmented</h2>"
        f'{legend}{head_block}<div class="doc">{"".join(out)}</div></section>'
    )


_NEWLINES = re.compile(r"(\n+)")


def _token(t: dict[str, Any], text: str, top: float) -> str:
    h = t["surprisal"]
    if t["role"] == "anchor":
        return f'<span class="anchor" title="anchor · {h:.2f} nats">{_e(text)}</span>'
    if t["role"] == "sink":
        return f'<span class="sink" title="sink · {h:.2f} nats">{_e(text)}</span>'
    return f'<span class="t h{_bin(h, top)}" title="{h:.2f} nats">{_e(text)}</span>'


class _SpanBoxes:
    """Emits span elements around tokens; a span broken by line breaks continues in a second
    element (class ``cont``, no id) so that each span has exactly one element with an id."""

    def __init__(self, spans: dict[int, dict[str, Any]]) -> None:
        self.spans, self.out = spans, []
        self.current: int | None = None
        self.is_open = False
        self.started: set[int] = set()

    def enter(self, span: int | None) -> None:
        if span != self.current:
            self.close()
            self.current = span

    def open(self) -> None:
        if self.is_open or self.current is None:
            return
        i, s = self.current, self.spans[self.current]
        tip = (
            f"span {i} · tokens {s['start']}–{s['end']} ({s['length']}) · page {s['page']}\n"
            f"offloaded {human_bytes(s['offloaded_bytes'])}"
        )
        cls = "span alt" if i % 2 else "span"
        ident = f' id="span-{i}"' if i not in self.started else ""
        cls += " cont" if i in self.started else ""
        self.out.append(f'<span class="{cls}"{ident} data-id="{i}" title="{_e(tip)}">')
        self.started.add(i)
        self.is_open = True

    def close(self) -> None:
        if self.is_open:
            self.out.append("</span>")
            self.is_open = False


def _table(report: dict[str, Any]) -> str:
    heads = ("span", "tokens", "page", "length", "offloaded")
    head = "".join(
        f'<th class="{"num" if i > 1 else ""}">{_e(h)}</th>' for i, h in enumerate(heads)
    )
    rows = "".join(
        f'<tr id="row-{s["id"]}"><td><a href="#span-{s["id"]}">{s["id"]}</a></td>'
        f"<td>{s['start']}–{s['end']}</td><td class='num'>{s['page']}</td>"
        f"<td class='num'>{s['length']}</td>"
        f"<td class='num'>{_e(human_bytes(s['offloaded_bytes']))}</td>"
        f"<td class='pre'>{_e(s['preview'])}</td></tr>"
        for s in report["spans"]
    )
    return (
        "<section><h2>Spans</h2>"
        f"<table><thead><tr>{head}<th>preview</th></tr></thead><tbody>{rows}</tbody></table>"
        "</section>"
    )


def _footer(report: dict[str, Any]) -> str:
    s = report["settings"]
    seg = s.get("segment", {})
    bits = [f"{k} {v}" for k, v in seg.items()] + [
        f"key code {s.get('key_code')}",
        f"value code {s.get('value_code')}",
    ]
    return (
        f"<footer>Settings: {_e(', '.join(bits))}. Document sha256 "
        f"{_e(report['document']['sha256'][:16])}… · store created "
        f"{_e(report['store'].get('created') or '?')} · generated by sekv inspect.</footer>"
    )
