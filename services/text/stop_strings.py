"""Stop strings over streamed text. Text that could start a stop string is held back, so a
client never sees text a stop later takes away. The first stop to *complete* wins (ties: the
earliest start), so the result does not depend on how the text was split into pushes."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """One per output sequence. Not thread-safe."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)}")
        self._stop = tuple(dict.fromkeys(stop))
        self._include_stop_str = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1
        # what may be held: the proper prefixes of the stop strings (a set lookup per length)
        self._prefixes = frozenset(s[:n] for s in self._stop for n in range(1, len(s)))
        self._held = ""
        self._is_stopped = False

    @property
    def has_stops(self) -> bool:
        return bool(self._stop)

    @property
    def is_stopped(self) -> bool:
        return self._is_stopped

    @property
    def held_text(self) -> str:
        return self._held

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string matched)."""
        if self._is_stopped:
            return "", True
        if not self._stop:
            return text, False
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, end = match
            self._is_stopped = True
            self._held = ""
            return buffer[:end if self._include_stop_str else start], True
        num_held = self._num_held(buffer)
        self._held = buffer[len(buffer) - num_held:]
        return buffer[:len(buffer) - num_held], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, int] | None:
        """Emitted text never starts a match: a suffix that could start one is always held."""
        best: tuple[int, int] | None = None
        for stop in self._stop:
            start = buffer.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or (end, start) < (best[1], best[0]):
                best = (start, end)
        return best

    def _num_held(self, buffer: str) -> int:
        prefixes = self._prefixes
        for length in range(min(len(buffer), self._max_hold), 0, -1):
            if buffer[len(buffer) - length:] in prefixes:
                return length
        return 0
