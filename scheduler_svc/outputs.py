"""Reports of a sequence group's progress (RequestOutput), streamed or final, and the merge of
consecutive reports that a stream behind its engine sends as one."""

from __future__ import annotations

from pagedserve.scheduler_svc.sequence import FINISH_REASONS, Sequence, SequenceGroup
from pagedserve.services.common.outputs import RequestOutput, SequenceDelta


def make_request_output(group: SequenceGroup) -> RequestOutput | None:
    """The report for `group` now, or None if nothing new happened since the last one."""
    # per request per step: statuses are read inline, not through the properties
    seqs = group.seqs
    is_first = group.num_reports == 0
    if len(seqs) == 1 and group.is_streamed:  # most requests: no list to build for them
        is_finished = seqs[0].status in FINISH_REASONS
        output = _sequence_delta(seqs[0])
        if output is not None:
            outputs = [output]
        elif is_finished and is_first:
            outputs = []
        else:
            return None
    else:
        is_finished = group.is_finished
        if group.is_streamed:
            outputs = [o for seq in seqs if (o := _sequence_delta(seq)) is not None]
        elif is_finished and is_first:
            outputs = _final_outputs(group)
        else:
            outputs = []
        if not outputs and not (is_finished and is_first):
            return None
    prompt_logprobs = None
    if is_first and group.sampling.prompt_logprobs is not None:
        prompt_logprobs = list(group.prompt_logprobs)
    group.num_reports += 1
    # positional, as in _sequence_delta: keywords double the constructor's cost
    return RequestOutput(group.request_id, outputs, is_finished, seqs[0].prompt_len,
                         group.num_cached_tokens, prompt_logprobs, group.embedding)


def _sequence_delta(seq: Sequence) -> SequenceDelta | None:
    start = seq.num_emitted_tokens
    token_ids = seq.token_ids
    # not the placeholder of a step in flight (the next is scheduled before this report)
    new_token_ids = token_ids[seq.prompt_len + start:len(token_ids) - seq.has_placeholder]
    finish_reason = FINISH_REASONS.get(seq.status)  # None while it runs
    if not new_token_ids and (finish_reason is None or seq.is_finish_reported):
        return None
    seq.num_emitted_tokens = start + len(new_token_ids)
    seq.is_finish_reported = finish_reason is not None
    top_logprobs = seq.output_top_logprobs
    # index, token_ids, logprobs, top_logprobs, cumulative_logprob, finish_reason, error
    return SequenceDelta(seq.index, new_token_ids, seq.output_logprobs[start:],
                         top_logprobs[start:] if top_logprobs else [], seq.cumulative_logprob,
                         finish_reason, seq.error)


def _final_outputs(group: SequenceGroup) -> list[SequenceDelta]:
    n = group.sampling.n
    if group.is_beam_search and group.beam_hypotheses:
        best = sorted(group.beam_hypotheses, key=lambda h: h.score, reverse=True)[:n]
        return [SequenceDelta(index=i, token_ids=list(h.token_ids), logprobs=list(h.logprobs),
                              top_logprobs=list(h.top_logprobs),
                              cumulative_logprob=h.cumulative_logprob,
                              finish_reason=h.finish_reason)
                for i, h in enumerate(best)]
    # best_of > n keeps the n best by cumulative logprob (vLLM's rule); an aborted or failed
    # beam search reports its live beams the same way
    best = sorted(group.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:n]
    return [SequenceDelta(index=i, token_ids=list(s.output_token_ids),
                          logprobs=list(s.output_logprobs),
                          top_logprobs=list(s.output_top_logprobs),
                          cumulative_logprob=s.cumulative_logprob,
                          finish_reason=s.finish_reason, error=s.error)
            for i, s in enumerate(best)]


def merge_request_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """`first` extended in place by the report made after it: per output index the tokens
    concatenate and the latest cumulative logprob and finish win, as if one step had made both."""
    by_index = {o.index: o for o in first.outputs}
    for output in later.outputs:
        earlier = by_index.get(output.index)
        if earlier is None:
            first.outputs.append(output)
            by_index[output.index] = output
            continue
        earlier.token_ids += output.token_ids
        earlier.logprobs += output.logprobs
        earlier.top_logprobs += output.top_logprobs
        earlier.cumulative_logprob = output.cumulative_logprob
        earlier.finish_reason = output.finish_reason or earlier.finish_reason
        earlier.error = output.error or earlier.error
    first.finished = later.finished
    first.embedding = later.embedding or first.embedding
    first.num_cached_tokens = later.num_cached_tokens
    if first.prompt_logprobs is None:
        first.prompt_logprobs = later.prompt_logprobs
    return first
