"""Structured outputs on the simulated GPU (`bench.structured --device sim`): the share of a
step that the grammar mask takes at a large batch. A model, not a measurement of a GPU: the
forward is the simulated time of --sim-model on --sim-gpu, and the masks are the real
llguidance work for the batch on this host's CPUs (the served folder's tokenizer), timed as it
runs beside the modelled step. Twice the batch is asked, so that finished requests are replaced
and the running batch stays full; the steps that sample at least 90% of it are measured.

A step's mask is built once the step before has finished, mostly ahead on a thread of its own
(worker_svc/grammar_matchers.py), while the step's launch and its forward run, so only the part
of the sampler's wait for it longer than the forward's remaining time delays the step: the
exposed mask. The target is on that share of the step; the share of the whole wait (the rows
built ahead not done yet, and those built in place) is recorded beside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import jsonschema

from bench.common import Timer
from pagedserve.llm import LLM

TARGET_MASK_SHARE = 0.10


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else 0.0


def mask_share(args: argparse.Namespace, schemas: list[dict], sampling_of) -> dict:
    """sampling_of(schema | None, index, max_tokens, ignore_eos) → SamplingParams."""
    from bench.structured import prompt_of

    llm = LLM(model=args.model, device="sim", sim_gpu=args.sim_gpu, sim_model=args.sim_model,
              dtype="bfloat16", max_num_seqs=args.sim_batch_size, seed=0)
    try:
        worker = llm.engine._local_workers[0]
        grammars, timeline = worker.runner.grammars, worker.timeline
        batch = [schemas[i % len(schemas)] for i in range(2 * args.sim_batch_size)]
        prompts = [prompt_of(s) for s in batch]
        constrained = [sampling_of(s, i, args.sim_max_tokens, False) for i, s in enumerate(batch)]
        llm.chat(prompts[:len(schemas)], constrained[:len(schemas)], use_tqdm=False)  # compiles
        masks: list[tuple[float, float, float, int]] = []  # (end, mask s, exposed s, rows)
        bitmask = grammars.bitmask

        def timed_bitmask(sample_seqs, *rest):
            start = time.perf_counter()
            forward_left_s = timeline.seconds_queued()  # the masked step's forward
            mask = bitmask(sample_seqs, *rest)
            end = time.perf_counter()
            masks.append((end, end - start, max(0.0, end - start - forward_left_s),
                          0 if mask is None else len(mask.rows)))
            return mask

        grammars.bitmask = timed_bitmask
        busy_before = timeline.stats().busy_s
        with Timer() as t_constrained:
            outs = llm.chat(prompts, constrained, use_tqdm=False)
        device_s = timeline.stats().busy_s - busy_before
        grammars.bitmask = bitmask
        lens = [len(o.outputs[0].token_ids) for o in outs]
        free = [sampling_of(None, i, n, True) for i, n in enumerate(lens)]
        with Timer() as t_free:
            llm.chat(prompts, free, use_tqdm=False)
    finally:
        llm.close()
    full = [m for m in masks if m[3] >= 0.9 * args.sim_batch_size]
    periods = [b[0] - a[0] for a, b in itertools.pairwise(full)]
    mask_s = [m[1] for m in full[1:]]
    exposed_s = [m[2] for m in full[1:]]
    step_s = statistics.median(periods) if periods else None
    share = statistics.median(mask_s) / step_s if periods else None
    exposed_share = statistics.median(exposed_s) / step_s if periods else None
    num_tokens = sum(lens)
    finished = [(o.outputs[0].text, s) for o, s in zip(outs, batch, strict=True)
                if o.outputs[0].finish_reason == "stop"]
    num_valid = 0
    for text, schema in finished:
        try:
            jsonschema.validate(json.loads(text), schema)
            num_valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return {
        "model": True,  # simulated forward, real masks on this host
        "sim_gpu": args.sim_gpu, "sim_model": args.sim_model,
        "batch_size": args.sim_batch_size, "num_requests": len(batch),
        "num_output_tokens": num_tokens,
        "num_steps_measured": len(mask_s),
        "mean_rows_measured": statistics.mean(m[3] for m in full) if full else 0,
        "mask_ms_median": _median_ms(mask_s), "step_ms_median": _median_ms(periods),
        "mask_exposed_ms_median": _median_ms(exposed_s),
        "modelled_device_ms_per_step": device_s / max(len(masks), 1) * 1e3,
        "mask_share_of_step": share,
        "mask_exposed_share_of_step": exposed_share,
        "constrained_tok_s": num_tokens / t_constrained.elapsed_s,
        "unconstrained_tok_s": num_tokens / t_free.elapsed_s,
        "throughput_ratio": t_free.elapsed_s / t_constrained.elapsed_s,
        "num_stopped": len(finished), "num_stopped_valid": num_valid,
        "target": {"mask_share": TARGET_MASK_SHARE,
                   "met": exposed_share is not None and exposed_share <= TARGET_MASK_SHARE,
                   "compute_met": share is not None and share <= TARGET_MASK_SHARE},
    }
