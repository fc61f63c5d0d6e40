"""A step between launch and finish: what the device is computing, the fence the host waits at
for it, and the clock of its phases. When the next step is launched before this one finishes is
LaunchWindow's rule (worker_svc/launch_window.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Protocol

import torch
from pagedserve.worker_svc.model_input import ModelInput
from pagedserve.worker_svc.sampler import PendingSamples
from pagedserve.worker_svc.sequence_mirrors import CachedSequence

_POLL_S = 1e-4  # between looks at a CUDA event that is not reached yet


class Fence(Protocol):
    # a modelled device's time for the work queued since the fence before (the simulated GPU);
    # None where the device's time is measured instead
    device_s: float | None

    def seconds_left(self) -> float:
        """0 once wait() would return at once; else how long to wait before asking again."""

    def wait(self) -> None: ...


class _Passed:
    device_s = None

    def seconds_left(self) -> float:
        return 0.0

    def wait(self) -> None:
        pass


PASSED = _Passed()  # the host device: its work is done when the call returns


class _EventFence:
    device_s = None

    def __init__(self) -> None:
        self._event = torch.cuda.Event()
        self._event.record()

    def seconds_left(self) -> float:
        return 0.0 if self._event.query() else _POLL_S

    def wait(self) -> None:
        self._event.synchronize()


def device_fence(device: torch.device) -> Fence:
    """The work queued on `device` so far."""
    return _EventFence() if device.type == "cuda" else PASSED


class PhaseClock:
    """On CUDA the phase boundaries are stream events, read once the sampled ids are on the host
    (that copy waited for them all), so timing adds no sync. Host clocks serve CPU devices and
    steps that never wait for the device."""

    def __init__(self, device: torch.device) -> None:
        self._host_ns: list[int] = []
        self._events: list[torch.cuda.Event] | None = [] if device.type == "cuda" else None
        self.mark()

    def mark(self, on_device: bool = True) -> None:
        """on_device=False: a boundary the device phases see as empty, with no event of its
        own: nothing was queued since the last one (no swaps, say), or a host-only boundary
        (a wait), when the stream may hold a later step's work already."""
        self._host_ns.append(time.perf_counter_ns())
        if self._events is not None:
            if on_device or not self._events:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
            else:
                event = self._events[-1]
            self._events.append(event)

    def host_phases_ns(self) -> list[int]:
        return [end - start for start, end in pairwise(self._host_ns)]

    def phases_ns(self) -> list[int]:
        if self._events is None:
            return self.host_phases_ns()
        self._events[-1].synchronize()  # recorded after that copy: the stream is idle already
        return [round(start.elapsed_time(end) * 1e6) for start, end in pairwise(self._events)]


@dataclass(frozen=True, slots=True)
class DraftTimes:
    """A step's draft model work."""

    host_ns: int = 0  # the host's time in it, within the prepare phase
    draft_ns: int = 0  # the proposing forwards' device time
    catch_up_ns: int = 0  # the device time of the forward catching up lagging sequences
    # sequences with lookahead slots whose draft KV was too far behind to propose this step
    behind_seq_ids: frozenset[int] = frozenset()


@dataclass(slots=True)
class InFlightStep:
    step_id: int
    clock: PhaseClock
    scheduled: list[CachedSequence]  # empty: nothing ran (cache ops at most)
    model_input: ModelInput | None = None
    logits: torch.Tensor | None = None  # None on tensor-parallel ranks > 0
    samples: PendingSamples | None = None  # set by ModelRunner.sample
    fence: Fence = PASSED
    pooled: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (seq_id, [hidden])
    # the swaps' modelled seconds (out, in) on a simulated cache; None: the clock times them
    modelled_swap_s: tuple[float | None, float | None] = (None, None)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device
    drafting: DraftTimes = DraftTimes()
    mask_ns: int = 0  # what the draws waited for the token bitmask (set by ModelRunner.sample)

    def block_ids(self) -> set[int]:
        """The device blocks the step reads or writes: its sequences' block tables (as they
        stand until the next step's deltas) and its copy-on-write pairs."""
        block_ids = {b for pair in self.blocks_to_copy for b in pair}
        for seq in self.scheduled:
            block_ids.update(seq.block_table)
        return block_ids

    def draws_by_seq(self) -> dict[int, int]:
        """seq_id → index into samples.token_ids, for the sequences drawing one token."""
        if self.samples is None:
            return {}
        offsets = self.samples.offsets
        return {s.seq_id: offsets[i] for i, s in enumerate(self.model_input.sample_seqs)
                if s.num_samples == 1}


@dataclass(frozen=True, slots=True)
class Swaps:
    out: list[tuple[int, int]]  # (device block, CPU block)
    into: list[tuple[int, int]]  # (CPU block, device block)


def split_swaps(swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                in_flight: InFlightStep | None) -> tuple[Swaps, Swaps]:
    """(early, late): the late swaps read or write a device block the step in flight may still
    use, or a block (device or CPU) a late swap uses, and wait for that step; the early ones run
    beside it, ahead of the late ones (a hit whose blocks mostly come back into free blocks copies
    those while the step before runs). Without a step in flight every swap is late. Each keeps the
    order swap out, then swap in, and the plan's order within each."""
    if in_flight is None:
        return Swaps([], []), Swaps(list(swap_out), list(swap_in))
    if not swap_out and not swap_in:  # most steps: no set of the step in flight's blocks
        return Swaps([], []), Swaps([], [])
    late_device = in_flight.block_ids()
    late_cpu: set[int] = set()
    is_late_out = [False] * len(swap_out)
    is_late_in = [False] * len(swap_in)
    is_changed = True
    while is_changed:  # a swap made late makes late every swap sharing a block with it
        is_changed = False
        for is_late, pairs, (device_at, cpu_at) in ((is_late_out, swap_out, (0, 1)),
                                                    (is_late_in, swap_in, (1, 0))):
            for i, pair in enumerate(pairs):
                if not is_late[i] and (pair[device_at] in late_device or pair[cpu_at] in late_cpu):
                    is_late[i] = is_changed = True
                    late_device.add(pair[device_at])
                    late_cpu.add(pair[cpu_at])
    return (Swaps([p for p, late in zip(swap_out, is_late_out, strict=True) if not late],
                  [p for p, late in zip(swap_in, is_late_in, strict=True) if not late]),
            Swaps([p for p, late in zip(swap_out, is_late_out, strict=True) if late],
                  [p for p, late in zip(swap_in, is_late_in, strict=True) if late]))
