"""Copies split over threads (wire/threads.py): bit-exact for any cut, errors raised."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.wire import threads
from kvstore.wire.threads import LANE_BYTES


def test_a_failed_share_is_raised_after_the_others_are_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(threads, "COPY_LANES", 2)
    source = np.ones(LANE_BYTES * 4, dtype=np.uint8)
    target = np.zeros(LANE_BYTES * 4, dtype=np.uint8)
    real = threads._move_share

    def second_fails(spans: list[threads.Span]) -> None:
        if spans[0][1] != target.ctypes.data:  # not the first share
            raise OSError("this share failed")
        real(spans)

    monkeypatch.setattr(threads, "_move_share", second_fails)
    with pytest.raises(OSError, match="this share failed"):
        threads.copy_spans([(source.ctypes.data, target.ctypes.data, source.nbytes)])
    assert target[: LANE_BYTES * 2].all()  # the first share, copied on this thread, is whole


@pytest.mark.parametrize(
    "sizes",
    [
        [100],  # small: one lane
        [LANE_BYTES * 4 + 3],  # one large span, cut inside it
        [LANE_BYTES // 3 + 1] * 17,  # many small spans, shares ending inside some of them
        [LANE_BYTES * 2, 1, LANE_BYTES + 5, 0, 7],
    ],
)
def test_spans_are_copied_bit_exact_however_the_bytes_are_cut(
    sizes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(threads, "COPY_LANES", 3)
    rng = np.random.default_rng(len(sizes))
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
    targets = [np.zeros(size, dtype=np.uint8) for size in sizes]
    spans = [
        (s.ctypes.data, t.ctypes.data, s.nbytes) for s, t in zip(sources, targets, strict=True)
    ]

    threads.copy_spans(spans)

    for source, target in zip(sources, targets, strict=True):
        assert np.array_equal(source, target)


def test_span_shares_cover_the_bytes_once_in_order() -> None:
    shares = threads._span_shares([(100, 1000, 5), (200, 2000, 3), (300, 3000, 8)], 6)
    assert shares == [
        [(100, 1000, 5), (200, 2000, 1)],
        [(201, 2001, 2), (300, 3000, 4)],
        [(304, 3004, 4)],
    ]
