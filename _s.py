import time, json, grpc
from pathlib import Path
from tests.e2e.stack import start_stack, tiny_config
from tests.e2e.test_structured_outputs import PERSON, ASK
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
M=Path("/root/.cache/pagedserve/models/SmolLM2-135M-Instruct")
with start_stack(tiny_config(M, kv_cache_memory_gib=0.1, swap_space_gib=0.05)) as stack:
    with grpc.insecure_channel(stack.gateway_address) as ch:
        g = gateway_pb2_grpc.GenerationServiceStub(ch)
        for so in [None, common_pb2.StructuredOutputs(json_schema=json.dumps(PERSON)), common_pb2.StructuredOutputs(json_schema=json.dumps(PERSON))]:
            t=time.time()
            r = g.Generate(gateway_pb2.GenerateRequest(messages=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(**ASK[0])]),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=so)))
            print(time.time()-t, r.outputs[0].text[:100], len(r.outputs[0].token_ids), flush=True)
