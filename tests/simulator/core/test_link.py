"""The KV link between a prefill and a decode node: processor sharing, async, blocking on decode."""

from __future__ import annotations

import pytest

from simulator.core.link import Link, TransferMode
from simulator.core.profile import LinkSpec

SPEC = LinkSpec("test", bandwidth_bytes_per_s=1e9, latency_s=0.0)


def test_shared_link_is_processor_sharing() -> None:
    link = Link(SPEC, TransferMode.SHARED_LINK)
    a = link.start(0.0, 1_000_000_000)  # 1 s alone
    b = link.start(0.5, 250_000_000)  # from 0.5 s both get half: b needs 0.5 s, a finishes at 1.25 s
    assert link.next_completion_at() == pytest.approx(1.0)
    done = link.completions_until(1.0)
    assert [d.transfer_id for d in done] == [b]
    assert done[0].at == pytest.approx(1.0)
    assert link.next_completion_at() == pytest.approx(1.25)
    done = link.completions_until(2.0)
    assert [d.transfer_id for d in done] == [a]
    assert done[0].at == pytest.approx(1.25)
    assert link.active == 0
    assert link.next_completion_at() is None


def test_shared_link_latency_and_cancel() -> None:
    link = Link(LinkSpec("l", 1e9, 0.01), TransferMode.SHARED_LINK)
    a = link.start(0.0, 1_000_000_000)
    b = link.start(0.0, 1_000_000_000)
    assert link.cancel(a, 0.5)
    assert not link.cancel(a, 0.5)
    # b had 0.25 GB at 0.5 s, then the whole link: done at 1.25 s + 10 ms latency.
    assert link.next_completion_at() == pytest.approx(1.26)
    assert [d.transfer_id for d in link.completions_until(1.3)] == [b]


def test_async_link_has_no_contention() -> None:
    link = Link(SPEC, TransferMode.ASYNC)
    link.start(0.0, 1_000_000_000)
    link.start(0.0, 1_000_000_000)
    done = link.completions_until(1.0)
    assert [d.at for d in done] == [pytest.approx(1.0), pytest.approx(1.0)]


def test_blocking_mode_reports_the_decode_stall() -> None:
    nvlink = LinkSpec("nvlink", 149e9, 0.0)
    link = Link(LinkSpec("100gbe", 10e9, 0.0), TransferMode.BLOCKING_ON_DECODE, physical=nvlink)
    n = 5115 * 131_072
    link.start(0.0, n)
    (done,) = link.completions_until(1.0)
    assert done.at == pytest.approx(n / 149e9)
    assert done.stall_s == pytest.approx(n / 10e9 - n / 149e9)
