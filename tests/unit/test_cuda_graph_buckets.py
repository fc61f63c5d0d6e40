"""The CPU-checkable half of the decode CUDA graphs: bucket choice, which steps may replay, the
static buffers a step is copied into (padding included), and that the padded forward a graph
records gives the decode rows the eager forward's hidden states (Triton under its interpreter)."""

from __future__ import annotations

import random

import pytest
import torch
from pagedserve.kernels.backend import available_backends
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.worker_svc.cuda_graphs import DecodeBuffers, DecodeGraphs, decode_batch_size
from pagedserve.worker_svc.graph_buckets import capture_batch_sizes, pick_batch_size
from pagedserve.worker_svc.model_input import build_model_input
from pagedserve.worker_svc.sequence_mirrors import CachedSequence

from tests.integration.worker_driver import make_worker
from tests.unit.eager_graphs import with_eager_replays

BLOCK_SIZE = 8
GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")


def _seq(seq_id: int, num_tokens: int, block_table: list[int], num_scheduled: int = 1,
         num_computed: int | None = None) -> CachedSequence:
    """A sequence of num_tokens tokens running its last num_scheduled of them this step."""
    rng = random.Random(seq_id)
    return CachedSequence(
        seq_id=seq_id, request_id=f"r{seq_id}",
        token_ids=[rng.randrange(3, 256) for _ in range(num_tokens)], prompt_len=num_tokens - 1,
        block_table=block_table,
        num_computed_tokens=num_tokens - num_scheduled if num_computed is None else num_computed,
        sampling=GREEDY, seed=None, num_samples=1, num_scheduled_tokens=num_scheduled)


def _decodes() -> list[CachedSequence]:
    """Three decodes over shuffled, non-contiguous blocks, of 12, 20 and 5 tokens."""
    return [_seq(0, 12, [9, 3]), _seq(1, 20, [4, 11, 7]), _seq(2, 5, [6])]


def test_buckets_cover_every_batch_up_to_the_limit():
    sizes = capture_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and len(sizes) == 35
    assert capture_batch_sizes(1000) == sizes
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(1) == [1]
    for limit in (1, 3, 8, 20, 100, 256):
        sizes = capture_batch_sizes(limit)
        assert sizes == sorted(set(sizes))
        assert all(pick_batch_size(n, sizes) >= n for n in range(1, limit + 1))


def test_pick_the_smallest_bucket_that_holds_the_batch():
    sizes = capture_batch_sizes(64)
    assert [pick_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 64)] == \
        [1, 2, 4, 8, 8, 16, 24, 64]
    assert pick_batch_size(65, sizes) is None


def test_only_short_enough_decode_only_steps_replay():
    sizes = [1, 2, 4]
    decodes = build_model_input(_decodes(), BLOCK_SIZE, CPU)
    assert decode_batch_size(decodes.meta, sizes, max_seq_len=64) == 4
    assert decode_batch_size(decodes.meta, sizes, max_seq_len=20) == 4  # the bound is inclusive
    assert decode_batch_size(decodes.meta, sizes, max_seq_len=19) is None
    assert decode_batch_size(decodes.meta, [1, 2], max_seq_len=64) is None
    mixed = build_model_input([_seq(5, 9, [2, 8], num_scheduled=9), *_decodes()], BLOCK_SIZE, CPU)
    assert decode_batch_size(mixed.meta, sizes + [8], max_seq_len=64) is None


def test_load_copies_the_step_and_pads_the_rest_of_its_bucket():
    buffers = DecodeBuffers.allocate(max_batch_size=8, max_blocks_per_seq=4, device=CPU)
    # a larger step first, so the padding must overwrite its leftovers
    buffers.load(build_model_input(
        [*_decodes(), _seq(3, 30, [1, 2, 5, 10]), _seq(4, 3, [12])], BLOCK_SIZE, CPU), 8)
    step = build_model_input(_decodes(), BLOCK_SIZE, CPU)
    buffers.load(step, 4)
    assert buffers.input_ids[:4].tolist() == [*step.input_ids.tolist(), 0]
    assert buffers.positions[:4].tolist() == [11, 19, 4, 0]
    assert buffers.slot_mapping[:4].tolist() == [3 * 8 + 3, 7 * 8 + 3, 6 * 8 + 4, -1]
    assert buffers.seq_lens[:4].tolist() == [12, 20, 5, 1]
    assert buffers.block_tables[:3, :3].tolist() == [[9, 3, 0], [4, 11, 7], [6, 0, 0]]
    assert buffers.block_tables[3].tolist() == [0, 0, 0, 0]
    meta = buffers.metadata(4, max_seq_len=64)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    # host fields hold the bounds a capture sizes its launches by, not this step's lengths
    assert (meta.num_prefills, meta.max_query_len, meta.seq_lens_cpu) == (0, 1, [64] * 4)
    with pytest.raises(ValueError, match="does not fit"):
        buffers.load(step, 2)
    # the larger step's fifth row, past the bucket of 4, is padded once a bucket reaches it
    assert buffers.slot_mapping[4].tolist() != -1
    buffers.load(step, 8)
    assert buffers.slot_mapping.tolist() == [3 * 8 + 3, 7 * 8 + 3, 6 * 8 + 4] + [-1] * 5
    assert buffers.seq_lens[3:].tolist() == [1] * 5
    assert buffers.block_tables[3:].tolist() == [[0] * 4] * 5
    assert buffers.input_ids[3:].tolist() == [0] * 5 and buffers.positions[3:].tolist() == [0] * 5


def test_load_of_a_steady_batch_writes_no_padding():
    buffers = DecodeBuffers.allocate(max_batch_size=8, max_blocks_per_seq=4, device=CPU)
    step = build_model_input(_decodes(), BLOCK_SIZE, CPU)
    buffers.load(step, 4)
    buffers.slot_mapping[3] = 99  # not a row the next load of 3 rows should touch again
    buffers.load(step, 4)
    assert buffers.slot_mapping[3].item() == 99


@pytest.mark.parametrize("partition_size", [512, 8], ids=["unified", "split-kv"])
def test_padded_static_forward_equals_eager_for_the_decode_rows(tiny_model_dir, monkeypatch,
                                                                partition_size):
    """What a graph records (the model over the padded buffers, launch geometry from the
    bounds) against the eager forward of the same step; padding rows write no KV."""
    if "triton" not in available_backends(CPU):
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    from pagedserve.kernels import triton_ops

    # 8-token partitions: the bound of 48 gives 6, most of them past the real lengths
    monkeypatch.setattr(triton_ops, "DECODE_PARTITION_SIZE", partition_size)
    worker = make_worker(tiny_model_dir("llama"), num_gpu_blocks=16, num_cpu_blocks=0,
                         block_size=BLOCK_SIZE, backend="triton")
    model, kv_caches = worker.runner.model, worker.cache_engine.gpu_cache
    generator = torch.Generator().manual_seed(0)
    for layer in kv_caches:
        layer.copy_(torch.randn(layer.shape, generator=generator))
    step = build_model_input(_decodes(), BLOCK_SIZE, CPU)
    with torch.inference_mode():
        eager = model(step.input_ids, step.positions, kv_caches, step.meta)  # [3, hidden]
        after_eager = [layer.clone() for layer in kv_caches]
        graphs = DecodeGraphs(model, [1, 2, 4], max_seq_len=48, block_size=BLOCK_SIZE,
                              device=CPU)
        graphs.buffers.load(step, 4)
        static = graphs.run_static(4, kv_caches)  # [4, hidden]
    torch.testing.assert_close(static[:3], eager, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(static[3]).all()
    # the real rows rewrote their slots (the second layer's K/V within rounding of a 4-row
    # batch); a padding row writing anywhere, block 0 included, would show as a gross change
    for before, after in zip(after_eager, kv_caches, strict=True):
        torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    assert graphs.batch_size_for(step, kv_caches) is None  # nothing captured on this cache


def test_cpu_worker_captures_nothing(tiny_model_dir):
    worker = make_worker(tiny_model_dir("llama"), num_gpu_blocks=8, num_cpu_blocks=0)
    assert worker.config.device.enable_cuda_graph
    assert worker.warm_up() == 0 and worker.warm_up([1, 2]) == 0
    assert worker.runner.decode_graphs is None


def _stand_in_graphs(model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> DecodeGraphs:
    graphs = DecodeGraphs(model, [1, 2, 4], max_seq_len=64, block_size=BLOCK_SIZE, device=CPU)
    return with_eager_replays(graphs, graphs.batch_sizes, kv_caches)


def test_decode_steps_take_the_graph_path_and_keep_their_tokens(tiny_model_dir):
    """The runner's side of the graphs (which steps replay, copy-in, padding, output rows)
    through real steps, with CUDA graphs stood in for by EagerReplay."""
    if "triton" not in available_backends(CPU):
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    from tests.integration.worker_driver import Driver

    lens = {0: 7, 1: 3, 2: 12}
    drivers = []
    for is_graphed in (False, True):
        worker = make_worker(tiny_model_dir("qwen2"), num_gpu_blocks=32, num_cpu_blocks=0,
                             block_size=BLOCK_SIZE, backend="triton")
        if is_graphed:
            worker.runner.decode_graphs = _stand_in_graphs(worker.runner.model,
                                                           worker.cache_engine.gpu_cache)
        driver = Driver(worker)
        for seq_id, n in lens.items():
            driver.add(seq_id, [5 + 7 * seq_id + i for i in range(n)])
        driver.step(dict(lens))  # a prefill step: eager
        driver.run_to_length([0, 1], 10)  # 2 sequences in the bucket of 2
        driver.run_to_length(list(lens), 15)  # 3 sequences in the bucket of 4, then fewer
        drivers.append(driver)
    eager, graphed = drivers
    assert graphed.worker.runner.decode_graphs.num_replays == graphed.step_id - 1
    for seq_id in lens:
        assert graphed.seqs[seq_id].token_ids == eager.seqs[seq_id].token_ids
    assert graphed.recorder.logits.keys() == eager.recorder.logits.keys()
    for key, row in graphed.recorder.logits.items():
        torch.testing.assert_close(row, eager.recorder.logits[key], atol=1e-4, rtol=0)


def test_a_draft_models_proposing_forwards_take_its_graphs(tiny_model_dir, tmp_path):
    """With its decode graphs stood in for by EagerReplay, the draft model proposes the drafts
    it proposes eagerly: same outputs, same drafts accepted, its one-token forwards replayed."""
    if "triton" not in available_backends(CPU):
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    from bench.draft_model import truncate
    from pagedserve.llm_engine import LLMEngine
    from tests.integration.test_draft_model import draft_config
    from tests.integration.test_spec_decode import prompts_with_repeats, run

    path = tiny_model_dir("llama")
    draft = truncate(path, tmp_path / "draft", num_layers=1)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = []
    for is_graphed in (False, True):
        engine = LLMEngine.from_kwargs(
            model=str(path), device="cpu", attention_backend="triton", block_size=BLOCK_SIZE,
            num_threads=1, num_gpu_blocks_override=64, speculative_config=draft_config(draft))
        drafter = engine.core.workers[0].runner.drafter
        if is_graphed:
            cache = engine.core.workers[0].cache_engine.draft_gpu_cache
            drafter.graphs = _stand_in_graphs(drafter.model, cache)
        totals = engine.core.scheduler.speculator.totals
        outputs = run(engine, prompts_with_repeats(2), sampling)
        results.append((outputs, totals.num_draft_tokens, totals.num_accepted_tokens))
    assert results[0] == results[1]
    assert drafter.graphs.num_replays > 0


def test_only_a_plain_decode_has_every_token_as_a_logits_row():
    assert build_model_input(_decodes(), BLOCK_SIZE, CPU).is_every_row_a_logits_row
    mixed = build_model_input([_seq(5, 9, [2, 8], num_scheduled=9), *_decodes()], BLOCK_SIZE, CPU)
    assert not mixed.is_every_row_a_logits_row
