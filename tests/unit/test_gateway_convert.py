import pytest
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.outputs import TokenLogprob, Usage
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import WorkerInfo
from pagedserve.services.gateway.convert import (
    generate_request_from_proto,
    generate_request_to_proto,
    generate_response_to_proto,
    proto_field_path,
    served_model_from_info_proto,
    served_model_from_proto,
    served_model_to_info_proto,
    text_delta_from_proto,
    text_delta_to_proto,
    tokenize_request_from_proto,
)
from pagedserve.services.gateway.validation import (
    ChatMessage,
    ChatOptions,
    GenerateInput,
    ServedModel,
)
from pagedserve.services.rpc.convert_scheduler import served_model_to_proto
from pagedserve.services.rpc.internal.v1 import scheduler_pb2
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2
from pagedserve.services.text.text_stream import TextDelta

SAMPLING = SamplingParams(n=2, temperature=0.7, top_k=5, stop=("\n",), stop_token_ids=(7,),
                          max_tokens=9, logprobs=3, seed=11)


@pytest.mark.parametrize("request_input", [
    GenerateInput(request_id="a", text="hello", sampling=SAMPLING, priority=3),
    GenerateInput(token_ids=(1, 2, 3)),
    GenerateInput(request_id="c", messages=(ChatMessage("system", "be brief"),
                                            ChatMessage("user", "hi"))),
    GenerateInput(token_ids=()),  # empty but set: validation rejects it by name later
    GenerateInput(messages=(
        ChatMessage("developer", "use tools"), ChatMessage("user", "weather in Oslo?"),
        ChatMessage("assistant", "", tool_calls=({
            "id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": {"city": "Oslo"}}},)),
        ChatMessage("tool", "4 C", tool_call_id="call_1", name="weather")),
        chat=ChatOptions(add_generation_prompt=False, continue_final_message=True,
                         template_kwargs={"enable_thinking": False})),
])
def test_generate_request_round_trip(request_input):
    assert generate_request_from_proto(generate_request_to_proto(request_input)) == request_input


def test_unset_sampling_takes_vllm_defaults():
    converted = generate_request_from_proto(gateway_pb2.GenerateRequest(text="x"))
    assert converted.sampling == SamplingParams()


def test_bad_sampling_names_field_and_value():
    msg = gateway_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(top_p=1.5))
    with pytest.raises(InvalidRequest, match=r"top_p .* got 1.5"):
        generate_request_from_proto(msg)


@pytest.mark.parametrize(("message", "field"), [
    (common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(
        role="assistant", tool_calls=[common_pb2.ChatToolCall(name="f", arguments="{oops")])]),
     "messages.messages[0].tool_calls[0].arguments"),
    (common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="q")],
                             chat_template_kwargs="[1]"),
     "messages.chat_template_kwargs"),
])
def test_bad_chat_fields_name_their_proto_field(message, field):
    with pytest.raises(InvalidRequest) as caught:
        generate_request_from_proto(gateway_pb2.GenerateRequest(messages=message))
    assert [proto_field_path(v.field) for v in caught.value.violations] == [field]


def test_text_delta_round_trip():
    lp = TokenLogprob(5, -0.25, " the")
    delta = TextDelta(index=1, text=" the", token_ids=[5], logprobs=[lp],
                      top_logprobs=[[lp, TokenLogprob(6, -2.0, " a")]], finish_reason="length",
                      usage=Usage(prompt_tokens=4, completion_tokens=9, cached_tokens=2),
                      prompt_logprobs=[[TokenLogprob(3, -1.0, "x")], []])
    msg = text_delta_to_proto(delta, "req")
    assert msg.request_id == "req"
    assert text_delta_from_proto(msg) == delta


def test_running_delta_has_no_usage_or_finish():
    msg = text_delta_to_proto(TextDelta(index=0, text="a", token_ids=[1]), "r")
    assert not msg.HasField("usage")
    assert msg.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert text_delta_from_proto(msg) == TextDelta(index=0, text="a", token_ids=[1])


def test_generate_response_folds_deltas_per_index():
    deltas = [TextDelta(0, "he", [1], cumulative_logprob=-1.0),
              TextDelta(1, "yo", [4], cumulative_logprob=-0.5),
              TextDelta(0, "llo", [2], finish_reason="stop", cumulative_logprob=-1.5),
              TextDelta(1, "", [], finish_reason="length", cumulative_logprob=-0.5,
                        usage=Usage(3, 3, 0))]
    msg = generate_response_to_proto("r", deltas, n=2)
    assert [(o.index, o.text, list(o.token_ids)) for o in msg.outputs] == [
        (0, "hello", [1, 2]), (1, "yo", [4])]
    assert msg.outputs[0].finish_reason == common_pb2.FINISH_REASON_STOP
    assert msg.outputs[0].cumulative_logprob == -1.5
    assert (msg.usage.prompt_tokens, msg.usage.completion_tokens) == (3, 3)


def test_served_model_round_trips_through_model_info_and_comes_from_the_scheduler():
    info = ServedModel("SmolLM2-135M-Instruct", "LlamaForCausalLM", 8192, 49152, (2,), True)
    assert served_model_from_info_proto(served_model_to_info_proto(info)) == info
    served = scheduler_pb2.GetServedModelResponse(model="/models/SmolLM2-135M-Instruct/",
                                       architecture="LlamaForCausalLM", max_model_len=8192,
                                       vocab_size=49152, eos_token_ids=[2])
    assert served_model_from_proto(served, has_chat_template=True) == info


def test_served_model_carries_the_replicas_capacity_to_the_gateway():
    worker = WorkerInfo(rank=0, device="cpu", dtype="float32", architecture="LlamaForCausalLM",
                        vocab_size=49152, max_model_len=8192, eos_token_ids=[2], num_layers=30,
                        num_kv_heads=3, head_size=64, attention_backend="torch")
    served = scheduler_pb2.GetServedModelResponse.FromString(served_model_to_proto(
        "/models/m", worker, 4096, 49152, [2], block_size=16, num_gpu_blocks=1000,
        max_num_seqs=256).SerializeToString())
    info = served_model_from_proto(served, has_chat_template=False)
    assert (info.max_model_len, info.block_size, info.num_gpu_blocks, info.max_num_seqs) == (
        4096, 16, 1000, 256)
    # the public ServedModel keeps the deployment's capacity inside
    assert served_model_from_info_proto(served_model_to_info_proto(info)).num_gpu_blocks == 0


def test_tokenize_request():
    assert tokenize_request_from_proto(gateway_pb2.TokenizeRequest(text="hi")).text == "hi"
    messages = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="q")])
    converted = tokenize_request_from_proto(gateway_pb2.TokenizeRequest(messages=messages))
    assert converted.messages == (ChatMessage("user", "q"),)
    with pytest.raises(InvalidRequest, match="prompt must be set"):
        tokenize_request_from_proto(gateway_pb2.TokenizeRequest())


def test_a_stream_request_has_every_field_of_a_unary_one():
    """generate_request_from_proto reads both; the contract promises the same fields, numbers."""
    def fields(message_type):
        return [(f.name, f.number, f.type, f.containing_oneof and f.containing_oneof.name)
                for f in message_type.DESCRIPTOR.fields]
    assert fields(gateway_pb2.GenerateRequest) == fields(gateway_pb2.GenerateStreamRequest)
