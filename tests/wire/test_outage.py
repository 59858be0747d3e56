"""The breaker's state: one outage per run of failures, its length, and when to try again."""

from __future__ import annotations

import pytest

from kvstore.wire.outage import Outage


def test_an_outage_begins_once_and_ends_once_with_its_length() -> None:
    outage = Outage(retry_s=2.0)
    assert not outage.down and outage.due(0.0)
    assert outage.fail(10.0)  # the first failure begins it: the one to log
    assert not outage.fail(11.0)  # later failures of the same outage do not
    assert outage.down and outage.failures == 2
    assert not outage.due(12.5) and outage.due(13.0)  # retry_s after the last failure
    assert outage.answered(14.0) == 4.0  # lasted from the first failure
    assert outage.answered(15.0) is None  # not down: nothing to log
    assert not outage.down and outage.due(15.0) and outage.failures == 2


def test_retry_now_makes_an_attempt_due_at_once() -> None:
    outage = Outage(retry_s=60.0)
    outage.fail(0.0)
    assert not outage.due(1.0)
    outage.retry_now()  # another link to the same daemon just connected
    assert outage.due(1.0) and outage.down


@pytest.mark.parametrize("retry_s", [-1.0, float("nan")])
def test_a_negative_or_nan_interval_is_refused_by_name(retry_s: float) -> None:
    with pytest.raises(ValueError, match="retry_s"):
        Outage(retry_s)
