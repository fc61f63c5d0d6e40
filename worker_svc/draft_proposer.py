"""Speculative decoding with a draft model: a small model of the target's tokenizer, run by the
worker inside each step, proposes the drafts the target verifies in that same step.

Its KV cache is a second set of per-layer tensors, in its own KV shape (a Llama-3.2-1B draft has
half a Llama-3-8B's head size), with the target's blocks: indexed by the same block tables and slot
mapping (CacheEngine.draft_gpu_cache), as vLLM's drafters do, so a block's bytes are the target's
and the draft's layers together. The scheduler's block accounting, swaps, copy-on-write and the
prefix cache cover it with no bookkeeping of their own. The draft model computes a sequence's known
tokens once (CachedSequence.num_draft_computed), and only when it proposes: a prompt that arrives
while speculation does not pay costs the draft model nothing until its sequence drafts; then it
catches up, at most max_catch_up_tokens a step, and proposes once it has (draft_blocks.py tracks
which blocks hold the draft's KV, for sequences sent whole). The KV of drafts the target rejected
is overwritten as the sequence goes on. A greedy request's drafts are its greedy choices: the
verifier keeps a draft while the target's own draw equals it, so the outputs are the target's
whatever the draft model proposes.
A sampled request's drafts are drawn from the draft model's distribution (processed as the
request's sampling processes the target's), which goes with them to rejection sampling.

A greedy step's drafts stay on the device from one position to the next, each forward's inputs
the argmax of the one before, and are read on the host once, after the last position; a step
with a sampled request reads them position by position (its draws and penalties read the drafts
before them).

Where the target replays CUDA graphs, the draft model has its own (warm-up captures them on its
KV layers for the target's buckets): its proposing forwards after the first, one token a
sequence, replay decode graphs and its catch-up forward a mixed one; for a small model both are
launch-bound.
"""

from __future__ import annotations

import dataclasses
import itertools
from types import ModuleType

import torch
from pagedserve.services.common.config import ModelConfig
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.common.speculative_config import MAX_CATCH_UP_TOKENS, MAX_FUSED_CATCH_UP
from pagedserve.worker_svc.cache_engine import KVCacheSpec
from pagedserve.worker_svc.cuda_graphs import DecodeGraphs
from pagedserve.worker_svc.draft_blocks import DraftBlocks
from pagedserve.worker_svc.graph_buckets import GraphBuckets
from pagedserve.worker_svc.host_to_device import to_device
from pagedserve.worker_svc.layers.attention import Attention
from pagedserve.worker_svc.loader import load_hf_config, load_model
from pagedserve.worker_svc.mixed_graphs import MixedGraphs, capture_graphs, replay_forward
from pagedserve.worker_svc.model_input import ModelInput, build_model_input
from pagedserve.worker_svc.rejection_sampler import draw_drafts
from pagedserve.worker_svc.sampler import Sampler
from pagedserve.worker_svc.sequence_mirrors import CachedSequence
from pagedserve.worker_svc.spec_decode import sampling_state
from torch import nn


def load_draft_proposer(path: str, target: ModelConfig, spec: KVCacheSpec, vocab_size: int,
                        device: torch.device, backend: ModuleType, max_model_len: int,
                        tensor_parallel_size: int, sampler: Sampler
                        ) -> tuple[DraftProposer, KVCacheSpec]:
    """The draft model at `path` and the KV cache spec with its layers added: they share the
    target's blocks (block ids, tables, slots), each layer in its own KV shape."""
    if tensor_parallel_size > 1:
        raise ConfigError("speculative_config method 'draft_model' runs on one worker, got "
                          f"tensor_parallel_size={tensor_parallel_size}")
    hf_config = load_hf_config(path)
    if int(hf_config.vocab_size) != vocab_size:
        raise ConfigError(f"speculative_config.model={path!r} has vocab_size="
                          f"{hf_config.vocab_size}, the target model {vocab_size}: a draft model "
                          "shares the target's tokenizer")
    model = load_model(dataclasses.replace(target, model=path), hf_config, spec.dtype, device,
                       backend=backend, max_position=max_model_len)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    return (DraftProposer(model, spec.block_size, device, sampler),
            dataclasses.replace(spec, num_draft_layers=len(layers),
                                draft_num_kv_heads=layers[0].num_kv_heads,
                                draft_head_size=layers[0].head_size))


class DraftProposer:
    def __init__(self, model: nn.Module, block_size: int, device: torch.device,
                 sampler: Sampler | None = None,
                 max_catch_up_tokens: int = MAX_CATCH_UP_TOKENS) -> None:
        """sampler: processes a sampled request's draft distributions; None: greedy drafts."""
        self.model = model
        self.block_size = block_size
        self.max_catch_up_tokens = max_catch_up_tokens
        self.blocks = DraftBlocks(block_size)
        self.device = device
        self.sampler = sampler
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None

    def capture_graphs(self, buckets: GraphBuckets, kv_caches: list[torch.Tensor]) -> None:
        """The draft model's decode and mixed-step graphs on its KV layers, for the target's
        buckets, in a pool of their own."""
        self.graphs, self.mixed_graphs = capture_graphs(self.model, buckets, self.block_size,
                                                        kv_caches, self.device)

    @torch.inference_mode()
    def catch_up(self, scheduled: list[CachedSequence], kv_caches: list[torch.Tensor]
                 ) -> set[int] | None:
        """Proposing sequences whose draft KV lags by more than the few tokens decoded since
        they last proposed (a prompt that arrived while speculation was off, a swap-in or a
        prefix-cache hit without it) catch up in a forward of their own, without logits, at
        most max_catch_up_tokens a step, the least behind first. One that does not reach its
        last known token this step gives its lookahead slots back and proposes nothing: drafts
        from a partial context would be rejected. Returns those sequences' ids; None: no
        forward ran."""
        lagging = [s for s in scheduled if s.num_lookahead_slots
                   and _known_end(s) - 1 - s.num_draft_computed > MAX_FUSED_CATCH_UP]
        if not lagging:
            return None
        lagging.sort(key=lambda s: _known_end(s) - s.num_draft_computed)
        chunks, behind, budget = [], set(), self.max_catch_up_tokens
        for seq in lagging:
            end = _known_end(seq) - 1  # the last known token: the first proposing forward's
            num_tokens = min(end - seq.num_draft_computed, budget)
            if num_tokens:
                chunks.append(self._catch_up_chunk(seq, seq.num_draft_computed + num_tokens))
                budget -= num_tokens
            if seq.num_draft_computed < end:
                behind.add(seq.seq_id)
                seq.num_scheduled_tokens -= seq.num_lookahead_slots
                seq.num_lookahead_slots = 0
        if not chunks:
            return behind
        chunks.sort(key=lambda s: not s.is_prefill)
        self._draw(chunks, {}, {}, kv_caches)
        return behind

    @torch.inference_mode()
    def propose(self, scheduled: list[CachedSequence], kv_caches: list[torch.Tensor]) -> bool:
        """Brings the draft model's KV of each proposing sequence up to its known tokens, then
        fills the draft_token_ids of every sequence with num_lookahead_slots: one forward per
        draft position. A sequence that does not propose (a prompt chunk, a decode whose drafts
        the scheduler cut) catches up when it next does, so that a step without speculation
        runs no draft forward. scheduled: this step's sequences, after catch_up, before their
        tokens are marked computed. Returns whether the draft model ran."""
        catch_up = []
        proposing = [s for s in scheduled if s.num_lookahead_slots and not s.pooling_type]
        for seq in proposing:
            end = _known_end(seq)
            if seq.num_draft_computed < end:
                catch_up.append(self._catch_up_chunk(seq, end))
        if not catch_up:
            return False
        catch_up.sort(key=lambda s: not s.is_prefill)
        drafts: dict[int, list[int]] = {s.seq_id: [] for s in proposing}
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in proposing}
        if self.sampler is None or all(s.sampling.is_greedy for s in proposing):
            self._propose_greedy(catch_up, proposing, drafts, kv_caches)
        else:
            self._propose_by_position(catch_up, proposing, drafts, probs, kv_caches)
        for seq in proposing:
            seq.draft_token_ids = drafts[seq.seq_id]
            seq.draft_probs = torch.stack(probs[seq.seq_id]) if probs[seq.seq_id] else None
            # KV of its last known token and all drafts but the last
            seq.num_draft_computed = len(seq.token_ids) + seq.num_lookahead_slots - 1
            seq.num_lookahead_slots = 0
        return True

    def _catch_up_chunk(self, seq: CachedSequence, end: int) -> CachedSequence:
        """The draft model's input computing the sequence's known tokens up to `end` this step;
        they count as computed from here on."""
        chunk = dataclasses.replace(seq, num_computed_tokens=seq.num_draft_computed,
                                    num_scheduled_tokens=end - seq.num_draft_computed,
                                    draft_token_ids=[])
        self.blocks.mark(seq.block_table, seq.num_draft_computed, end)
        seq.num_draft_computed = end
        return chunk

    def _propose_by_position(self, catch_up: list[CachedSequence],
                             proposing: list[CachedSequence], drafts: dict[int, list[int]],
                             probs: dict[int, list[torch.Tensor]],
                             kv_caches: list[torch.Tensor]) -> None:
        """Each position's drafts read on the host before the next: a sampled draft is drawn
        from its distribution after the drafts before it (penalties read them)."""
        self._draw(catch_up, drafts, probs, kv_caches)
        for j in range(1, max((s.num_lookahead_slots for s in proposing), default=0)):
            self._draw(_next_position(proposing, drafts, j), drafts, probs, kv_caches)

    def _propose_greedy(self, catch_up: list[CachedSequence], proposing: list[CachedSequence],
                        drafts: dict[int, list[int]], kv_caches: list[torch.Tensor]) -> None:
        """Greedy drafts stay on the device from one position to the next (each forward's
        input is the argmax before it) and are read on the host once, after the last."""
        seqs, drawn = catch_up, None
        columns: list[tuple[list[int], torch.Tensor]] = []  # (seq_ids, [num_rows] drafts)
        for j in range(max(s.num_lookahead_slots for s in proposing)):
            if j:
                seqs = _next_position(proposing, None, j)
                rows_of = {seq_id: i for i, seq_id in enumerate(columns[-1][0])}
                drawn = {s.seq_id: rows_of[s.seq_id] for s in seqs}
            model_input = build_model_input(seqs, self.block_size, self.device, drawn)
            if model_input.drawn_rows:
                model_input.take_draws(columns[-1][1])
            logits, row_seqs = self._logits(model_input, seqs, drafts, kv_caches)
            columns.append(([s.seq_id for s in row_seqs], logits.argmax(dim=-1)))
        tokens = torch.cat([column for _, column in columns]).tolist()
        for seq_id, token in zip((i for ids, _ in columns for i in ids), tokens, strict=True):
            drafts[seq_id].append(token)

    def _logits(self, model_input: ModelInput, seqs: list[CachedSequence],
                drafts: dict[int, list[int]], kv_caches: list[torch.Tensor]
                ) -> tuple[torch.Tensor | None, list[CachedSequence]]:
        """One forward; the logits [num_rows, vocab] after the last token of each sequence in
        `drafts`, and those sequences (None, []: none proposes)."""
        hidden_states = replay_forward(model_input, kv_caches, self.graphs,
                                       self.mixed_graphs)  # [num_tokens, hidden]
        if hidden_states is None:
            hidden_states = self.model(model_input.input_ids, model_input.positions,
                                       kv_caches, model_input.meta)
        ends = itertools.accumulate(model_input.meta.query_lens_cpu)
        rows = [(s, end - 1) for s, end in zip(seqs, ends, strict=True) if s.seq_id in drafts]
        if not rows:
            return None, []
        index = to_device([row for _, row in rows], torch.long, hidden_states.device)
        return self.model.compute_logits(hidden_states[index]), [s for s, _ in rows]

    def _draw(self, seqs: list[CachedSequence], drafts: dict[int, list[int]],
              probs: dict[int, list[torch.Tensor]], kv_caches: list[torch.Tensor]) -> None:
        """One forward over seqs (prefills first); appends the next draft of each sequence in
        `drafts` after its last computed token (and, sampled, the distribution it came from)."""
        model_input = build_model_input(seqs, self.block_size, self.device)
        logits, rows = self._logits(model_input, seqs, drafts, kv_caches)
        if logits is None:
            return
        for seq, token in zip(rows, logits.argmax(dim=-1).tolist(), strict=True):
            drafts[seq.seq_id].append(token)
        sampled = [i for i, seq in enumerate(rows)
                   if self.sampler is not None and not seq.sampling.is_greedy]
        if not sampled:
            return
        states = [sampling_state(rows[i]) for i in sampled]
        row_probs = self.sampler.logprobs(logits[sampled], states).exp()  # [num_sampled, vocab]
        for state, q, token in zip(states, row_probs, draw_drafts(self.sampler, row_probs, states),
                                   strict=True):
            drafts[state.seq_id][-1] = token
            probs[state.seq_id].append(q)


def _known_end(seq: CachedSequence) -> int:
    """The end of the sequence's known tokens this step: a token still being drawn is not."""
    return min(len(seq.token_ids),
               seq.num_computed_tokens + seq.num_scheduled_tokens - seq.num_lookahead_slots)


def _next_position(proposing: list[CachedSequence], drafts: dict[int, list[int]] | None,
                   j: int) -> list[CachedSequence]:
    """The one-token inputs of draft position j: each sequence with more than j slots, its
    draft j - 1 last (None: still on the device, left to the caller)."""
    return [dataclasses.replace(
        s, token_ids=s.token_ids + (drafts[s.seq_id] if drafts is not None else [0] * (j - 1)),
        num_computed_tokens=len(s.token_ids) + j - 1, num_scheduled_tokens=1,
        draft_token_ids=[]) for s in proposing if s.num_lookahead_slots > j]
