"""Plays the scheduler for worker tests: trivial block allocation, StepPlans as deltas, sampled
tokens appended; and records the logits the worker samples from, for comparison with HF."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pagedserve.services.common.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import NewSequence, RunningSequence, StepOutput, StepPlan
from pagedserve.worker_svc.sampler import Sampler, SeqSamplingState
from pagedserve.worker_svc.worker import Worker

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


class RecordingSampler(Sampler):
    """The real sampler, plus a copy of each row's logits keyed by (seq_id, position)."""

    def __init__(self, inner: Sampler) -> None:
        super().__init__(inner.vocab_size, inner.eos_token_ids, inner.device)
        self.logits: dict[tuple[int, int], torch.Tensor] = {}

    def launch(self, logits: torch.Tensor, seqs: list[SeqSamplingState]):
        for row, seq in zip(logits, seqs, strict=True):
            self.logits[(seq.seq_id, len(seq.token_ids) - 1)] = row.detach().cpu().clone()
        return super().launch(logits, seqs)


def make_worker(model_dir: Path, num_gpu_blocks: int = 96, num_cpu_blocks: int = 32,
                block_size: int = 8, backend: str = "torch", epoch: int = 1, device: str = "cpu",
                num_threads: int = 0, **model_kw) -> Worker:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), **model_kw),
        cache=CacheConfig(block_size=block_size, num_gpu_blocks_override=num_gpu_blocks,
                          num_cpu_blocks_override=num_cpu_blocks),
        device=DeviceConfig(device=device, attention_backend=backend, num_threads=num_threads))
    worker = Worker(config)
    worker.load_model()
    profile = worker.profile_memory()
    worker.init_cache(profile.num_gpu_blocks, profile.num_cpu_blocks, epoch)
    return worker



def prefill_then_decodes(prompts: list[list[int]], samplings: list[SamplingParams],
                         num_decode_steps: int, block_size: int,
                         epoch: int = 1) -> list[StepPlan]:
    """A step prefilling every prompt (sequence i: prompts[i], samplings[i], seed 1234 + i, room
    for num_decode_steps + 1 tokens), then decode steps that add nothing to what the worker drew:
    each may be sent while the one before runs."""
    num_blocks = [-(-(len(p) + num_decode_steps + 1) // block_size) for p in prompts]
    starts = [sum(num_blocks[:i]) for i in range(len(prompts))]
    new_seqs = [NewSequence(seq_id=i, request_id=f"r{i}", token_ids=list(prompt),
                            prompt_len=len(prompt),
                            block_ids=list(range(starts[i], starts[i] + num_blocks[i])),
                            num_computed_tokens=0, num_scheduled_tokens=len(prompt),
                            sampling=samplings[i], seed=1234 + i)
                for i, prompt in enumerate(prompts)]
    plans = [StepPlan(epoch, 1, new_seqs=new_seqs)]
    for step_id in range(2, num_decode_steps + 2):
        plans.append(StepPlan(epoch, step_id, previous_step_id=step_id - 1, running_seqs=[
            RunningSequence(i, [], num_blocks[i], [], 1) for i in range(len(prompts))]))
    return plans

@dataclass
class DrivenSeq:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_sent_tokens: int = 0  # how many of token_ids the worker knows
    num_sent_blocks: int = 0
    is_known: bool = False  # the worker has a mirror of it
    prompt_logprobs: list = field(default_factory=list)


class Driver:
    """A minimal scheduler: the test says which sequences run how many tokens each step."""

    def __init__(self, worker: Worker, epoch: int = 1, shuffle_blocks: bool = True) -> None:
        self.worker = worker
        self.epoch = epoch
        self.block_size = worker.kv_spec.block_size
        self.free_blocks = list(range(worker.cache_engine.num_gpu_blocks))
        if shuffle_blocks:  # non-contiguous block tables exercise the paging
            random.Random(0).shuffle(self.free_blocks)
        self.seqs: dict[int, DrivenSeq] = {}
        self.step_id = 0
        self.recorder = RecordingSampler(worker.runner.sampler)
        worker.runner.sampler = self.recorder

    def add(self, seq_id: int, prompt: list[int], sampling: SamplingParams = GREEDY) -> DrivenSeq:
        self.seqs[seq_id] = DrivenSeq(seq_id, list(prompt), len(prompt), sampling)
        return self.seqs[seq_id]

    def remaining(self, seq_id: int) -> int:
        seq = self.seqs[seq_id]
        return len(seq.token_ids) - seq.num_computed_tokens

    def _allocate(self, seq: DrivenSeq, num_tokens: int) -> None:
        while len(seq.block_ids) * self.block_size < num_tokens:
            seq.block_ids.append(self.free_blocks.pop())

    def plan(self, schedule: dict[int, int], **extra) -> StepPlan:
        new_seqs, running = [], []
        for seq_id, num_tokens in schedule.items():
            seq = self.seqs[seq_id]
            self._allocate(seq, seq.num_computed_tokens + num_tokens)
            if not seq.is_known:
                new_seqs.append(NewSequence(
                    seq_id=seq_id, request_id=f"r{seq_id}", token_ids=list(seq.token_ids),
                    prompt_len=seq.prompt_len, block_ids=list(seq.block_ids),
                    num_computed_tokens=seq.num_computed_tokens, num_scheduled_tokens=num_tokens,
                    sampling=seq.sampling))
                seq.is_known = True
            else:
                running.append(RunningSequence(
                    seq_id=seq_id, new_token_ids=seq.token_ids[seq.num_sent_tokens:],
                    block_ids_start=seq.num_sent_blocks,
                    block_ids=seq.block_ids[seq.num_sent_blocks:],
                    num_scheduled_tokens=num_tokens))
            seq.num_sent_tokens = len(seq.token_ids)
            seq.num_sent_blocks = len(seq.block_ids)
        self.step_id += 1
        return StepPlan(scheduler_epoch=self.epoch, step_id=self.step_id,
                        previous_step_id=self.step_id - 1, new_seqs=new_seqs,
                        running_seqs=running, **extra)

    def step(self, schedule: dict[int, int], **extra) -> StepOutput:
        return self.run(self.plan(schedule, **extra))

    def run(self, plan: StepPlan) -> StepOutput:
        """Execute a plan (from `plan`, possibly edited) and take in its outputs."""
        output = self.worker.execute_step(plan)
        for scheduled in (*plan.new_seqs, *plan.running_seqs):
            if scheduled.seq_id in self.seqs:
                self.seqs[scheduled.seq_id].num_computed_tokens += scheduled.num_scheduled_tokens
        for out in output.sampled_by_seq().values():
            seq = self.seqs[out.seq_id]
            seq.token_ids.extend(out.token_ids)
            if len(out.token_ids) == 1:
                seq.num_sent_tokens += 1  # the worker appended its own sample
            seq.prompt_logprobs.extend(out.prompt_logprobs)
        return output

    def run_to_length(self, seq_ids: list[int], num_tokens: int) -> None:
        """Decode (or finish prefilling) the given sequences until each holds num_tokens."""
        while True:
            schedule = {i: self.remaining(i) for i in seq_ids
                        if len(self.seqs[i].token_ids) < num_tokens}
            if not schedule:
                return
            self.step(schedule)


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """HF's full-forward logits at every position: [len(token_ids), vocab]."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def assert_matches_hf(driver: Driver, hf_model, seq_id: int, atol: float = 1e-4) -> None:
    """Every generated token is HF's greedy choice and every recorded logits row equals HF's."""
    seq = driver.seqs[seq_id]
    reference = hf_logits(hf_model, seq.token_ids)
    rows = {pos: row for (sid, pos), row in driver.recorder.logits.items() if sid == seq_id}
    assert len(rows) == len(seq.token_ids) - seq.prompt_len
    for pos, row in rows.items():
        torch.testing.assert_close(row, reference[pos], atol=atol, rtol=0,
                                   msg=lambda m, p=pos: f"seq {seq_id} position {p}: {m}")
    generated = seq.token_ids[seq.prompt_len:]
    expected = reference[seq.prompt_len - 1:-1].argmax(dim=-1).tolist()
    assert generated == expected
