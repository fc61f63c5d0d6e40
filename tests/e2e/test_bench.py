"""The CPU benchmark scripts run end to end at smoke sizes on a tiny model and write their records
(numbers from a tiny model are meaningless; only the plumbing is checked here)."""

from __future__ import annotations

import json

import pytest

import bench.common
from bench import (
    control_plane,
    gateway_cpu,
    gc_pauses,
    hostile_clients,
    offline,
    routing,
    serving,
    sse_serialization,
    step_anatomy,
    worker_replay,
)


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    return tmp_path


def _record(results_dir, name: str) -> dict:
    record = json.loads((results_dir / f"{name}-smoke.json").read_text())
    assert record["machine"]["cpu_count"] >= 1
    return record


def test_offline(tiny_served_model_dir, results_dir):
    offline.main(["--model", str(tiny_served_model_dir), "--num-prompts", "3", "--batch-size", "2",
                  "--min-prompt-len", "4", "--max-prompt-len", "12", "--min-output-len", "2",
                  "--max-output-len", "6", "--uniform-prompt-len", "8", "--uniform-output-len",
                  "4", "--kv-cache-memory-gib", "0.01", "--repeats", "1", "--tag", "smoke"])
    mixed, uniform = _record(results_dir, "offline")["results"]
    assert mixed["workload"] == "mixed" and uniform["workload"] == "uniform"
    assert mixed["pagedserve_tok_s"] > 0 and mixed["ratio_vs_hf_sequential"] > 0
    assert mixed["greedy_agreement_with_hf"]["num_outputs"] == 3
    assert set(uniform["targets"]) == {"ratio_vs_hf_padded"}


def test_offline_long(tiny_served_model_dir, results_dir):
    offline.main(["--model", str(tiny_served_model_dir), "--workloads", "long", "--num-prompts",
                  "3", "--long-batch-size", "2", "--long-min-prompt-len", "20",
                  "--long-max-prompt-len", "40", "--long-min-output-len", "2",
                  "--long-max-output-len", "8", "--kv-cache-memory-gib", "0.01", "--repeats", "1",
                  "--tag", "smoke"])
    (long,) = _record(results_dir, "offline")["results"]
    assert long["workload"] == "long" and long["batch_size"] == 2
    assert 20 <= long["prompt_lens"][0] <= long["prompt_lens"][1] <= 40
    assert set(long["targets"]) == {"ratio_vs_hf_sequential", "ratio_vs_hf_padded"}
    assert long["greedy_agreement_with_hf"]["num_outputs"] == 3


def test_step_anatomy(tiny_served_model_dir, results_dir):
    step_anatomy.main(["--model", str(tiny_served_model_dir), "--batch-sizes", "1", "3",
                       "--prompt-len", "8", "--output-len", "6", "--skip-steps", "1",
                       "--repeats", "2", "--modes", "in_process", "in_process_metrics", "grpc",
                       "--tag", "smoke"])
    results = _record(results_dir, "step_anatomy")["results"]
    assert [(r["mode"], r["batch_size"]) for r in results] == [
        ("in_process", 1), ("in_process", 3), ("in_process_metrics", 1),
        ("in_process_metrics", 3), ("grpc", 1), ("grpc", 3)]
    for r in results:
        assert r["num_steps"] >= 1 and len(r["period_ms_per_repeat"]) == 2
        assert r["median_ms"]["period"] == min(r["period_ms_per_repeat"])
        assert r["median_ms"]["forward"] > 0 and r["median_ms"]["cpu"] > 0
        assert 0 < r["median_ms"]["schedule_cpu"] <= r["median_ms"]["cpu"]


def test_serving(tiny_served_model_dir, results_dir):
    serving.main(["--model", str(tiny_served_model_dir), "--concurrency", "1", "2",
                  "--requests-per-client", "1", "--min-requests", "2", "--min-prompt-len", "4",
                  "--max-prompt-len", "12", "--min-output-len", "2", "--max-output-len", "6",
                  "--kv-cache-memory-gib", "0.01", "--settle-s", "0.05", "--api", "openai",
                  "--tag", "smoke"])
    results = _record(results_dir, "serving")["results"]
    assert [r["concurrency"] for r in results] == [1, 2]
    for r in results:
        assert r["stack"]["num_output_tokens"] == r["in_process"]["num_output_tokens"] > 0
        assert r["openai"]["num_output_tokens"] == r["stack"]["num_output_tokens"]
        assert r["ratio_vs_in_process"] > 0 and r["openai_vs_grpc"]["throughput_ratio"] > 0


def test_serving_on_the_simulated_worker_records_each_process_cpu(tiny_served_model_dir,
                                                                   results_dir):
    serving.main(["--model", str(tiny_served_model_dir), "--device", "sim", "--concurrency", "2",
                  "--requests-per-client", "1", "--min-requests", "2", "--min-prompt-len", "4",
                  "--max-prompt-len", "12", "--min-output-len", "2", "--max-output-len", "6",
                  "--settle-s", "0.05", "--api", "openai", "--tag", "smoke"])
    record = _record(results_dir, "serving")
    assert "simulated SmolLM2-1.7B on H100-SXM" in record["model"]
    (result,) = record["results"]
    for door in ("stack", "openai"):
        assert set(result[door]["cpu_s"]) == {"gateway", "scheduler", "worker", "clients"}
        (client,) = result[door]["client_processes"]
        assert client["num_streams"] == 2 and client["num_requests"] == 2
        assert result[door]["cpu_s"]["clients"] == client["cpu_s"] > 0
        assert result[door]["num_output_tokens"] == result["in_process"]["num_output_tokens"]


@pytest.mark.parametrize("mode", [[], ["--launch-ahead"]])
def test_worker_replay_replays_every_captured_step(tiny_served_model_dir, results_dir, tmp_path,
                                                   mode):
    sizes = ["--model", str(tiny_served_model_dir), "--concurrency", "3",
             "--requests-per-client", "2", "--min-prompt-len", "4", "--max-prompt-len", "12",
             "--min-output-len", "2", "--max-output-len", "6"]
    steps = tmp_path / "steps.bin"
    worker_replay.main([*sizes, "--capture", str(steps)])
    worker_replay.main([*sizes, "--steps", str(steps), "--repeats", "2", *mode, "--tag", "smoke"])
    (result,) = _record(results_dir, "worker_replay")["results"]
    assert result["num_steps"] >= 6 and len(result["cpu_us_per_step"]) == 2
    assert all(us > 0 for us in result["cpu_us_per_step"])


def test_gateway_cpu_runs_two_gateways_on_one_port_against_one(tiny_served_model_dir,
                                                               results_dir):
    # long enough that each run's gateway CPU spans several of /proc's 10 ms ticks (24 tokens
    # of 6-token requests once read 0 s and the tokens per CPU-second divided by it)
    gateway_cpu.main(["--model", str(tiny_served_model_dir), "--concurrency", "4",
                      "--requests-per-stream", "1", "--prompt-len", "4", "--output-len", "64",
                      "--step-ms", "5", "--gateways", "1", "2", "--grpc-channels", "2",
                      "--settle-s", "0", "--tag", "smoke"])
    record = _record(results_dir, "gateway_cpu")
    runs = record["results"]
    assert [(r["door"], r["num_gateways"]) for r in runs] == [
        ("grpc", 1), ("openai", 1), ("grpc", 2), ("openai", 2)]
    assert all(r["num_output_tokens"] == 4 * 64 for r in runs)
    assert all(len(r["each_gateway_cpu_s"]) == r["num_gateways"] for r in runs)
    assert set(record["medians"]) == {"this/grpc/1gw", "this/grpc/2gw", "this/openai/1gw",
                                      "this/openai/2gw"}
    assert record["medians"]["this/grpc/2gw"]["scaling"] > 0


def test_gc_pauses_alternates_both_arms_and_counts_collections(tiny_served_model_dir,
                                                              results_dir):
    gc_pauses.main(["--model", str(tiny_served_model_dir), "--concurrency", "3",
                    "--num-prompts", "4", "--min-prompt-len", "4", "--max-prompt-len", "12",
                    "--min-output-len", "2", "--max-output-len", "6", "--repeats", "2",
                    "--tag", "smoke"])
    runs = _record(results_dir, "gc_pauses")["results"]
    assert [r["arm"] for r in runs] == ["raised", "defaults", "defaults", "raised"]
    assert all(r["output_tokens"] >= 4 * 2 and r["output_tok_s"] > 0 for r in runs)
    assert all(set(r["collections"]) == {"gen0", "gen1", "gen2"} for r in runs)


def test_sse_serialization(results_dir):
    sse_serialization.main(["--num-events", "50", "--repeats", "1", "--tag", "smoke"])
    results = _record(results_dir, "sse_serialization")["results"]
    assert [r["chunk"] for r in results] == ["completion", "chat"]
    assert all(r["pydantic_us"] > 0 and r["template_us"] > 0 for r in results)


def test_control_plane(tiny_served_model_dir, results_dir):
    control_plane.main(["--model", str(tiny_served_model_dir), "--quick", "--tag", "smoke"])
    record = _record(results_dir, "control_plane")
    streams, capacity = record["results"]["streams"], record["results"]["capacity"]
    assert [r["concurrency"] for r in streams] == [4, 16]
    for r in streams:
        assert r["num_requests"] >= 4 and r["num_output_tokens"] > 0
        assert 0 < r["busy_fraction"] <= 1.0 and r["simulated_gpu_s"] > 0
        assert set(r["cpu_us_per_token"]) == {"worker", "scheduler", "gateway", "clients"}
        assert 0 < r["num_client_messages"] <= r["num_output_tokens"]
    assert capacity["simulated_gpu_s"] == 0 and capacity["output_tok_s"] > 0
    # launches and unfused kernels keep the simulated GPU below its roofline
    assert 0 < record["simulated_decode_tok_s_at_256"] < record["roofline_decode_tok_s_at_256"]
    scheduler = record["results"]["scheduler"]
    assert [(r["batch_size"], r["prompt_len"]) for r in scheduler] == [(8, 16), (32, 16),
                                                                       (32, 128)]
    assert all(r["num_steps"] >= 3 and r["per_step_ms"] > 0 for r in scheduler)
    assert all(r["per_step_ms"] >= r["response_from_proto_ms"] > 0 for r in scheduler)
    assert set(record["targets"]) == {"busy_fraction", "gateway_tok_per_cpu_s"}


def test_hostile_clients(tiny_served_model_dir, results_dir):
    hostile_clients.main(["--model", str(tiny_served_model_dir), "--quick",
                          "--stalled-stream-timeout-s", "1", "--tag", "smoke"])
    results = _record(results_dir, "hostile_clients")["results"]
    assert results["alone_tok_s"] > 0 and len(results["alone_runs"]) == 2
    stalled, hostile = results["beside_stalled"], results["beside_hostile"]
    ends = stalled["stalled_stream_ends"]  # one read soon after the client's run may finish OK
    assert set(ends) <= {"RESOURCE_EXHAUSTED", "OK"} and sum(ends.values()) == 20
    assert stalled["num_output_tokens"] == hostile["num_output_tokens"] > 0
    assert set(hostile["hostile_status_codes"]) <= {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
    assert sum(hostile["hostile_status_codes"].values()) >= 1
    assert stalled["ratio_vs_alone"] > 0 and set(hostile["target"]) == {"target", "met"}
    assert results["beside_reading"]["num_output_tokens"] == stalled["num_output_tokens"]
    assert results["stalled_vs_reading"] > 0


def test_routing(tiny_served_model_dir, results_dir):
    routing.main(["--model", str(tiny_served_model_dir), "--quick", "--num-conversations", "6",
                  "--num-open", "4", "--num-turns", "3", "--system-len", "40", "--user-len", "24",
                  "--kv-cache-memory-gib", "0.01", "--tag", "smoke"])
    record = _record(results_dir, "routing")
    assert [preset["workload"] for preset in record["results"]] == ["chat", "agent"]
    for preset in record["results"]:
        affinity, round_robin = preset["policies"]
        assert (affinity["policy"], round_robin["policy"]) == ("affinity", "round-robin")
        assert affinity["num_requests"] == round_robin["num_requests"] >= 12  # same shapes
        for result in (affinity, round_robin):
            assert result["num_output_tokens"] == result["num_requests"] * 8
            assert result["routing_us"]["p50"] > 0 and result["live_blocks_mean"] > 0
        assert affinity["num_cached_tokens"] > 0
        assert preset["max_prompt_len"] == 40 + 4 * 24 + 3 * 8  # 2 to 4 turns: 3 on average
