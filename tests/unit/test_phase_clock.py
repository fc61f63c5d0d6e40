"""PhaseClock on CUDA, with stand-in events on CPU: a boundary with nothing queued since the last
one records no event of its own, and its device phase reads as empty."""

import torch
from pagedserve.worker_svc import in_flight
from pagedserve.worker_svc.in_flight import PhaseClock


class FakeEvent:
    """Records the stream position it was recorded at: a phase's device time is the work
    queued between two events."""

    queued_ms = 0.0
    num_recorded = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at_ms: float | None = None

    def record(self) -> None:
        FakeEvent.num_recorded += 1
        self.at_ms = FakeEvent.queued_ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "FakeEvent") -> float:
        return end.at_ms - self.at_ms


def test_boundaries_with_nothing_queued_share_the_last_event(monkeypatch):
    monkeypatch.setattr(in_flight.torch.cuda, "Event", FakeEvent)
    FakeEvent.queued_ms, FakeEvent.num_recorded = 0.0, 0
    clock = PhaseClock(torch.device("cuda"))
    clock.mark(on_device=False)  # no swap out
    FakeEvent.queued_ms += 2.0  # a swap in
    clock.mark()
    clock.mark(on_device=False)  # no copy
    FakeEvent.queued_ms += 3.0  # the forward
    clock.mark()
    assert FakeEvent.num_recorded == 3
    assert clock.phases_ns() == [0, 2_000_000, 0, 3_000_000]
    assert len(clock.host_phases_ns()) == 4
