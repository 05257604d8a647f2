"""How much shorter the offload tier could code under other per-stream tables (tenth study).

Builds each document's store with today's code and, for every stream the rANS coder writes
(part, layer, KV head, field), sums: its empirical order-0 entropy (a table of its own counts:
the bound for any table per stream); the bits under today's table (a discretised Gaussian,
centre and one of six spreads); under a generalised Gaussian exp(-|z|^b / 2) with the best of
five shapes b and nine spreads; and the same with 2^-14 probability steps instead of 2^-12.

    python docs/history/rans-model-probe.py sample_docs/lighthouse.md sample_docs/handbook.pdf
"""

import os
import sys
import tempfile

import numpy as np

os.environ["SEKV_HOME"] = tempfile.mkdtemp()
from sekv_core import rans  # noqa: E402
from sekv_core.documents import load_document  # noqa: E402
from sekv_core.ingest import open_or_build  # noqa: E402
from sekv_core.models import load_model  # noqa: E402
from sekv_core.prompt import chat_template, encode_context  # noqa: E402

SHAPES = (1.0, 1.25, 1.5, 1.75, 2.0)
SPREADS = (0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0, 1.15, 1.35)
bits = dict.fromkeys(("entropy", "today", "shaped", "shaped_14"), 0.0)


def tables(params, widths, H, shape, prob_bits):
    stream_widths = rans._stream_widths(widths, H)
    out = np.zeros((stream_widths.size, rans.TABLE), dtype=np.int64)
    for width in np.unique(stream_widths).tolist():
        at, n = np.flatnonzero(stream_widths == width), 2**width
        k = np.arange(n, dtype=np.float64)
        centre, spread = (params[at, i : i + 1].astype(np.float64) for i in (0, 1))
        logp = -0.5 * np.abs((k - centre) / spread) ** shape
        p = np.exp(logp - logp.max(axis=1, keepdims=True))
        freq = 1 + np.floor(p / p.sum(axis=1, keepdims=True) * (2**prob_bits - n)).astype(int)
        freq[np.arange(at.size), p.argmax(axis=1)] += 2**prob_bits - freq.sum(axis=1)
        out[at, :n] = freq
    return out


def cost(counts, freq, prob_bits):
    return -(counts * np.log2(np.maximum(freq, 1) / 2**prob_bits)).sum(axis=1)


def probe(flat, part_rows, code, _compact=rans._compact_kind):
    widths, flips = code.record_fields()
    L, H, B = widths.shape[0], code.basis.shape[1], code.record_bytes
    for records in rans._parts(flat, part_rows, L, H, B):
        counts = rans._histogram(records, widths, flips).astype(np.float64)
        total = np.maximum(counts.sum(axis=1, keepdims=True), 1)
        bits["entropy"] += -(counts * np.log2(np.where(counts > 0, counts / total, 1))).sum()
        fitted = rans._fit(counts.astype(np.int64), widths, H)
        bits["today"] += cost(counts, rans._tables(fitted, widths, H), 12).sum()
        k = np.arange(rans.TABLE, dtype=np.float64)
        mean = (counts * k).sum(axis=1) / total[:, 0]
        dev = np.sqrt((counts * (k - mean[:, None]) ** 2).sum(axis=1) / total[:, 0])
        for name, prob_bits in (("shaped", 12), ("shaped_14", 14)):
            best = None
            for shape in SHAPES:
                for m in SPREADS:
                    trial = np.stack([mean, np.maximum(dev, 0.25) * m], axis=1).astype(np.float16)
                    c = cost(counts, tables(trial, widths, H, shape, prob_bits), prob_bits)
                    best = c if best is None else np.minimum(best, c)
            bits[name] += best.sum()
    return _compact(flat, part_rows, code)


rans._compact_kind = probe
loaded = load_model(None)
for path in sys.argv[1:]:
    document = load_document(path)
    context = encode_context(loaded.tokenizer, chat_template(loaded.tokenizer), document.text)
    bits.update(dict.fromkeys(bits, 0.0))
    open_or_build(loaded, document, context)
    row = {name: round(b / 8) for name, b in bits.items()}
    print(path, row, {name: round(b / bits["today"], 4) for name, b in bits.items()})
