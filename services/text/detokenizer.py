"""Incremental detokenization, vLLM's prefix_offset/read_offset method: decode a short window
`[context | pending]` whole and emit what extends the context's text. The window keeps what only
context decides right (SentencePiece's leading "▁", multi-token UTF-8 characters) at a cost per
token that does not grow with the output. Text ending in U+FFFD is held until it completes."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.services.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
NUM_PROMPT_CONTEXT_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
# An incomplete UTF-8 character spans at most 3 tokens: a U+FFFD followed by more is invalid.
MAX_INCOMPLETE_CHAR_TOKENS = 3


class IncrementalDetokenizer:
    """One per sequence. Not thread-safe."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        # Skipped special tokens never enter the window: a run of them costs nothing.
        self._skipped = self._tokenizer.special_token_ids if skip_special_tokens else frozenset()
        context = self._kept(prompt_token_ids)[-NUM_PROMPT_CONTEXT_TOKENS:]
        # A prompt that ends inside a character would make the difference meaningless.
        while context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context.pop()
        self._window: list[int] = context
        self._num_context = len(context)  # window[:num_context] is emitted (or prompt) text
        self._context_text = self._decode(context)
        self._is_finished = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Once per streamed event: the common case (no special token, the text ends in a
        whole character) is one decode of the window."""
        if self._is_finished:
            raise RuntimeError("push after flush")
        if not self._skipped.isdisjoint(token_ids):
            token_ids = self._kept(token_ids)
        if not token_ids:
            return ""
        window = self._window
        window.extend(token_ids)
        text = self._decode(window)
        if not text.endswith(REPLACEMENT_CHAR):
            return self._advance(text, len(window))
        num_pending = len(window) - self._num_context
        if num_pending <= MAX_INCOMPLETE_CHAR_TOKENS:
            return ""
        cut = len(window) - MAX_INCOMPLETE_CHAR_TOKENS
        stable = self._decode(window[:cut])
        if text.startswith(stable):
            return self._advance(stable, cut)
        return ""

    def flush(self) -> str:
        """An incomplete character stays U+FFFD, as in a full decode."""
        self._is_finished = True
        text = self._decode(self._window)
        delta = text[len(self._context_text):]
        self._window = []
        return delta

    def _advance(self, text: str, cut: int) -> str:
        """`text` decodes window[:cut]; the old pending tokens become the new context."""
        num_context_chars = len(self._context_text)
        if len(text) <= num_context_chars:
            # Keep the context, so the next token is still decoded after real text.
            return ""
        window = self._window
        del window[:self._num_context]
        self._num_context = num_context = cut - self._num_context
        if num_context == 1:
            self._context_text = self._tokenizer.decode_token(window[0],
                                                              self._skip_special_tokens)
        else:
            self._context_text = self._decode(window[:num_context])
        return text[num_context_chars:]

    def _kept(self, token_ids: Sequence[int]) -> list[int]:
        skipped = self._skipped
        return [t for t in token_ids if t not in skipped]

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
