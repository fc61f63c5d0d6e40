"""The in-process engine on CUDA with each backend: greedy output is HF's (float32), and swap
preemption through the side stream does not change it; a closed engine gives its memory back,
gpu_memory_utilization is each engine's own share, and a draft model replays its own CUDA
graphs. Skipped without CUDA."""

from __future__ import annotations

import json

import pytest
import torch
from pagedserve.services.common.config import GiB
from pagedserve.services.common.sampling_params import SamplingParams

from bench.draft_model import truncate
from pagedserve.llm_engine import LLMEngine
from tests.gpu.gpu_worker import CUDA_BACKENDS, prompt
from tests.integration.worker_driver import hf_logits
from tests.tiny_models import load_hf

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPT_LENS = [13, 29, 7, 21]


def _engine(model_dir, backend: str, **kw) -> LLMEngine:
    options = dict(model=str(model_dir), device="cuda", attention_backend=backend,
                   dtype="float32", block_size=8, num_gpu_blocks_override=128,
                   num_cpu_blocks_override=64, max_num_seqs=8)
    options.update(kw)
    return LLMEngine.from_kwargs(**options)


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, GREEDY)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for report in engine.step():
            tokens[report.request_id] += report.outputs[0].token_ids if report.outputs else []
    return tokens


def _decode_graph_replays(engine: LLMEngine) -> int | None:
    graphs = engine.core.workers[0].runner.decode_graphs
    return None if graphs is None else graphs.num_replays


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_engine_greedy_is_hf_and_survives_swap_preemption(tiny_model_dir, backend):
    path = tiny_model_dir("llama")
    prompts = [prompt(i, n) for i, n in enumerate(PROMPT_LENS)]
    roomy = _engine(path, backend)
    expected = _generate(roomy, prompts)
    hf = load_hf(path)
    for i, ids in enumerate(prompts):
        tokens = expected[f"r{i}"]
        assert len(tokens) == GREEDY.max_tokens
        reference = hf_logits(hf, ids + tokens)
        assert tokens == reference[len(ids) - 1:-1].argmax(dim=-1).tolist(), f"prompt {i}"
    # 4 sequences of up to 53 tokens need 26 blocks of 8: 12 force swaps out and back in
    tight = _engine(path, backend, num_gpu_blocks_override=12, preemption_mode="swap")
    assert _generate(tight, prompts) == expected
    assert tight.get_load().num_preemptions > 0
    load = tight.get_load()
    assert load.num_gpu_blocks_used == 0 and load.num_cpu_blocks_used == 0
    if backend == "torch":
        assert _decode_graph_replays(roomy) is None  # never captured: shapes follow host lengths
    else:
        assert _decode_graph_replays(roomy) > 0 and _decode_graph_replays(tight) > 0


def _profiled(model_dir, **kw) -> LLMEngine:
    """An engine that sizes its cache from the device's memory (16 KiB blocks: a few million
    of them in an 80 GB GPU's share)."""
    return _engine(model_dir, "triton", num_gpu_blocks_override=0, block_size=32, **kw)


def test_a_closed_engine_gives_its_memory_back_and_the_next_gets_as_much(tiny_model_dir):
    """At 0.6 each, the second fits only if the first gave its share back."""
    model_dir = tiny_model_dir("llama")
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    with _profiled(model_dir, gpu_memory_utilization=0.6) as first:
        num_blocks = first.core.num_gpu_blocks
        tokens = _generate(first, [prompt(0, 13)])
    assert torch.cuda.memory_allocated() - baseline < 64 << 20
    with _profiled(model_dir, gpu_memory_utilization=0.6) as second:
        assert second.core.num_gpu_blocks == pytest.approx(num_blocks, rel=0.02)
        assert _generate(second, [prompt(0, 13)]) == tokens


def test_two_engines_at_045_get_the_same_cache_in_either_order(tiny_model_dir):
    """gpu_memory_utilization is each one's own share: the second does not count the first's."""
    model_dir = tiny_model_dir("llama")
    with _profiled(model_dir, gpu_memory_utilization=0.45) as first, \
            _profiled(model_dir, gpu_memory_utilization=0.45) as second:
        assert second.core.num_gpu_blocks == pytest.approx(first.core.num_gpu_blocks, rel=0.02)
        assert _generate(second, [prompt(1, 7)]) == _generate(first, [prompt(1, 7)])


def test_kv_cache_memory_gib_sizes_the_cuda_cache(tiny_model_dir):
    with _profiled(tiny_model_dir("llama"), kv_cache_memory_gib=0.25) as engine:
        worker = engine.core.workers[0]
        assert engine.core.num_gpu_blocks == int(0.25 * GiB) // worker.kv_spec.bytes_per_block


def test_draft_model_graphs_give_the_eager_drafts(tiny_model_dir, tmp_path):
    """The draft model's proposing forwards replay its own decode graphs, and the outputs are
    speculation off's (and eager drafting's: the same drafts accepted)."""
    path = tiny_model_dir("llama")
    draft = truncate(path, tmp_path / "draft", num_layers=1)
    speculative = json.dumps({"method": "draft_model", "model": str(draft),
                              "num_speculative_tokens": 3, "adaptive": False})
    prompts = [prompt(i, n) for i, n in enumerate(PROMPT_LENS)]
    expected = _generate(_engine(path, "triton"), prompts)
    eager = _engine(path, "triton", speculative_config=speculative, enable_cuda_graph=False)
    graphed = _engine(path, "triton", speculative_config=speculative)
    assert _generate(eager, prompts) == _generate(graphed, prompts) == expected
    drafter = graphed.core.workers[0].runner.drafter
    assert eager.core.workers[0].runner.drafter.graphs is None
    assert drafter.graphs.num_replays > 0
    totals = (engine.core.scheduler.speculator.totals for engine in (eager, graphed))
    assert len({(t.num_draft_tokens, t.num_accepted_tokens) for t in totals}) == 1
