"""Compiled grammars, one per constraint's content, built on a thread pool, never on the step's
thread. The scheduler admits a constrained request once its grammar is compiled here
(Worker.prepare_grammars), so a step waits for a compile only where the grammar was lost since
(a worker rebuilt, or evicted among MAX_CACHED_GRAMMARS); a sequence sent in a step starts its
compile at once, so that one overlaps the step's forward. The tokenizer
every compile needs is read once, from the worker's start: read at the first constraint instead,
it held that step ~1 s (SmolLM2-135M's; a schema's own compile is 1-3 ms)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedserve.services.common.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 512


def llguidance_tokenizer(tokenizer_path: str, vocab_size: int,
                         eos_token_ids: list[int]) -> Any:
    """The served tokenizer as llguidance sees it: the bytes of each of the logits' columns."""
    import llguidance.hf
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                        eos_token=eos_token_ids or None)


class GrammarCache:
    """constraint → a matcher at the grammar's start, to deep_copy per sequence (the copies
    share the compiled grammar)."""

    def __init__(self, new_tokenizer: Callable[[], Any], max_workers: int = 2,
                 on_compiled: Callable[[float], None] | None = None) -> None:
        self._new_tokenizer = new_tokenizer
        self._tokenizer: Future | None = None
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._compiled: OrderedDict[StructuredOutputsParams, Future] = OrderedDict()
        # the model thread and the thread building masks ahead both ask for grammars
        self._lock = threading.Lock()
        self.on_compiled = on_compiled

    def read_tokenizer(self) -> None:
        """Starts reading the tokenizer on the pool, unless it was."""
        with self._lock:
            self._read_tokenizer()

    def get(self, params: StructuredOutputsParams) -> Future:
        """The start matcher's future; its exception if the constraint does not compile."""
        with self._lock:
            future = self._compiled.get(params)
            if future is not None:
                self._compiled.move_to_end(params)
                return future
            self._read_tokenizer()
            future = self._pool.submit(self._compile, params)
            self._compiled[params] = future
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return future

    def __len__(self) -> int:
        return len(self._compiled)

    def _read_tokenizer(self) -> None:
        if self._tokenizer is None:
            self._tokenizer = self._pool.submit(self._new_tokenizer)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        from llguidance import LLMatcher

        start = time.perf_counter()
        tokenizer = self._tokenizer.result()
        matcher = LLMatcher(tokenizer, params.to_grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} does not compile: "
                             f"{matcher.get_error()}")
        if self.on_compiled is not None:
            self.on_compiled(time.perf_counter() - start)
        return matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
