"""Structured outputs: validity on varied JSON schemas, and the cost of constraining.

1. Validity: --num-schemas JSON schemas (at least 50) of varied shape -- nested objects, arrays,
   enums, numbers with bounds, string patterns, optional fields -- each asked greedily and
   sampled (seeded), through the offline LLM and, with --doors, through a `pagedserve serve`
   (the OpenAI HTTP door and the gRPC door). Every output must parse and validate with
   `jsonschema`; a failure is named in the record.
2. Throughput: a batch of --batch-size requests constrained by the schemas against the same
   batch unconstrained, offline, with the same output lengths (the constrained run's lengths,
   reproduced with ignore_eos), so the ratio is the cost of the masks alone: --pairs runs of
   each, alternated with the order swapped every pair; the median pair's ratio is read.
3. With --device sim (bench/structured_sim.py): the grammar mask's share of a step at batch
   --sim-batch-size on the simulated --sim-gpu (a model: the forward is simulated, the masks are
   llguidance's real work on this host): its whole compute, and the part of it longer than the
   forward it overlaps, which the target of 10% is on.
Record: bench/results/structured-<tag>.json.

    python -m bench.structured                      # 56 schemas, offline, batch 32
    python -m bench.structured --doors --tag doors  # both doors as well
    python -m bench.structured --device sim --tag sim  # batch 256 on a simulated H100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import socket
import statistics
from pathlib import Path

import grpc
import httpx
import jsonschema
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from bench.common import DEFAULT_MODEL, Timer, finish, quiet_logging, serve_process
from bench.serving import wait_serving
from bench.structured_sim import TARGET_MASK_SHARE, mask_share
from pagedserve.llm import LLM

log = logging.getLogger("bench.structured")

TARGET_THROUGHPUT_RATIO = 0.9
_WORDS = ["name", "city", "color", "title", "tag", "label", "code", "kind", "owner", "status"]


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "pattern", "enum", "integer", "number", "boolean"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 16, 24])}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(
            [r"^[A-Z][a-z]{1,8}$", r"^\d{3}-\d{4}$", r"^[a-z]{1,8}@[a-z]{1,8}\.com$", r"^#[0-9a-f]{6}$"])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"], 3)}
    if kind == "integer":
        low = rng.choice([0, 1, 10, -5])
        return {"type": "integer", "minimum": low, "maximum": low + rng.choice([9, 100, 1000])}
    if kind == "number":
        # without multipleOf a number's fraction has no end, and a small model may not stop
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100]),
                "multipleOf": 0.25}
    return {"type": "boolean"}


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(_WORDS, rng.randint(1, 4))
    properties = {}
    for name in names:
        shape = rng.random()
        if depth > 0 and shape < 0.2:
            properties[name] = _object(rng, depth - 1)
        elif shape < 0.4:
            properties[name] = {"type": "array", "items": _leaf(rng), "minItems": 1,
                                "maxItems": rng.choice([2, 3])}
        else:
            properties[name] = _leaf(rng)
    required = [n for n in names if rng.random() < 0.7] or names[:1]  # the rest optional
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def make_schemas(num_schemas: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [_object(rng, depth=i % 3) for i in range(num_schemas)]


def prompt_of(schema: dict) -> list[dict]:
    return [{"role": "user", "content": "Answer with a JSON object with the fields "
             f"{', '.join(schema['properties'])}."}]


def _sampling(schema: dict | None, greedy: bool, seed: int, max_tokens: int,
              ignore_eos: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0.0 if greedy else 1.0, seed=None if greedy else seed,
                          max_tokens=max_tokens, ignore_eos=ignore_eos,
                          structured_outputs=None if schema is None
                          else StructuredOutputsParams(json_schema=schema))


def check(outputs: list[tuple[str, str]], schemas: list[dict], door: str) -> dict:
    """outputs[i] = (text, finish_reason) for schemas[i]."""
    failures = []
    for i, ((text, finish_reason), schema) in enumerate(zip(outputs, schemas, strict=True)):
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            failures.append({"schema": i, "finish_reason": finish_reason, "text": text[:200],
                             "error": str(e)[:200]})
    log.info("%s: %d/%d valid; failures' finish reasons: %s", door,
             len(outputs) - len(failures), len(outputs), [f["finish_reason"] for f in failures])
    return {"door": door, "num_outputs": len(outputs), "num_valid": len(outputs) - len(failures),
            "failures": failures}


def offline_validity(llm: LLM, schemas: list[dict], max_tokens: int) -> list[dict]:
    results = []
    for greedy in (True, False):
        params = [_sampling(s, greedy, i, max_tokens) for i, s in enumerate(schemas)]
        outs = llm.chat([prompt_of(s) for s in schemas], params, use_tqdm=False)
        results.append(check([(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs],
                             schemas, f"offline-{'greedy' if greedy else 'sampled'}"))
    return results


def throughput(llm: LLM, schemas: list[dict], batch_size: int, max_tokens: int,
               num_pairs: int) -> dict:
    """num_pairs runs of each batch, alternated and the order swapped every pair (C F, F C,
    ...), so a drift in the host's speed falls on both; the ratio is the median pair's."""
    batch = [schemas[i % len(schemas)] for i in range(batch_size)]
    prompts = [prompt_of(s) for s in batch]
    constrained = [_sampling(s, False, i, max_tokens) for i, s in enumerate(batch)]
    llm.chat(prompts[:2], constrained[:2], use_tqdm=False)  # warm-up: compiles, tokenizer
    outs = llm.chat(prompts, constrained, use_tqdm=False)
    lens = [len(o.outputs[0].token_ids) for o in outs]
    free = [_sampling(None, False, i, n, ignore_eos=True) for i, n in enumerate(lens)]
    num_tokens = sum(lens)
    pairs = []
    for pair in range(num_pairs):
        elapsed = {}
        for kind in (("constrained", "unconstrained") if pair % 2 == 0
                     else ("unconstrained", "constrained")):
            with Timer() as timer:
                outs = llm.chat(prompts, constrained if kind == "constrained" else free,
                                use_tqdm=False)
            assert sum(len(o.outputs[0].token_ids) for o in outs) == num_tokens, \
                "a seeded run's output lengths changed between runs"
            elapsed[kind] = timer.elapsed_s
        pairs.append({**elapsed, "ratio": elapsed["unconstrained"] / elapsed["constrained"],
                      "load_average": os.getloadavg()[0]})
    ratios = [p["ratio"] for p in pairs]
    ratio = statistics.median(ratios)
    constrained_s = statistics.median(p["constrained"] for p in pairs)
    unconstrained_s = statistics.median(p["unconstrained"] for p in pairs)
    return {"batch_size": batch_size, "num_output_tokens": num_tokens, "pairs": pairs,
            "constrained_s": constrained_s, "unconstrained_s": unconstrained_s,
            "constrained_tok_s": num_tokens / constrained_s,
            "unconstrained_tok_s": num_tokens / unconstrained_s,
            "throughput_ratio": ratio, "ratio_min": min(ratios), "ratio_max": max(ratios),
            "target": {"target": TARGET_THROUGHPUT_RATIO, "met": ratio >= TARGET_THROUGHPUT_RATIO}}


async def _http_outputs(url: str, schemas: list[dict], greedy: bool, max_tokens: int
                        ) -> list[tuple[str, str]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def one(i: int, schema: dict) -> tuple[str, str]:
            body = {"messages": prompt_of(schema), "max_tokens": max_tokens,
                    "temperature": 0.0 if greedy else 1.0, "seed": None if greedy else i,
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": f"s{i}", "schema": schema, "strict": True}}}
            response = (await http.post("/v1/chat/completions", json=body)).json()
            choice = response["choices"][0]
            return choice["message"]["content"], choice["finish_reason"]

        return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas))))


def _grpc_outputs(address: str, schemas: list[dict], greedy: bool, max_tokens: int
                  ) -> list[tuple[str, str]]:
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        futures = []
        for i, schema in enumerate(schemas):
            sampling = common_pb2.SamplingParams(
                temperature=0.0 if greedy else 1.0, max_tokens=max_tokens,
                structured_outputs=common_pb2.StructuredOutputs(json_schema=json.dumps(schema)))
            if not greedy:
                sampling.seed = i
            messages = common_pb2.ChatMessages(messages=[
                common_pb2.ChatMessage(**m) for m in prompt_of(schema)])
            futures.append(stub.Generate.future(gateway_pb2.GenerateRequest(
                messages=messages, sampling=sampling), timeout=600))
        return [(f.result().outputs[0].text,
                 common_pb2.FinishReason.Name(f.result().outputs[0].finish_reason))
                for f in futures]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def doors_validity(args: argparse.Namespace, schemas: list[dict]) -> list[dict]:
    port, http_port = _free_port(), _free_port()
    flags = ["--model", args.model, "--port", str(port), "--http-port", str(http_port),
             "--device", "cpu", "--log-level", "WARNING"]
    results = []
    with serve_process(flags, Path.cwd()) as stack:
        address = f"127.0.0.1:{port}"
        wait_serving(address, stack, args.startup_timeout_s)
        for greedy in (True, False):
            mode = "greedy" if greedy else "sampled"
            results.append(check(asyncio.run(_http_outputs(
                f"http://127.0.0.1:{http_port}", schemas, greedy, args.max_tokens)),
                schemas, f"openai-{mode}"))
            results.append(check(_grpc_outputs(address, schemas, greedy, args.max_tokens),
                                 schemas, f"grpc-{mode}"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--num-schemas", type=int, default=56)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--throughput-max-tokens", type=int, default=48)
    parser.add_argument("--pairs", type=int, default=8,
                        help="alternated constrained/unconstrained runs; the median is read")
    parser.add_argument("--doors", action="store_true", help="also through a served stack")
    parser.add_argument("--no-validity", action="store_true",
                        help="the throughput alone (before/after runs in one window)")
    parser.add_argument("--startup-timeout-s", type=float, default=300)
    parser.add_argument("--device", choices=("cpu", "sim"), default="cpu",
                        help="sim: the mask's share of a step on the simulated GPU alone")
    parser.add_argument("--sim-gpu", default="H100-SXM")
    parser.add_argument("--sim-model", default="Llama-3-8B")
    parser.add_argument("--sim-batch-size", type=int, default=256)
    parser.add_argument("--sim-max-tokens", type=int, default=64)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    quiet_logging()
    schemas = make_schemas(args.num_schemas)
    if args.device == "sim":
        sim = mask_share(args, schemas, lambda schema, i, max_tokens, ignore_eos: _sampling(
            schema, False, i, max_tokens, ignore_eos))
        line = (f"structured (model: {args.sim_model} on a simulated {args.sim_gpu}): batch "
                f"{args.sim_batch_size}, mask {sim['mask_ms_median']:.2f} ms of a "
                f"{sim['step_ms_median']:.2f} ms step = {sim['mask_share_of_step']:.1%}, "
                f"exposed beyond the forward {sim['mask_exposed_ms_median']:.2f} ms = "
                f"{sim['mask_exposed_share_of_step']:.1%} (target <= {TARGET_MASK_SHARE:.0%}"
                f"{'' if sim['target']['met'] else ' MISSED'}); "
                f"throughput {sim['throughput_ratio']:.2f}x unconstrained")
        finish("structured", args, line, [], sim=sim, schemas=schemas)
        return
    llm = LLM(model=args.model, device="cpu")
    validity = [] if args.no_validity else offline_validity(llm, schemas, args.max_tokens)
    speed = throughput(llm, schemas, args.batch_size, args.throughput_max_tokens,
                       args.pairs)
    del llm
    if args.doors:
        validity += doors_validity(args, schemas)
    num_outputs = sum(r["num_outputs"] for r in validity)
    num_valid = sum(r["num_valid"] for r in validity)
    checked = (f"{num_valid}/{num_outputs} outputs valid on {len(schemas)} schemas "
               f"({', '.join(r['door'] for r in validity)}); " if validity else "")
    line = (f"structured: {checked}batch {args.batch_size} constrained "
            f"{speed['constrained_tok_s']:.1f} tok/s = {speed['throughput_ratio']:.2f}x "
            f"unconstrained, median of {args.pairs} alternated pairs "
            f"({speed['ratio_min']:.2f}-{speed['ratio_max']:.2f}x; target {TARGET_THROUGHPUT_RATIO}x"
            f"{'' if speed['target']['met'] else ' MISSED'})")
    finish("structured", args, line, validity, throughput=speed, schemas=schemas)


if __name__ == "__main__":
    main()
