"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, in its prompt or its output so far, longest n first. No model runs; the
search is a C-level bytes.rfind over the ids packed four bytes each.

With a spec factor the number of drafts follows the match, as vLLM's suffix decoding does: at
most factor x the matched length, where the match is measured past max_n, as far back as the
earlier occurrence agrees with the sequence's suffix. A long agreement (a passage being copied)
drafts many tokens, a short one (a common phrase) few."""

from __future__ import annotations

from array import array
from math import ceil

_WIDTH = array("I").itemsize


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int,
                  spec_factor: float = 0.0) -> list[int]:
    """Up to num_tokens ids (with spec_factor > 0, up to spec_factor x the matched length); []
    when no suffix of min_n..max_n tokens occurred before."""
    length = len(token_ids)
    if num_tokens < 1 or length <= min_n:
        return []
    packed = array("I", token_ids).tobytes()
    # the match must end before the last token, so at least one token follows it
    search_end = (length - 1) * _WIDTH
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = packed[(length - n) * _WIDTH:]
        pos = packed.rfind(pattern, 0, search_end)
        while pos > 0 and pos % _WIDTH:  # matched across token boundaries: look further left
            pos = packed.rfind(pattern, 0, pos + len(pattern) - 1)
        if pos >= 0 and pos % _WIDTH == 0:
            start = pos // _WIDTH + n
            if spec_factor > 0:
                num_matched = _matched_length(token_ids, start, n, ceil(num_tokens / spec_factor))
                num_tokens = min(num_tokens, int(spec_factor * num_matched))
            return token_ids[start:start + num_tokens]
    return []


def _matched_length(token_ids: list[int], start: int, n: int, max_length: int) -> int:
    """How many tokens before `start` equal the sequence's last ones (n do), up to max_length.
    The occurrence ends before the sequence does, so the two never read the same position."""
    end = len(token_ids)
    while n < max_length and n < start and token_ids[start - n - 1] == token_ids[end - n - 1]:
        n += 1
    return n
