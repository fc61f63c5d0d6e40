"""What sampling parameters ask of the tokenizer: bad words as token ids (the worker masks ids,
never text) and the prompt cut to its last truncate_prompt_tokens tokens."""

from __future__ import annotations

import dataclasses

from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.text.tokenizer import Tokenizer


def bad_words_token_ids(words: tuple[str, ...], tokenizer: Tokenizer
                        ) -> tuple[tuple[int, ...], ...]:
    """Each word as written and with one leading space, as it reads mid-text. vLLM keeps the
    spaced form only when it has as many tokens as the plain one; here it always counts, so a
    word whose spaced form is one token ("fox" → "f","ox" but " fox" → " fox") is banned too."""
    found: list[tuple[int, ...]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                found.append(ids)
    return tuple(dict.fromkeys(found))


def with_bad_words_token_ids(sampling: SamplingParams, tokenizer: Tokenizer) -> SamplingParams:
    if not sampling.bad_words:
        return sampling
    return dataclasses.replace(sampling, bad_words_token_ids=bad_words_token_ids(
        sampling.bad_words, tokenizer))


def truncated_prompt(token_ids: list[int], sampling: SamplingParams) -> list[int]:
    """The last truncate_prompt_tokens ids (vLLM truncates on the left)."""
    k = sampling.truncate_prompt_tokens
    return token_ids if k is None or len(token_ids) <= k else token_ids[-k:]
