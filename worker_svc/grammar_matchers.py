"""One grammar matcher per constrained sequence, and the token bitmask of a step's sampled rows.

A matcher's state is a function of its sequence's output tokens alone, so it is derived from the
mirror at each mask, never sent: it consumes the outputs it has not seen; a sequence whose
outputs no longer extend what it consumed (sent whole again after preemption, a scheduler that
took over, a worker rebuilt) rolls back or replays from the start. A fork (another sequence of
the same request whose outputs extend a matcher's) starts from a copy. So generation continues
exactly as without the fault.

A mask needs the previous token, so a step's mask is built once the step before has finished and
its tokens are in the mirror. Where the device runs apart from the host, mask_ahead() starts the
next step's rows on a thread of their own right then, so that they overlap the next launch and
its forward; bitmask() takes the rows whose sequence has not changed since and builds the others
in place. The matchers are used by one thread at a time: bitmask() waits for the rows ahead first.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Container, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from pagedserve.services.common.step_plan import NewSequence
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.worker_svc.grammar_cache import GrammarCache, llguidance_tokenizer
from pagedserve.worker_svc.sequence_mirrors import CachedSequence
from pagedserve.worker_svc.token_bitmask import TokenBitmask, num_bitmask_words

logger = logging.getLogger(__name__)

# llguidance's own default: 80% of the CPUs, up to 32
MASK_THREADS = min(32, len(os.sched_getaffinity(0)) * 4 // 5)


@dataclass(slots=True)
class _SeqMatcher:
    request_id: str
    seq: CachedSequence  # the mirror entry it follows; another object: the sequence was resent
    matcher: Any  # llguidance.LLMatcher
    consumed: list[int]  # the output tokens it has consumed
    is_failed: bool = False


@dataclass(slots=True)
class _RowsAhead:
    seqs: list[CachedSequence]
    outputs: list[list[int]]  # each sequence's output tokens the rows were built from
    bits: torch.Tensor  # [len(seqs), num_words]


class GrammarMatchers:
    def __init__(self, cache: GrammarCache, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.cache = cache
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]
        self._matchers: dict[int, _SeqMatcher] = {}
        self._executor: Any = None
        num_words = num_bitmask_words(vocab_size)
        self._bits = torch.empty(0, num_words, dtype=torch.int32)  # [max rows so far, num_words]
        self._bits_ahead = torch.empty(0, num_words, dtype=torch.int32)  # the rows built ahead
        self._eos_only = _eos_only(self.eos_token_ids, num_words)
        self._ahead_thread: ThreadPoolExecutor | None = None
        self._ahead: Future[_RowsAhead] | None = None

    @classmethod
    def for_model(cls, tokenizer_path: str, vocab_size: int,
                  eos_token_ids: list[int]) -> GrammarMatchers:
        """With the tokenizer of that folder (--tokenizer, else the model folder), read from now
        on the compile pool."""
        cache = GrammarCache(functools.partial(llguidance_tokenizer, tokenizer_path, vocab_size,
                                               eos_token_ids))
        cache.read_tokenizer()
        return cls(cache, vocab_size, eos_token_ids)

    def __len__(self) -> int:
        self._rows_ahead()
        return len(self._matchers)

    def clear(self) -> None:
        self._rows_ahead()
        self._matchers.clear()

    def shutdown(self) -> None:
        self._rows_ahead()
        if self._ahead_thread is not None:
            self._ahead_thread.shutdown()
        self.cache.shutdown()

    def prepare(self, new_seqs: list[NewSequence]) -> None:
        """Starts compiling the constraints of sequences that have no matcher yet."""
        for seq in new_seqs:
            params = seq.sampling.structured_outputs
            if params is not None and seq.seq_id not in self._matchers:
                self.cache.get(params)

    def compiled(self, constraints: list[StructuredOutputsParams]) -> Future[None]:
        """Starts compiling these constraints; the future is done once each is compiled or has
        failed to (a failed one's sequences draw EOS alone, as in a step)."""
        done: Future[None] = Future()
        pending = [self.cache.get(params) for params in constraints]
        left = [len(pending)]
        lock = threading.Lock()

        def one_done(_: Future) -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set_result(None)

        if not pending:
            done.set_result(None)
        for future in pending:
            future.add_done_callback(one_done)
        return done

    def bitmask(self, sample_seqs: list[CachedSequence], live_seq_ids: Container[int],
                drawing: Mapping[int, int] = MappingProxyType({})) -> TokenBitmask | None:
        """The allowed tokens of the constrained rows (row i ↔ sample_seqs[i]), valid until the
        next call (its bits are reused); None: no row is constrained. Forgets the matchers of
        sequences the mirror no longer holds. drawing: the mirror's tokens drawn on the device
        and not yet appended, by seq_id."""
        ahead = self._rows_ahead()
        for seq_id in [s for s in self._matchers if s not in live_seq_ids]:
            del self._matchers[seq_id]
        rows = [i for i, s in enumerate(sample_seqs) if s.sampling.structured_outputs is not None]
        if not rows:
            return None
        # the step before has finished: only this step's own draw is still on the device
        assert all(drawing.get(sample_seqs[i].seq_id, 0) <= 1 for i in rows), \
            "a constrained mask was built before the previous token reached the host"
        self._bits = _grown(self._bits, len(rows))
        bits = self._bits[:len(rows)]
        built = {} if ahead is None else {s.seq_id: j for j, s in enumerate(ahead.seqs)}
        copied, sources, in_place = [], [], []
        for k, i in enumerate(rows):
            seq = sample_seqs[i]
            outputs = seq.token_ids[seq.prompt_len:]
            j = built.get(seq.seq_id)
            # the same mirror entry with the same outputs: the row built ahead is this one
            if j is not None and ahead.seqs[j] is seq and ahead.outputs[j] == outputs:
                copied.append(k)
                sources.append(j)
            else:
                in_place.append((k, seq, outputs))
        if copied:
            bits[copied] = ahead.bits[sources]
        if in_place:
            self._write(in_place, bits, self._fill)
        return TokenBitmask(rows, bits)

    def mask_ahead(self, seqs: list[CachedSequence]) -> None:
        """Starts building, on a thread of its own, the rows of these sequences' constrained
        ones for their outputs now: the rows of the next bitmask() whose sequences do not
        change before it."""
        constrained = [s for s in seqs if s.sampling.structured_outputs is not None]
        self._rows_ahead()
        if not constrained:
            return
        if self._ahead_thread is None:
            self._ahead_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._bits_ahead = _grown(self._bits_ahead, len(constrained))
        ahead = _RowsAhead(constrained, [s.token_ids[s.prompt_len:] for s in constrained],
                           self._bits_ahead[:len(constrained)])
        self._ahead = self._ahead_thread.submit(self._build_ahead, ahead)

    def _rows_ahead(self) -> _RowsAhead | None:
        """The rows built ahead, once they are; None: none were started."""
        ahead, self._ahead = self._ahead, None
        return None if ahead is None else ahead.result()

    def _build_ahead(self, ahead: _RowsAhead) -> _RowsAhead:
        self._write([(k, seq, outputs) for k, (seq, outputs)
                     in enumerate(zip(ahead.seqs, ahead.outputs, strict=True))],
                    ahead.bits, self._fill_released)
        return ahead

    def _write(self, rows: list[tuple[int, CachedSequence, list[int]]], bits: torch.Tensor,
               fill: Callable[[list[tuple[Any, int]], torch.Tensor], None]) -> None:
        """Row k of bits ← the allowed tokens of seq after outputs, for each (k, seq, outputs)."""
        words = bits.numpy()  # a row's assignment in numpy: ~1 us against torch's ~4 us
        live = []
        for k, seq, outputs in rows:
            entry = self._synced(seq, outputs)
            if entry.is_failed or entry.matcher.is_stopped():
                words[k] = self._eos_only
            else:
                live.append((entry.matcher, k))
        if live:
            fill(live, bits)

    def _fill(self, live: list[tuple[Any, int]], bits: torch.Tensor) -> None:
        """Writes the whole row of each (matcher, row)."""
        if len(live) == 1 or MASK_THREADS < 2:
            # one pool thread only hands the rows over: 1.3-2x slower than this thread alone
            row_bytes = bits.shape[1] * bits.element_size()
            base = bits.data_ptr()
            for matcher, row in live:
                matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
            return
        self._fill_released(live, bits)

    def _fill_released(self, live: list[tuple[Any, int]], bits: torch.Tensor) -> None:
        """Writes the whole row of each (matcher, row) in one call that lets the GIL go once:
        filled a row at a time beside a busy Python thread, each row waits to take it back."""
        import llguidance.torch
        from llguidance import LLExecutor

        if self._executor is None:
            self._executor = LLExecutor(max(1, MASK_THREADS))
        llguidance.torch.fill_next_token_bitmask_par(self._executor, live, bits)

    def _synced(self, seq: CachedSequence, outputs: list[int]) -> _SeqMatcher:
        """The matcher of seq, having consumed outputs (seq's output tokens)."""
        entry = self._matchers.get(seq.seq_id)
        if entry is not None and entry.seq is seq:  # the same mirror entry: it only grew
            self._consume(entry, outputs[len(entry.consumed):])
            return entry
        if entry is not None and (entry.request_id != seq.request_id
                                  or entry.seq.sampling.structured_outputs
                                  != seq.sampling.structured_outputs):
            entry = None  # a scheduler that took over numbers its sequences from 0 again
        if entry is not None and (entry.is_failed
                                  or outputs[:len(entry.consumed)] != entry.consumed):
            entry = self._rolled_back(entry, outputs)
        if entry is not None:
            entry.seq = seq
        if entry is None:
            entry = self._forked(seq, outputs) or self._started(seq)
            self._matchers[seq.seq_id] = entry
        self._consume(entry, outputs[len(entry.consumed):])
        return entry

    def _consume(self, entry: _SeqMatcher, new: list[int]) -> None:
        # a stopped matcher's sequence ends at its next token (EOS, the only one allowed): a
        # step scheduled before that token reached the scheduler samples it once more, in vain
        if new and not entry.is_failed and not entry.matcher.is_stopped():
            if entry.matcher.consume_tokens(new):
                entry.consumed.extend(new)
            else:
                logger.warning("seq %d: its outputs leave its grammar (%s); only EOS from here",
                               entry.seq.seq_id, entry.matcher.get_error())
                entry.is_failed = True

    def _rolled_back(self, entry: _SeqMatcher, outputs: list[int]) -> _SeqMatcher | None:
        consumed = entry.consumed
        common = 0
        for a, b in zip(consumed, outputs, strict=False):
            if a != b:
                break
            common += 1
        if not entry.is_failed and entry.matcher.rollback(len(consumed) - common):
            del consumed[common:]
            return entry
        return None

    def _forked(self, seq: CachedSequence, outputs: list[int]) -> _SeqMatcher | None:
        for other in self._matchers.values():
            if (other.request_id == seq.request_id and not other.is_failed
                    and other.seq.sampling.structured_outputs == seq.sampling.structured_outputs
                    and outputs[:len(other.consumed)] == other.consumed):
                return _SeqMatcher(seq.request_id, seq, other.matcher.deep_copy(),
                                   list(other.consumed))
        return None

    def _started(self, seq: CachedSequence) -> _SeqMatcher:
        try:
            start = self.cache.get(seq.sampling.structured_outputs).result()
        except Exception:
            logger.exception("seq %d: its constraint does not compile; only EOS", seq.seq_id)
            return _SeqMatcher(seq.request_id, seq, None, [], is_failed=True)
        return _SeqMatcher(seq.request_id, seq, start.deep_copy(), [])


def _grown(bits: torch.Tensor, num_rows: int) -> torch.Tensor:
    """bits, or a larger buffer where it has fewer than num_rows rows. The rows' buffers are kept
    across steps, every row written: zeroing a fresh one is a parallel fill, 8 ms at 256 rows on
    a 2-core host whose other core is busy. The mask before is consumed by then: its draws were
    launched, and their step finished, before the next rows are built."""
    if bits.shape[0] >= num_rows:
        return bits
    return torch.empty(max(num_rows, 2 * bits.shape[0]), bits.shape[1], dtype=torch.int32)


def _eos_only(eos_token_ids: list[int], num_words: int) -> np.ndarray:
    """[num_words] int32: the bits of the EOS tokens alone."""
    row = np.zeros(num_words * 32, dtype=np.uint8)
    row[eos_token_ids] = 1
    return np.packbits(row, bitorder="little").view(np.int32)
