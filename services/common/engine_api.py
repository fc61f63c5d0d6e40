"""What a scheduler is asked (SubmitRequest) and what it reports of itself (EngineLoad): plain
types shared by the scheduler core, its servicer and the gateway's client."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.services.common.sampling_params import SamplingParams

MAX_REQUEST_ID_CHARS = 256
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)  # int32, as the protos carry it
# what a replica does with new requests (--role): prefill/decode disaggregation
ROLE_BOTH = "both"
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
REPLICA_ROLES = (ROLE_BOTH, ROLE_PREFILL, ROLE_DECODE)


@dataclass(frozen=True, slots=True)
class ResumedOutput:
    """An output a gateway already streamed before its replica failed: resubmitted as output
    (not prompt), so penalties, min_tokens, stop checks and the seeded noise carry on exactly."""

    index: int
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """Where a prefill replica holds a prompt's computed leading blocks (prefill/decode
    disaggregation): its workers by rank, and the block ids there in prompt order."""

    worker_addresses: list[str]
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    owner: str = ""  # who may abort it: the gateway's tag of its caller
    resumed_outputs: list[ResumedOutput] = field(default_factory=list)  # unfinished ones only
    is_pooling: bool = False  # an embedding request: the prompt pooled, nothing generated
    # its prompt's blocks are pulled from a prefill replica first (a failed pull computes them)
    kv_transfer: KVTransferParams | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Only the owner of the request, or an admin, may abort it."""

    request_id: str
    owner: str = ""
    is_admin: bool = False


@dataclass(frozen=True, slots=True)
class PauseRequest:
    """Pause (or resume) a request whose consumer is behind; only its owner's gateway may."""

    request_id: str
    owner: str = ""
    is_paused: bool = True


@dataclass(frozen=True, slots=True)
class EngineLoad:
    num_running: int  # requests
    num_waiting: int
    num_swapped: int
    num_gpu_blocks_used: int  # blocks held only by the prefix cache count as free
    num_gpu_blocks: int
    num_cpu_blocks_used: int
    num_cpu_blocks: int
    prefix_cache_hit_rate: float  # in prompt tokens, since start
    num_preemptions: int
    num_worker_rebuilds: int  # workers rebuilt after losing their KV cache, since start
    num_paused: int = 0  # requests whose consumer is behind, not scheduled until it catches up
