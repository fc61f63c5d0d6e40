"""Constrained generation is token-exact across preemption (swap and recompute): the worker's
matchers follow the output tokens a resent sequence arrives with. The default model, offline,
with a KV cache too small for the batch, so sequences are preempted and resumed."""

import json

import jsonschema
import pytest
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.structured_outputs import StructuredOutputsParams

from pagedserve.llm import LLM

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "population": {"type": "integer", "minimum": 0},
    "rivers": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["city", "population", "rivers"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_preempted_constrained_outputs_equal_the_outputs_run_alone(smollm2_dir, preemption_mode):
    llm = LLM(model=str(smollm2_dir), device="cpu", num_gpu_blocks_override=9,
              num_cpu_blocks_override=64, preemption_mode=preemption_mode)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=64,
                             structured_outputs=StructuredOutputsParams(json_schema=SCHEMA))
              for seed in range(4)]
    alone = [llm.chat(ASK, p, use_tqdm=False)[0].outputs[0].token_ids for p in params]
    before = llm.engine.core.scheduler.num_preemptions
    together = llm.chat([ASK] * 4, params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > before
    assert [o.outputs[0].token_ids for o in together] == alone
    for output in together:
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)
