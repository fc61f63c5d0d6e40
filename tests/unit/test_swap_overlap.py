"""Swaps off the step's critical path: a step launched while the one before is in flight issues
its host-link copies at once, overlapping that step, except those that read or write a device
block that step may still use (or share a block with such a copy); compute queued after the
copies waits for them (the simulated GPU's copy lane models the real worker's swap stream)."""

from __future__ import annotations

import dataclasses

import pytest
from pagedserve.worker_svc.in_flight import Swaps, split_swaps
from pagedserve.worker_svc.sim.timeline import GpuTimeline

from tests.integration.worker_driver import make_worker
from tests.unit.test_worker_overlap import BLOCK_SIZE, _plans

FREE_BLOCK = 40  # used by no sequence of _plans(), whose tables hold blocks 0-4


class _RecordingCache:
    """The worker's cache engine, noting whether each swap was told to wait for compute."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.waits: list[tuple[str, bool]] = []
        self.swaps: list[tuple[str, list[tuple[int, int]], bool]] = []

    def swap_out(self, pairs, wait_for_compute=True):
        if pairs:
            self.waits.append(("out", wait_for_compute))
            self.swaps.append(("out", list(pairs), wait_for_compute))
        return self.inner.swap_out(pairs, wait_for_compute)

    def swap_in(self, pairs, wait_for_compute=True):
        if pairs:
            self.waits.append(("in", wait_for_compute))
            self.swaps.append(("in", list(pairs), wait_for_compute))
        return self.inner.swap_in(pairs, wait_for_compute)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def worker(tiny_model_dir):
    worker = make_worker(tiny_model_dir("llama"), block_size=BLOCK_SIZE)
    worker.cache_engine = _RecordingCache(worker.cache_engine)
    return worker


def _swaps_of_step_launched_ahead(worker, **swaps) -> list[tuple[str, bool]]:
    """The prefill of _plans() in flight, then its first decode with `swaps` launched ahead."""
    first, decode = _plans()[:2]
    in_flight = worker.launch_step(first)
    worker.sample_step(in_flight)
    worker.launch_step(dataclasses.replace(decode, **swaps), ahead_of=in_flight)
    return worker.cache_engine.waits


def test_a_host_hit_lands_in_free_blocks_while_the_step_before_runs(worker):
    waits = _swaps_of_step_launched_ahead(
        worker, blocks_to_swap_out=[(FREE_BLOCK + 1, 0)], blocks_to_swap_in=[(1, FREE_BLOCK)])
    assert waits == [("out", False), ("in", False)]


@pytest.mark.parametrize("swaps", [
    {"blocks_to_swap_in": [(2, 3)]},  # block 3: the second prompt's
    {"blocks_to_swap_out": [(1, 0)]},
], ids=["into-a-block-in-use", "out-of-a-block-in-use"])
def test_swaps_touching_a_block_of_the_step_in_flight_wait_for_it(worker, swaps):
    assert {wait for _, wait in _swaps_of_step_launched_ahead(worker, **swaps)} == {True}


def test_a_hit_partly_into_blocks_in_use_copies_the_rest_beside_the_step_before(worker):
    """A hit admitted as a request ends in the step in flight: a few of its blocks are that
    request's (freed when the plan was made), the rest free. Only those few wait for it."""
    _swaps_of_step_launched_ahead(
        worker, blocks_to_swap_out=[(0, 7)],
        blocks_to_swap_in=[(1, FREE_BLOCK), (2, 3), (4, FREE_BLOCK + 1)])
    assert worker.cache_engine.swaps == [
        ("in", [(1, FREE_BLOCK), (4, FREE_BLOCK + 1)], False),
        ("out", [(0, 7)], True),
        ("in", [(2, 3)], True),
    ]


def test_a_swap_sharing_a_cpu_block_with_a_waiting_swap_waits_too(worker):
    """CPU block 5 is written from a block in use, then read back: the read stays behind."""
    _swaps_of_step_launched_ahead(
        worker, blocks_to_swap_out=[(0, 5)], blocks_to_swap_in=[(5, FREE_BLOCK)])
    assert worker.cache_engine.swaps == [
        ("out", [(0, 5)], True),
        ("in", [(5, FREE_BLOCK)], True),
    ]


def test_swaps_of_a_step_launched_alone_wait_for_what_compute_holds(worker):
    first = _plans()[0]
    worker.execute_step(dataclasses.replace(first, blocks_to_swap_in=[(1, FREE_BLOCK)]))
    assert worker.cache_engine.waits == [("in", True)]


def test_a_copy_overlaps_the_queued_compute_and_the_compute_after_waits_for_it():
    """Seconds far above any host's jitter: the ends are ordered, not timed."""
    timeline = GpuTimeline()
    timeline.enqueue(100.0)
    compute_done = timeline.fence().done_at
    timeline.enqueue_copy(10.0, wait_for_compute=False)
    assert timeline.fence().done_at == compute_done  # hidden under the queued compute
    timeline.enqueue_copy(100.0, wait_for_compute=False)  # after the copy before: ends ~110 s
    after_copies = timeline.fence()
    assert after_copies.done_at > compute_done + 5.0
    assert after_copies.device_s == pytest.approx(10.0, abs=1.0)  # compute waited for the copy
    timeline.enqueue_copy(10.0)  # waits for everything compute holds, so ends ~10 s after it
    assert timeline.fence().done_at == pytest.approx(after_copies.done_at + 10.0, abs=1.0)


class _UnreadStep:
    """A step in flight whose blocks must not be read."""

    def block_ids(self) -> set[int]:
        raise AssertionError("the step in flight's blocks were gathered for no swap")


def test_a_step_without_swaps_does_not_gather_the_blocks_of_the_step_in_flight():
    """Most steps swap nothing: at 256 sequences the set of the step in flight's blocks (every
    block table) would cost the host ~0.1 ms a step for nothing."""
    assert split_swaps([], [], _UnreadStep()) == (Swaps([], []), Swaps([], []))
