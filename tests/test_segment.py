import numpy as np
import pytest

from sekv_core.config import SegmentSettings
from sekv_core.segment import ANCHOR, SINK, SPAN, segment

SETTINGS = [
    SegmentSettings(),
    SegmentSettings(alpha=0.5, min_len=8, max_len=16, sinks=2, anchor_cap=0.2),
    SegmentSettings(alpha=2.0, min_len=32, max_len=128, sinks=0, anchor_cap=0.0),
]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("seed", range(5))
def test_every_token_in_exactly_one_role(settings, seed):
    rng = np.random.default_rng(seed)
    total = int(rng.integers(50, 3000))
    head = int(rng.integers(0, 40))
    surprisal = rng.gamma(1.5, 2.0, total).astype(np.float32)
    seg = segment(surprisal, head, settings)

    assert set(np.unique(seg.roles)) <= {SINK, ANCHOR, SPAN}
    assert (seg.roles[: min(total, head + settings.sinks)] == SINK).all()
    assert (seg.roles[head + settings.sinks :] != SINK).all()
    # spans: ascending, disjoint, contiguous ranges that hold exactly the SPAN tokens
    assert (seg.starts[1:] >= seg.ends[:-1]).all() and (seg.ends > seg.starts).all()
    covered = np.zeros(total, dtype=int)
    for s, e in zip(seg.starts, seg.ends, strict=True):
        covered[s:e] += 1
    assert (covered == (seg.roles == SPAN)).all()
    assert (seg.span_of()[seg.roles == SPAN] >= 0).all()
    # length control and the anchor cap
    assert seg.lengths.max(initial=0) <= settings.max_len
    doc = total - head
    assert len(seg.anchors) <= int(settings.anchor_cap * doc)
    assert (surprisal[seg.anchors] > seg.threshold).all()


def test_peaks_open_spans_once_long_enough():
    h = np.ones(400, dtype=np.float32)
    peaks = [50, 55, 120, 300]  # 55 is too close to 50 to open a span of its own
    h[peaks] = 20.0
    seg = segment(h, 0, SegmentSettings(min_len=16, max_len=200, sinks=4, anchor_cap=0.1))
    assert list(seg.anchors) == [50, 120, 300]
    assert seg.roles[55] == SPAN
    assert list(seg.starts) == [4, 51, 121, 301]


def test_default_threshold_is_mu_plus_alpha_sigma():
    h = np.random.default_rng(0).normal(3, 1, 500).astype(np.float32)
    seg = segment(h, 10, SegmentSettings(alpha=1.5))
    doc = h[10:].astype(np.float64)
    assert seg.threshold == pytest.approx(doc.mean() + 1.5 * doc.std())
