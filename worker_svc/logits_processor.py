"""Allowed-token, bad-word and min_tokens masks, logit bias, top-k, top-p and min-p (vLLM's
semantics). The sampler passes only the rows that asked for one, so other rows keep their logits
bit for bit."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pagedserve.worker_svc.host_to_device import to_device


def mask_tokens(
    logits: torch.Tensor,  # [num_rows, vocab_size], modified in place
    rows: list[int],
    token_ids: list[int],  # rows[i] loses token_ids[i]
) -> torch.Tensor:
    if rows:
        row_index = to_device(rows, torch.long, logits.device)
        token_index = to_device(token_ids, torch.long, logits.device)
        logits[row_index, token_index] = float("-inf")
    return logits


def add_logit_bias(
    logits: torch.Tensor,  # [num_rows, vocab_size], modified in place
    rows: list[int],
    token_ids: list[int],
    biases: list[float],  # rows[i] gains biases[i] at token_ids[i]
) -> torch.Tensor:
    if rows:
        index = (to_device(rows, torch.long, logits.device),
                 to_device(token_ids, torch.long, logits.device))
        logits.index_put_(index, to_device(biases, logits.dtype, logits.device),
                          accumulate=True)
    return logits


def keep_only(
    logits: torch.Tensor,  # [num_rows, vocab_size], modified in place
    rows: list[int],
    token_ids: list[int],  # rows[i] keeps token_ids[i]; the listed rows lose every other token
) -> torch.Tensor:
    if rows:
        device = logits.device
        row_set = sorted(set(rows))
        hidden = torch.zeros(logits.shape, dtype=torch.bool, device=device)
        hidden[to_device(row_set, torch.long, device)] = True
        hidden[to_device(rows, torch.long, device),
               to_device(token_ids, torch.long, device)] = False
        logits.masked_fill_(hidden, float("-inf"))
    return logits


def bad_word_tokens(output_ids: Sequence[int],
                    bad_words_token_ids: Sequence[Sequence[int]]) -> list[int]:
    """The last token of each bad word whose other tokens the output ends with: the token that
    would complete it (vLLM's rule; a one-token word is always banned)."""
    banned = []
    for word in bad_words_token_ids:
        prefix_len = len(word) - 1
        if prefix_len == 0 or (len(output_ids) >= prefix_len
                               and list(output_ids[len(output_ids) - prefix_len:])
                               == list(word[:-1])):
            banned.append(word[-1])
    return banned


def apply_top_k(
    logits: torch.Tensor,  # [num_rows, vocab_size], modified in place
    top_k: torch.Tensor,  # [num_rows] long in [1, max_top_k]
    max_top_k: int,
) -> torch.Tensor:
    """`apply_top_k_top_p` with top_p = 1 by a partial top-k: much cheaper than a sort for small k."""
    top_values = logits.topk(max_top_k, dim=-1).values  # [num_rows, max_top_k], descending
    kth_value = top_values.gather(1, (top_k - 1).unsqueeze(1))  # [num_rows, 1]
    return logits.masked_fill_(logits < kth_value, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    top_k: torch.Tensor,  # [num_rows] long in [1, vocab_size]; vocab_size = off
    top_p: torch.Tensor,  # [num_rows] float in (0, 1]; 1 = off
) -> torch.Tensor:
    """top-k keeps ties with the k-th value; top-p is measured after top-k renormalises."""
    vocab_size = logits.shape[1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [num_rows, vocab_size]
    kth_value = logits_sort.gather(1, (vocab_size - top_k).unsqueeze(1))  # [num_rows, 1]
    logits_sort.masked_fill_(logits_sort < kth_value, float("-inf"))

    probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)  # [num_rows, vocab_size]
    top_p_mask = probs_sum <= (1.0 - top_p).unsqueeze(1)
    top_p_mask[:, -1] = False  # the most probable token always stays
    # rows without top-p must not lose tokens whose probability underflowed to 0
    top_p_mask &= (top_p < 1.0).unsqueeze(1)
    logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return torch.empty_like(logits_sort).scatter_(1, logits_idx, logits_sort)


def apply_min_p(
    logits: torch.Tensor,  # [num_rows, vocab_size], modified in place
    min_p: torch.Tensor,  # [num_rows] float in [0, 1]
) -> torch.Tensor:
    probs = logits.softmax(dim=-1)  # [num_rows, vocab_size]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [num_rows, 1]
    return logits.masked_fill_(probs < threshold, float("-inf"))
