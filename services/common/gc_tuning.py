"""Garbage collection for a long-running service process. Each engine step allocates thousands
of short-lived objects (dataclasses, protobuf messages, lists); with CPython's default thresholds
that runs a young collection every 700 allocations and, every hundred of those, a full one over
everything alive: the model, the tokenizer, every live sequence. After start-up, what exists is
frozen (never scanned again) and young collections run less often; reference counting still frees
almost everything at once, the collector only finds cycles."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

GEN0_THRESHOLD = 50_000  # allocations between young collections (CPython's default: 700)
GEN1_THRESHOLD = 20  # young collections between middle ones (default 10)
GEN2_THRESHOLD = 100  # middle collections between full ones (default 10)


def tune_gc_after_startup() -> None:
    """Call once the process has loaded what it keeps for its lifetime (the scheduler and the
    gateway)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD)


def tune_gc_after_load() -> None:
    """The worker's, after each model load: a LoadModel may replace the model, so what the last
    load froze is unfrozen first and the replaced model's cycles are collected."""
    gc.unfreeze()
    tune_gc_after_startup()


@contextlib.contextmanager
def raised_thresholds() -> Iterator[None]:
    """The in-process engine's (`LLM.generate`, `chat`, `embed`): the caller's process is not the
    engine's to freeze, so only the thresholds are raised while it steps (none lowered below what
    the caller set), and the caller's are back afterwards. A batch of 256 streams ran a full
    collection over the model's and the tokenizer's objects (~250 ms) every ~40 steps with
    CPython's defaults."""
    before = gc.get_threshold()
    ours = (GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD)
    gc.set_threshold(*(max(mine, theirs) for mine, theirs in zip(ours, before, strict=True)))
    try:
        yield
    finally:
        gc.set_threshold(*before)
