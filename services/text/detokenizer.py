"""Incremental detokenization: turn a stream of token ids into a stream of stable text.

vLLM's prefix_offset/read_offset method: keep a short window of token ids, decode it whole and
emit the difference with the decoded text already emitted. Decoding a window instead of single
tokens keeps what only context decides right: SentencePiece's "▁" leading space (dropped at the
start of a decode) and byte-level pieces that together form one UTF-8 character.

The window is `[context | pending]`: `context` is text already emitted (at the start, the last
prompt tokens); `pending` is tokens whose text is not yet out. Text that ends in U+FFFD may be an
incomplete UTF-8 character, so it is held until the next tokens complete it. Each push decodes
only the window, so the cost per token does not grow with the output length.

Concatenating every `push` and the `flush` gives the output's text in the context of the prompt.
For byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen) that equals `tokenizer.decode(output_ids)`;
with SentencePiece it keeps the first token's leading space, which a lone decode would drop.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.services.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
NUM_PROMPT_CONTEXT_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
# An incomplete UTF-8 character is at most 3 bytes, so it spans at most 3 tokens: a U+FFFD that
# more pending tokens follow is a genuinely invalid byte, and older text can be released.
MAX_INCOMPLETE_CHAR_TOKENS = 3


class IncrementalDetokenizer:
    """Streams the text of one output sequence. Not thread-safe; one per sequence."""

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
        """Append output tokens; returns the text that became stable (possibly '')."""
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
        # Release everything but the last tokens, if their text is already final.
        cut = len(self._window) - MAX_INCOMPLETE_CHAR_TOKENS
        stable = self._decode(self._window[:cut])
        if text.startswith(stable):
            return self._advance(stable, cut)
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character stays U+FFFD, as in a full decode)."""
        self._is_finished = True
        text = self._decode(self._window)
        delta = text[len(self._context_text):]
        self._window = []
        return delta

    def _advance(self, text: str, cut: int) -> str:
        """Emit `text` (the decode of window[:cut]) past the context; window[:cut] becomes
        emitted, and the old pending tokens become the new context."""
        if len(text) <= len(self._context_text):
            # No visible text yet (a token that decodes to nothing): keep the context as it is,
            # so the next token is still decoded after real text.
            return ""
        delta = text[len(self._context_text):]
        self._window = self._window[self._num_context:]
        self._num_context = cut - self._num_context
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
