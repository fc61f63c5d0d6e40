"""logit_bias, allowed_token_ids, bad words and greedy n > 1 through the in-process engine on a
tiny random-weight Llama, all in one batch: each request gets what it asked for, and a plain
greedy request batched with them keeps its output token for token; the offline LLM tokenizes
bad words and truncates prompts as the gateway does."""

from __future__ import annotations

import dataclasses

from pagedserve.services.common.sampling_params import SamplingParams

from pagedserve.llm import LLM
from pagedserve.llm_engine import LLMEngine
from tests import tiny_models

PROMPT = [5, 17, 99, 42, 7, 150, 33]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def run(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, list[list[int]]]:
    for request_id, sampling in requests.items():
        engine.add_request(request_id, PROMPT, sampling)
    tokens: dict[str, dict[int, list[int]]] = {r: {} for r in requests}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for report in engine.step():
            for out in report.outputs:
                tokens[report.request_id].setdefault(out.index, []).extend(out.token_ids)
    assert not engine.has_unfinished_requests()
    return {r: [by_index[i] for i in sorted(by_index)] for r, by_index in tokens.items()}


def test_each_constraint_holds_and_leaves_its_batch_alone(llama_dir):
    engine = LLMEngine.from_kwargs(model=str(llama_dir), device="cpu", attention_backend="torch",
                                   block_size=8, num_gpu_blocks_override=64,
                                   num_cpu_blocks_override=8, num_threads=1)
    reference, = run(engine, {"alone": GREEDY})["alone"]
    absent = next(t for t in range(3, 256) if t not in reference)
    allowed = sorted({absent, reference[-1]})
    first_two = reference[:2]
    out = run(engine, {
        "plain": GREEDY,
        "biased": dataclasses.replace(GREEDY, logit_bias={absent: 100.0}),
        "allowed": dataclasses.replace(GREEDY, allowed_token_ids=allowed),
        "bad": dataclasses.replace(GREEDY, bad_words_token_ids=[first_two]),
        "copies": dataclasses.replace(GREEDY, n=3),
    })
    assert out["plain"] == [reference]
    assert out["biased"] == [[absent] * GREEDY.max_tokens]
    assert set(out["allowed"][0]) <= set(allowed)
    bad, = out["bad"]
    assert bad[0] == reference[0] and bad[1] != reference[1]  # the word's last token, banned
    assert all(bad[i:i + 2] != first_two for i in range(len(bad) - 1))
    assert out["copies"] == [reference] * 3


def test_the_offline_llm_tokenizes_bad_words_and_truncates_prompts(tmp_path):
    """LLM(...).generate with SamplingParams' text fields, as the gateway applies them."""
    tiny_models.make_served_model(tmp_path)
    with LLM(str(tmp_path), device="cpu", attention_backend="torch", block_size=8,
             num_gpu_blocks_override=64, num_cpu_blocks_override=8, num_threads=1) as llm:
        prompt = "the quick brown fox jumps"
        greedy = dataclasses.replace(GREEDY, max_tokens=6)
        plain, = llm.generate(prompt, greedy, use_tqdm=False)
        cut, = llm.generate(prompt, dataclasses.replace(greedy, truncate_prompt_tokens=2),
                            use_tqdm=False)
        assert cut.prompt_token_ids == plain.prompt_token_ids[-2:]
        word = llm.tokenizer.decode(plain.outputs[0].token_ids[:1])
        banned, = llm.generate(prompt, dataclasses.replace(greedy, bad_words=[word]),
                               use_tqdm=False)
        assert banned.outputs[0].token_ids[0] != plain.outputs[0].token_ids[0]
        assert word not in banned.outputs[0].text
