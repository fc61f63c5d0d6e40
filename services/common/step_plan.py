"""The scheduler → worker contract as plain dataclasses: the twin of worker.proto's
ExecuteStepRequest and ExecuteStepResponse.

The worker keeps a mirror of every sequence it was told about. A sequence is sent whole
(`NewSequence`) when first scheduled, after a preemption, or when forked; afterwards only its
delta (`RunningSequence`). A sequence that samples one token gets it appended by the worker
itself, so a plain decode's delta carries no tokens, and the scheduler can send step n+1 before
step n's output is back: steps chain through `previous_step_id`, run strictly in that order.

Per step the worker swaps out, swaps in, copies blocks, applies the deltas, runs the flattened
batch (prefill chunks first), and samples for every sequence whose computed tokens reach the end
of its known tokens. Token ids travel as lists of ints, never tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.services.common.sampling_params import SamplingParams

POOLING_TYPES = ("", "last", "mean")  # "": a generating sequence


@dataclass(frozen=True, slots=True)
class NewSequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt + every output token so far
    prompt_len: int  # token_ids[:prompt_len] is the prompt (penalties and prompt logprobs use it)
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # tokens whose KV is already in the blocks (prefix hit, swap-in, fork)
    num_scheduled_tokens: int  # tokens to compute this step, from num_computed_tokens on
    sampling: SamplingParams
    seed: int | None = None  # per-sequence seed the scheduler derived; None = unseeded
    num_samples: int = 1  # tokens to sample (best_of at a group's fork; 2*beam at beam steps)
    # a prompt-only (embedding) request: "last" or "mean"; pooled, never sampled. "": generates
    pooling_type: str = ""
    # speculative tokens after the last known one, counted in num_scheduled_tokens and verified
    draft_token_ids: list[int] = field(default_factory=list)
    # speculative tokens the worker's draft model proposes in this step, in their place
    num_lookahead_slots: int = 0


@dataclass(frozen=True, slots=True)
class RunningSequence:
    seq_id: int
    new_token_ids: list[int]  # tokens the scheduler appended since the sequence last ran (not
    #                           the ones the worker sampled and appended itself)
    block_ids_start: int  # block_table[block_ids_start:] = block_ids (append, or copy-on-write)
    block_ids: list[int]
    num_scheduled_tokens: int
    num_samples: int = 1
    draft_token_ids: list[int] = field(default_factory=list)  # as NewSequence's
    num_lookahead_slots: int = 0  # as NewSequence's


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One engine step. Lists of (src, dst) pairs are physical block ids."""

    scheduler_epoch: int
    step_id: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    running_seqs: list[RunningSequence] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (device, device)
    previous_step_id: int = 0  # the step that runs right before this one; 0 = first of the epoch
    # plain decodes, packed (a large decode batch is mostly these), run after running_seqs: each
    # as the RunningSequence(seq_id, [], block_ids_start, [], 1) would. The scheduler sends every
    # plain decode this way
    decode_seq_ids: list[int] = field(default_factory=list)
    decode_block_ids_start: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.new_seqs) + sum(
            s.num_scheduled_tokens for s in self.running_seqs) + len(self.decode_seq_ids)


@dataclass(frozen=True, slots=True)
class TokenIdLogprob:
    """A token and its logprob as the engine computes them; callers get TokenLogprob (with the
    token's text)."""

    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class SampledSequence:
    """What the worker sampled for one sequence this step."""

    seq_id: int
    # num_samples tokens (beam search: best first); after drafts, the accepted ones and the next
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token under the processed distribution
    top_logprobs: list[list[TokenIdLogprob]] = field(default_factory=list)  # per token, if asked
    # prompt logprobs of the chunk computed this step, for positions 1.. of the prompt
    prompt_logprobs: list[list[TokenIdLogprob]] = field(default_factory=list)
    # lookahead slots left unused: the draft model's KV lagged too far behind to propose from
    is_draft_behind: bool = False


@dataclass(frozen=True, slots=True)
class PooledSequence:
    """A pooling sequence whose prompt was computed this step: its L2-normalized embedding."""

    seq_id: int
    embedding: list[float]  # [hidden_size]


@dataclass(frozen=True, slots=True)
class StepTimings:
    cache_ops_ns: int = 0  # swap out + swap in + copy
    prepare_ns: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
    swap_out_ns: int = 0  # of cache_ops_ns: device -> CPU blocks (preemption and host tier)
    swap_in_ns: int = 0  # CPU -> device blocks
    draft_ns: int = 0  # the draft model's forwards (speculative decoding)
    draft_catch_up_ns: int = 0  # its forward catching up lagging sequences, not in draft_ns
    mask_ns: int = 0  # of sample_ns: the wait for the structured outputs' token bitmask


@dataclass(frozen=True, slots=True)
class StepOutput:
    step_id: int
    # sequences that sampled, and sequences with prompt logprobs from a non-final prefill chunk
    # (those have empty token_ids)
    outputs: list[SampledSequence] = field(default_factory=list)
    timings: StepTimings = field(default_factory=StepTimings)
    pooled: list[PooledSequence] = field(default_factory=list)
    # single samples, packed (the wire's form; most of a decode step): sequence i of
    # sampled_seq_ids sampled sampled_token_ids[i] alone, with its logprob and nothing more
    sampled_seq_ids: list[int] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    sampled_logprobs: list[float] = field(default_factory=list)

    def packed_indices(self) -> dict[int, int]:
        """seq_id → i of each packed single sample (sampled_token_ids[i], sampled_logprobs[i])."""
        num_samples = len(self.sampled_seq_ids)
        if not num_samples == len(self.sampled_token_ids) == len(self.sampled_logprobs):
            raise ValueError(
                f"sampled_seq_ids, sampled_token_ids and sampled_logprobs must have equal "
                f"lengths, got {num_samples}, {len(self.sampled_token_ids)} and "
                f"{len(self.sampled_logprobs)}")
        return dict(zip(self.sampled_seq_ids, range(num_samples), strict=True))

    def sampled_by_seq(self) -> dict[int, SampledSequence]:
        """Every sampled sequence by seq_id, the packed ones as SampledSequences too."""
        by_seq = {out.seq_id: out for out in self.outputs}
        for seq_id, token_id, logprob in zip(self.sampled_seq_ids, self.sampled_token_ids,
                                             self.sampled_logprobs, strict=True):
            by_seq[seq_id] = SampledSequence(seq_id, [token_id], [logprob])
        return by_seq


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker reports after LoadModel (GetInfo); the scheduler sizes everything from it."""

    rank: int
    device: str  # "cpu", "cuda:0", ...
    dtype: str  # "float32", "bfloat16", ...
    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    num_layers: int
    num_kv_heads: int
    head_size: int
    attention_backend: str


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """ProfileMemory's answer (vLLM's determine_num_available_blocks)."""

    num_gpu_blocks: int
    num_cpu_blocks: int
    weights_bytes: int
    activations_peak_bytes: int
    kv_bytes_per_block: int  # all layers, K and V
