"""The offline LLM runs ahead as the services do: while the device runs step n, the host plans
step n+1 (the scheduler's StepWindow) and builds and launches its inputs (the worker's
LaunchWindow). Its outputs are those of steps run one at a time -- greedy, seeded with logprobs,
n > 1, best_of and beam search -- on the simulated GPU, which launches ahead and whose tokens
depend on the tokens before them, and on the real model on CPU, where the host is the device."""

from __future__ import annotations

import pytest
from pagedserve.services.common.sampling_params import SamplingParams

from pagedserve.llm import LLM
from tests.unit.tiny_tokenizers import byte_level_bpe

SAMPLINGS = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=7, max_tokens=24, logprobs=2),
    SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=16),
    SamplingParams(n=2, best_of=3, temperature=1.0, seed=5, max_tokens=16),
    SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=12),
]
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31]]
DEVICES = {"sim": dict(device="sim", sim_model="Llama-3-8B", sim_time_scale=10.0),
           "cpu": dict(device="cpu", attention_backend="torch", num_threads=1)}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    byte_level_bpe().hf_tokenizer.save_pretrained(path)
    return path


def _generate(model_dir, tokenizer_dir, device: str, async_scheduling: bool):
    """Every prompt with every sampling, in one batch; and how many steps the worker launched
    ahead of the step in flight."""
    with LLM(str(model_dir), tokenizer=str(tokenizer_dir), block_size=8,
             num_gpu_blocks_override=128, num_cpu_blocks_override=16,
             async_scheduling=async_scheduling, **DEVICES[device]) as llm:
        outputs = llm.generate([p for p in PROMPTS for _ in SAMPLINGS],
                               [s for _ in PROMPTS for s in SAMPLINGS], use_tqdm=False)
        num_launched_ahead = llm.engine.core.workers[0].steps.num_launched_ahead
    return [[(c.index, c.text, c.token_ids, c.logprobs, c.top_logprobs, c.finish_reason)
             for c in out.outputs] for out in outputs], num_launched_ahead


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_running_ahead_gives_the_outputs_of_steps_one_at_a_time(llama_dir, tokenizer_dir,
                                                                device):
    expected, num_ahead_one_at_a_time = _generate(llama_dir, tokenizer_dir, device, False)
    outputs, num_launched_ahead = _generate(llama_dir, tokenizer_dir, device, True)
    assert outputs == expected
    assert num_ahead_one_at_a_time == 0
    if device == "sim":  # the device runs apart from the host: the host's work runs beside it
        assert num_launched_ahead > 10
    else:
        assert num_launched_ahead == 0
