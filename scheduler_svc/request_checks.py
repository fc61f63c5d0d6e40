"""What a request must satisfy to be queued, checked whoever sends it (the gateway checks the
same, but the scheduler trusts no caller): every refusal is InvalidRequest naming the field and
the value (fields by SubmitRequest's paths), or Overloaded for a full queue, and never a broken
engine step later."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.services.common.cdiv import cdiv
from pagedserve.services.common.engine_api import MAX_REQUEST_ID_CHARS, PRIORITY_RANGE
from pagedserve.services.common.errors import FieldViolation, InvalidRequest, Overloaded, Reason
from pagedserve.services.common.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:

    vocab_size: int
    max_model_len: int
    block_size: int
    num_usable_blocks: int  # device blocks a prompt may take (the watermark left aside)
    max_best_of: int
    max_num_seqs: int
    max_waiting_requests: int


def check_request(request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                  priority: int, limits: RequestLimits) -> None:
    if not request_id:
        raise InvalidRequest("request_id must not be empty, got ''",
                             reason=Reason.INVALID_REQUEST_ID, field="request_id")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, "
                             f"got {len(request_id)}", reason=Reason.INVALID_REQUEST_ID,
                             field="request_id")
    if not request_id.isprintable():
        raise InvalidRequest(f"request_id must hold printable characters only, got "
                             f"{request_id!r}", reason=Reason.INVALID_REQUEST_ID,
                             field="request_id")
    if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise InvalidRequest(f"priority must be in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], "
                             f"got {priority}", reason=Reason.INVALID_PRIORITY, field="priority")
    if not prompt_token_ids:
        raise InvalidRequest("prompt_token_ids must not be empty", reason=Reason.PROMPT_EMPTY,
                             field="prompt_token_ids")
    bad = [(i, t) for i, t in enumerate(prompt_token_ids) if not 0 <= t < limits.vocab_size][:8]
    if bad:
        raise InvalidRequest(f"prompt_token_ids must be in [0, vocab_size={limits.vocab_size}), "
                             f"got {[t for _, t in bad]}", reason=Reason.UNKNOWN_TOKEN_ID,
                             violations=[FieldViolation(f"prompt_token_ids[{i}]",
                                                        f"{t} is not in [0, {limits.vocab_size})")
                                         for i, t in bad])
    if len(prompt_token_ids) >= limits.max_model_len:
        raise InvalidRequest(
            f"prompt_token_ids has {len(prompt_token_ids)} tokens; the prompt must be shorter "
            f"than max_model_len={limits.max_model_len}", reason=Reason.PROMPT_TOO_LONG,
            field="prompt_token_ids")
    num_prompt_blocks = cdiv(len(prompt_token_ids), limits.block_size)
    if num_prompt_blocks > limits.num_usable_blocks:
        raise InvalidRequest(
            f"prompt_token_ids has {len(prompt_token_ids)} tokens, which need "
            f"{num_prompt_blocks} KV-cache blocks; the cache has {limits.num_usable_blocks} "
            "usable blocks", reason=Reason.KV_CACHE_TOO_SMALL, field="prompt_token_ids")
    try:
        sampling.verify_for_model(limits.vocab_size)
    except InvalidRequest as exc:
        raise exc.nested("sampling") from None
    for name, limit in (("max_best_of", limits.max_best_of),
                        ("max_num_seqs", limits.max_num_seqs)):
        if sampling.num_candidates > limit:
            raise InvalidRequest(f"best_of={sampling.num_candidates} (the sequences of one "
                                 f"request: n, best_of or the beam width) exceeds {name}={limit}",
                                 reason=Reason.LIMIT_EXCEEDED,
                                 field="sampling.n" if sampling.best_of is None
                                 else "sampling.best_of",
                                 metadata={"value": str(sampling.num_candidates),
                                           "limit": str(limit), "limit_name": name})


def check_admission(prompt_token_ids: list[int], sampling: SamplingParams,
                    limits: RequestLimits, num_waiting: int,
                    queue_wait_s: Callable[[int], float]) -> None:
    """What SubmitStream adds; the offline LLM queues whole batches and lets outputs end at
    max_model_len. `queue_wait_s(num_places)`: how soon the queue frees that many."""
    num_tokens = len(prompt_token_ids) + sampling.max_tokens
    if num_tokens > limits.max_model_len:
        raise InvalidRequest(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) "
            f"must be at most max_model_len={limits.max_model_len}, got {num_tokens}",
            reason=Reason.MAX_TOKENS_TOO_LARGE, field="sampling.max_tokens",
            metadata={"value": str(sampling.max_tokens),
                      "limit": str(limits.max_model_len - len(prompt_token_ids))})
    if num_waiting >= limits.max_waiting_requests:
        raise Overloaded(f"{num_waiting} requests are waiting, the limit "
                         f"(max_waiting_requests) is {limits.max_waiting_requests}; retry later",
                         reason=Reason.QUEUE_FULL,
                         retry_after_s=queue_wait_s(num_waiting - limits.max_waiting_requests + 1),
                         metadata={"limit": str(limits.max_waiting_requests),
                                   "limit_name": "max_waiting_requests"})


def check_resumed_outputs(prompt_len: int, sampling: SamplingParams,
                          resumed: dict[int, list[int]], limits: RequestLimits) -> None:
    """Outputs a gateway resubmits after a failover: streamed ones (not beam search or
    best_of > n, whose outputs are final only at the end), each index once, each non-empty
    and still short of max_tokens and max_model_len."""
    if not resumed:
        return
    if sampling.use_beam_search or sampling.num_candidates != sampling.n:
        raise InvalidRequest("resumed_outputs needs streamed outputs; beam search and "
                             f"best_of={sampling.num_candidates} > n={sampling.n} cannot resume")
    for index, token_ids in resumed.items():
        if not 0 <= index < sampling.n:
            raise InvalidRequest(f"resumed_outputs index must be in [0, n={sampling.n}), "
                                 f"got {index}")
        if not token_ids:
            raise InvalidRequest(f"resumed_outputs[{index}] has no token_ids; an output "
                                 "with none is submitted from its prompt")
        bad = [t for t in token_ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequest(f"resumed_outputs[{index}] token_ids must be in "
                                 f"[0, vocab_size={limits.vocab_size}), got {bad[:8]}")
        if len(token_ids) >= sampling.max_tokens:
            raise InvalidRequest(f"resumed_outputs[{index}] has {len(token_ids)} tokens; an "
                                 f"unfinished output has fewer than max_tokens="
                                 f"{sampling.max_tokens}")
        if prompt_len + len(token_ids) >= limits.max_model_len:
            raise InvalidRequest(f"resumed_outputs[{index}] reaches {prompt_len + len(token_ids)} "
                                 f"tokens with its prompt; it must stay below max_model_len="
                                 f"{limits.max_model_len}")
