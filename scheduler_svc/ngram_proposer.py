"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, in its prompt or its output so far, longest n first. No model runs; the
search is a C-level bytes.rfind over the ids packed four bytes each."""

from __future__ import annotations

from array import array

_WIDTH = array("I").itemsize


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to num_tokens ids; [] when no suffix of min_n..max_n tokens occurred before."""
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
            return token_ids[start:start + num_tokens]
    return []
