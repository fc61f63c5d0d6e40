"""scheduler.proto ↔ the scheduler's dataclasses: the only place they meet."""

from __future__ import annotations

from pagedserve.services.common.engine_api import (
    ROLE_BOTH,
    ROLE_DECODE,
    ROLE_PREFILL,
    AbortRequest,
    EngineLoad,
    KVTransferParams,
    PauseRequest,
    ResumedOutput,
    SubmitRequest,
)
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.outputs import RequestOutput, SequenceDelta
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import TokenIdLogprob, WorkerInfo
from pagedserve.services.rpc.convert_common import (
    add_logprob_lists,
    finish_reason_from_proto,
    finish_reason_to_proto,
    logprob_lists_from_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
)
from pagedserve.services.rpc.internal.v1 import scheduler_pb2


def _sampling_from_proto(msg: scheduler_pb2.SubmitRequest) -> SamplingParams:
    try:
        return sampling_params_from_proto(msg.sampling)
    except InvalidRequest as exc:
        raise exc.nested("sampling") from None


def submit_request_to_proto(request: SubmitRequest) -> scheduler_pb2.SubmitRequest:
    try:
        sampling = sampling_params_to_proto(request.sampling)
    except InvalidRequest as exc:
        raise exc.nested("sampling") from None
    return scheduler_pb2.SubmitRequest(
        request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
        sampling=sampling, priority=request.priority,
        owner=request.owner,
        resumed_outputs=[scheduler_pb2.ResumedOutput(index=o.index, token_ids=o.token_ids)
                         for o in request.resumed_outputs],
        is_pooling=request.is_pooling,
        kv_transfer=(None if request.kv_transfer is None
                     else kv_transfer_params_to_proto(request.kv_transfer)))


def kv_transfer_params_to_proto(params: KVTransferParams) -> scheduler_pb2.KvTransferParams:
    return scheduler_pb2.KvTransferParams(worker_addresses=params.worker_addresses,
                                          block_ids=params.block_ids)


def kv_transfer_params_from_proto(msg: scheduler_pb2.KvTransferParams) -> KVTransferParams:
    return KVTransferParams(list(msg.worker_addresses), list(msg.block_ids))


def submit_request_from_proto(msg: scheduler_pb2.SubmitRequest) -> SubmitRequest:
    """Raises InvalidRequest (naming the field and the value) for bad sampling parameters or
    an output index resumed twice."""
    resumed = [ResumedOutput(o.index, list(o.token_ids)) for o in msg.resumed_outputs]
    indices = [o.index for o in resumed]
    if len(set(indices)) != len(indices):
        raise InvalidRequest(f"resumed_outputs must name each index once, got {indices}",
                             field="resumed_outputs")
    return SubmitRequest(
        request_id=msg.request_id, prompt_token_ids=list(msg.prompt_token_ids),
        sampling=_sampling_from_proto(msg), priority=msg.priority,
        owner=msg.owner, resumed_outputs=resumed, is_pooling=msg.is_pooling,
        kv_transfer=(kv_transfer_params_from_proto(msg.kv_transfer)
                     if msg.HasField("kv_transfer") else None))


def sequence_delta_to_proto(output: SequenceDelta) -> scheduler_pb2.SequenceDelta:
    msg = scheduler_pb2.SequenceDelta(
        index=output.index, token_ids=output.token_ids, logprobs=output.logprobs,
        finish_reason=finish_reason_to_proto(output.finish_reason),
        cumulative_logprob=output.cumulative_logprob, error=output.error or "")
    add_logprob_lists(msg.top_logprobs, output.top_logprobs)
    return msg


def sequence_delta_from_proto(msg: scheduler_pb2.SequenceDelta) -> SequenceDelta:
    """Once per output per step in the gateway: absent lists and reasons are not converted,
    and scalar lists are sliced (a third of list()'s cost on upb's containers)."""
    logprobs = msg.logprobs
    top_logprobs = msg.top_logprobs
    finish_reason = msg.finish_reason
    return SequenceDelta(
        msg.index, msg.token_ids[:], logprobs[:] if logprobs else [],
        logprob_lists_from_proto(top_logprobs) if top_logprobs else [],
        msg.cumulative_logprob,
        finish_reason_from_proto(finish_reason) if finish_reason else None, msg.error or None)


def token_event_to_proto(output: RequestOutput, msg: scheduler_pb2.SubmitResponse | None = None
                         ) -> scheduler_pb2.SubmitResponse:
    """A position whose KV came from the prefix cache (None) travels as an empty TokenLogprobs.
    `msg`: filled in place (a field of a larger message) instead of a new one."""
    if msg is None:
        msg = scheduler_pb2.SubmitResponse()
    msg.outputs.extend(sequence_delta_to_proto(o) for o in output.outputs)
    msg.num_prompt_tokens = output.num_prompt_tokens
    msg.num_cached_tokens = output.num_cached_tokens
    if output.prompt_logprobs is not None:
        add_logprob_lists(msg.prompt_logprobs, [p or [] for p in output.prompt_logprobs])
    if output.embedding is not None:
        msg.embedding.extend(output.embedding)
    return msg


def token_event_from_proto(msg: scheduler_pb2.SubmitResponse, request_id: str,
                           has_prompt_logprobs: bool = False) -> RequestOutput:
    """`finished` is true when every output of the event carries a finish reason; the stream's
    end is the authoritative signal. `has_prompt_logprobs`: the request asked for them and this
    is its first event (protobuf cannot tell an absent list from an empty one)."""
    outputs = [sequence_delta_from_proto(o) for o in msg.outputs]
    is_finished = bool(outputs)
    for output in outputs:
        if output.finish_reason is None:
            is_finished = False
            break
    prompt_logprobs: list[list[TokenIdLogprob] | None] | None = None
    if has_prompt_logprobs or msg.prompt_logprobs:
        prompt_logprobs = [p or None for p in logprob_lists_from_proto(msg.prompt_logprobs)]
    embedding = msg.embedding
    return RequestOutput(request_id, outputs, is_finished, msg.num_prompt_tokens,
                         msg.num_cached_tokens, prompt_logprobs,
                         embedding[:] if embedding else None)


def abort_request_to_proto(request: AbortRequest) -> scheduler_pb2.AbortRequest:
    return scheduler_pb2.AbortRequest(request_id=request.request_id, owner=request.owner,
                                      is_admin=request.is_admin)


def abort_request_from_proto(msg: scheduler_pb2.AbortRequest) -> AbortRequest:
    return AbortRequest(request_id=msg.request_id, owner=msg.owner, is_admin=msg.is_admin)


def pause_request_to_proto(request: PauseRequest
                           ) -> scheduler_pb2.PauseRequest | scheduler_pb2.ResumeRequest:
    """Pause or Resume, as `request.is_paused` says."""
    message = scheduler_pb2.PauseRequest if request.is_paused else scheduler_pb2.ResumeRequest
    return message(request_id=request.request_id, owner=request.owner)


def pause_request_from_proto(msg: scheduler_pb2.PauseRequest | scheduler_pb2.ResumeRequest
                             ) -> PauseRequest:
    return PauseRequest(request_id=msg.request_id, owner=msg.owner,
                        is_paused=isinstance(msg, scheduler_pb2.PauseRequest))


# GetLoad and WatchLoad answer the same fields, each in its own response message.
LoadResponse = scheduler_pb2.GetLoadResponse | scheduler_pb2.WatchLoadResponse


def load_to_proto(load: EngineLoad, message_type: type[LoadResponse]) -> LoadResponse:
    return message_type(
        num_running_requests=load.num_running, num_waiting_requests=load.num_waiting,
        num_swapped_requests=load.num_swapped, num_gpu_blocks_used=load.num_gpu_blocks_used,
        num_gpu_blocks=load.num_gpu_blocks, num_cpu_blocks_used=load.num_cpu_blocks_used,
        num_cpu_blocks=load.num_cpu_blocks, prefix_cache_hit_rate=load.prefix_cache_hit_rate,
        num_preemptions=load.num_preemptions, num_worker_rebuilds=load.num_worker_rebuilds,
        num_paused_requests=load.num_paused)


def load_from_proto(msg: LoadResponse) -> EngineLoad:
    return EngineLoad(
        num_running=msg.num_running_requests, num_waiting=msg.num_waiting_requests,
        num_swapped=msg.num_swapped_requests, num_gpu_blocks_used=msg.num_gpu_blocks_used,
        num_gpu_blocks=msg.num_gpu_blocks, num_cpu_blocks_used=msg.num_cpu_blocks_used,
        num_cpu_blocks=msg.num_cpu_blocks, prefix_cache_hit_rate=msg.prefix_cache_hit_rate,
        num_preemptions=msg.num_preemptions, num_worker_rebuilds=msg.num_worker_rebuilds,
        num_paused=msg.num_paused_requests)


DEFAULT_WATCH_LOAD_INTERVAL_MS = 100
MIN_WATCH_LOAD_INTERVAL_MS = 10


def watch_load_request_to_proto(min_interval_s: float) -> scheduler_pb2.WatchLoadRequest:
    return scheduler_pb2.WatchLoadRequest(min_interval_ms=round(min_interval_s * 1000))


def watch_load_request_from_proto(msg: scheduler_pb2.WatchLoadRequest) -> float:
    """The interval in seconds: 0 means the default, and it is never below the minimum."""
    interval_ms = msg.min_interval_ms or DEFAULT_WATCH_LOAD_INTERVAL_MS
    return max(interval_ms, MIN_WATCH_LOAD_INTERVAL_MS) / 1000


def served_model_to_proto(model: str, info: WorkerInfo, max_model_len: int, vocab_size: int,
                          eos_token_ids: list[int], block_size: int = 0, num_gpu_blocks: int = 0,
                          max_num_seqs: int = 0, served_model_name: str = "",
                          role: str = ROLE_BOTH) -> scheduler_pb2.GetServedModelResponse:
    return scheduler_pb2.GetServedModelResponse(
        model=model, served_model_name=served_model_name, architecture=info.architecture,
        max_model_len=max_model_len,
        vocab_size=vocab_size, eos_token_ids=eos_token_ids, block_size=block_size,
        num_gpu_blocks=num_gpu_blocks, max_num_seqs=max_num_seqs,
        role=_ROLE_TO_PROTO[role])


_ROLE_TO_PROTO = {ROLE_BOTH: scheduler_pb2.REPLICA_ROLE_BOTH,
                  ROLE_PREFILL: scheduler_pb2.REPLICA_ROLE_PREFILL,
                  ROLE_DECODE: scheduler_pb2.REPLICA_ROLE_DECODE}
_ROLE_FROM_PROTO = {v: k for k, v in _ROLE_TO_PROTO.items()}


def role_from_proto(msg: scheduler_pb2.GetServedModelResponse) -> str:
    """A scheduler older than roles (or one with a role this gateway does not know) is BOTH."""
    return _ROLE_FROM_PROTO.get(msg.role, ROLE_BOTH)
