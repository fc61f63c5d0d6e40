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
        context = self._kept(prompt_token_ids)[-NUM_PROMPT_CONTEXT_TOKENS:]
        # A prompt that ends inside a character would make the difference meaningless.
        while context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context.pop()
        self._window: list[int] = context
        self._num_context = len(context)  # window[:num_context] is emitted (or prompt) text
        self._context_text = self._decode(context)
        self._is_finished = False

    def push(self, token_ids: Sequence[int]) -> str:
        if self._is_finished:
            raise RuntimeError("push after flush")
        new_ids = self._kept(token_ids)
        if not new_ids:
            return ""
        self._window.extend(new_ids)
        text = self._decode(self._window)
        if not text.endswith(REPLACEMENT_CHAR):
            return self._advance(text, len(self._window))
        num_pending = len(self._window) - self._num_context
        if num_pending <= MAX_INCOMPLETE_CHAR_TOKENS:
            return ""
        cut = len(self._window) - MAX_INCOMPLETE_CHAR_TOKENS
        stable = self._decode(self._window[:cut])
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
        if len(text) <= len(self._context_text):
            # Keep the context, so the next token is still decoded after real text.
            return ""
        delta = text[len(self._context_text):]
        self._window = self._window[self._num_context:]
        self._num_context = cut - self._num_context
        if self._num_context == 1:
            self._context_text = self._tokenizer.decode_token(self._window[0],
                                                              self._skip_special_tokens)
        else:
            self._context_text = self._decode(self._window[:self._num_context])
        return delta

    def _kept(self, token_ids: Sequence[int]) -> list[int]:
        # Skipped special tokens never enter the window: a run of them costs nothing.
        if not self._skip_special_tokens:
            return list(token_ids)
        special = self._tokenizer.special_token_ids
        return [t for t in token_ids if t not in special]

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
