"""The scheduler's Prometheus metrics: a StatLogger fed once per engine step and once per finished
request (counters and histograms), and a collector reading the engine's load snapshot when
scraped (the gauges, and the counters the engine already keeps) -- nothing per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pagedserve.scheduler_svc.kv_transfer import TransferStats
from pagedserve.scheduler_svc.spec_decode import SpecDecodeTotals
from pagedserve.scheduler_svc.stats import FinishedRequestStats, StepStats
from pagedserve.services.common.config import CacheConfig
from pagedserve.services.common.engine_api import EngineLoad
from pagedserve.services.rpc.metrics import (
    INTER_TOKEN_BUCKETS,
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    STEP_TIME_BUCKETS,
    tokens_buckets,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

MODEL = ["model_name"]
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
KV_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                       10.0, 30.0)


class KvTransferMetrics:
    """Prefill/decode disaggregation, on the decode replica that pulls."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, MODEL, registry=registry).labels(model_name)

        self._time = Histogram(
            "pagedserve:kv_transfer_time_seconds", "Time a decode replica spent pulling one "
            "request's prompt blocks from a prefill replica (failed pulls included).", MODEL,
            registry=registry, buckets=KV_TRANSFER_BUCKETS).labels(model_name)
        self._bytes = counter("pagedserve:kv_transfer_bytes",
                              "KV-cache bytes pulled from prefill replicas.")
        self._blocks = counter("pagedserve:kv_transfer_blocks",
                               "KV-cache blocks pulled from prefill replicas.")
        self._failures = counter("pagedserve:kv_transfer_failures", "Pulls from a prefill "
                                 "replica that failed (the prompt was computed here instead).")

    def record(self, stats: TransferStats) -> None:
        self._time.observe(stats.duration_s)
        if not stats.is_ok:
            self._failures.inc()
            return
        self._bytes.inc(stats.num_bytes)
        self._blocks.inc(stats.num_blocks)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str,
                 load: Callable[[], EngineLoad | None]) -> None:
        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, MODEL, registry=registry).labels(model_name)

        def histogram(name: str, documentation: str, buckets) -> Histogram:
            return Histogram(name, documentation, MODEL, registry=registry,
                             buckets=buckets).labels(model_name)

        self._model_name = model_name
        self._registry = registry
        self._prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = counter("vllm:generation_tokens",
                                          "Number of generation tokens processed.")
        self._preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self._prefix_queries = counter("vllm:prefix_cache_queries",
                                       "Prefix cache queries, in terms of number of queried tokens.")
        self._prefix_hits = counter("vllm:prefix_cache_hits",
                                    "Prefix cache hits, in terms of number of cached tokens.")
        self._request_success = Counter("vllm:request_success", "Count of finished requests.",
                                        [*MODEL, "finished_reason"], registry=registry)
        self._iteration_tokens = histogram("vllm:iteration_tokens_total",
                                           "Histogram of number of tokens per engine_step.",
                                           ITERATION_TOKENS_BUCKETS)
        self._queue_time = histogram("vllm:request_queue_time_seconds",
                                     "Histogram of time spent in WAITING phase for request.",
                                     REQUEST_LATENCY_BUCKETS)
        self._prefill_time = histogram("vllm:request_prefill_time_seconds",
                                       "Histogram of time spent in PREFILL phase for request.",
                                       REQUEST_LATENCY_BUCKETS)
        self._decode_time = histogram("vllm:request_decode_time_seconds",
                                      "Histogram of time spent in DECODE phase for request.",
                                      REQUEST_LATENCY_BUCKETS)
        self._inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self._time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_BUCKETS)
        self._params_n = histogram("vllm:request_params_n",
                                   "Histogram of the n request parameter.", PARAMS_N_BUCKETS)
        # their buckets run to max_model_len, known once the workers answered (on_engine_ready)
        self._params_max_tokens: Histogram | None = None
        self._max_num_generation_tokens: Histogram | None = None
        self._step_overhead = histogram(
            "pagedserve:scheduler_step_overhead_seconds",
            "Scheduler time per engine step: scheduling and output processing.", STEP_TIME_BUCKETS)
        swapped = Counter("pagedserve:swapped_blocks", "KV-cache blocks moved between the "
                          "device and CPU swap space.", [*MODEL, "direction"], registry=registry)
        self._swapped_in = swapped.labels(model_name, "in")
        self._swapped_out = swapped.labels(model_name, "out")
        self._tiers = _TierMetrics(registry, model_name)
        registry.register(_LoadCollector(model_name, load))

    def on_engine_ready(self, max_model_len: int, cache_info: dict[str, str]) -> None:
        """`cache_info`: vLLM's cache_config_info labels (block_size, num_gpu_blocks, ...)."""
        buckets = tokens_buckets(max_model_len)
        self._params_max_tokens = Histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            MODEL, registry=self._registry, buckets=buckets).labels(self._model_name)
        self._max_num_generation_tokens = Histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", MODEL,
            registry=self._registry, buckets=buckets).labels(self._model_name)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              list(cache_info), registry=self._registry).labels(**cache_info).set(1)

    def record_step(self, stats: StepStats) -> None:
        self._prompt_tokens.inc(stats.num_prompt_tokens)
        self._generation_tokens.inc(stats.num_generation_tokens)
        self._iteration_tokens.observe(stats.num_scheduled_tokens)
        self._step_overhead.observe(stats.schedule_time_s)
        if stats.num_preemptions:
            self._preemptions.inc(stats.num_preemptions)
        if stats.num_prefix_cache_queries:
            self._prefix_queries.inc(stats.num_prefix_cache_queries)
            self._prefix_hits.inc(stats.num_prefix_cache_hits)
            self._tiers.record_hits(stats)
        if stats.num_blocks_swapped_in:
            self._swapped_in.inc(stats.num_blocks_swapped_in)
        if stats.num_blocks_swapped_out:
            self._swapped_out.inc(stats.num_blocks_swapped_out)
        self._tiers.record_copies(stats)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        self._request_success.labels(self._model_name, stats.finish_reason).inc()
        self._queue_time.observe(stats.queue_time_s)
        self._prefill_time.observe(stats.prefill_time_s)
        self._decode_time.observe(stats.decode_time_s)
        self._inference_time.observe(stats.inference_time_s)
        self._time_per_output_token.observe(stats.time_per_output_token_s)
        self._params_n.observe(stats.n)
        if self._params_max_tokens is not None:
            self._params_max_tokens.observe(stats.max_tokens)
            self._max_num_generation_tokens.observe(stats.num_generation_tokens)


def cache_config_info(cache: CacheConfig, num_gpu_blocks: int, num_cpu_blocks: int
                      ) -> dict[str, str]:
    """The cache config as vLLM's vllm:cache_config_info labels, with the block counts found."""
    return {"block_size": str(cache.block_size), "cache_dtype": "auto",
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "num_cpu_blocks": str(num_cpu_blocks), "num_gpu_blocks": str(num_gpu_blocks),
            "swap_space": str(cache.swap_space_gib)}


class _TierMetrics:
    """Hits by the tier that held them, and the host tier's copies (vLLM's KV offloading
    names for their bytes and time)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, MODEL, registry=registry).labels(model_name)

        hits = Counter("pagedserve:prefix_cache_hits_by_tier", "Prefix-cache hit tokens by the "
                       "tier that held them.", [*MODEL, "tier"], registry=registry)
        self._gpu_hits = hits.labels(model_name, "gpu")
        self._cpu_hits = hits.labels(model_name, "cpu")
        offload = Counter("pagedserve:kv_offload_blocks", "KV-cache blocks copied between the "
                          "device and the host tier.", [*MODEL, "direction"], registry=registry)
        self._offloaded = offload.labels(model_name, "offload")
        self._onloaded = offload.labels(model_name, "onload")
        self._offload_bytes = counter("vllm:kv_offload_store_bytes",
                                      "Total bytes stored from GPU to the host tier.")
        self._offload_time = counter("vllm:kv_offload_store_time", "Total store time from GPU "
                                     "to the host tier, in seconds, as the worker measured it.")
        self._onload_bytes = counter("vllm:kv_offload_load_bytes",
                                     "Total bytes loaded from the host tier to GPU.")
        self._onload_time = counter("vllm:kv_offload_load_time", "Total load time from the "
                                    "host tier to GPU, in seconds, as the worker measured it.")

    def record_hits(self, stats: StepStats) -> None:
        self._gpu_hits.inc(stats.num_prefix_cache_hits - stats.num_host_cache_hits)
        self._cpu_hits.inc(stats.num_host_cache_hits)

    def record_copies(self, stats: StepStats) -> None:
        copies = stats.host_copies
        if stats.num_blocks_offloaded:
            self._offloaded.inc(stats.num_blocks_offloaded)
            self._offload_bytes.inc(copies.offload_bytes)
            self._offload_time.inc(copies.offload_time_s)
        if stats.num_blocks_onloaded:
            self._onloaded.inc(stats.num_blocks_onloaded)
            self._onload_bytes.inc(copies.onload_bytes)
            self._onload_time.inc(copies.onload_time_s)


class _LoadCollector:
    """Read at scrape time from the load snapshot the engine loop takes between steps."""

    def __init__(self, model_name: str, load: Callable[[], EngineLoad | None]) -> None:
        self._model_name = model_name
        self._load = load

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        load = self._load()
        if load is None:  # the worker handshake is still running
            return
        labels = [self._model_name]
        usage = load.num_gpu_blocks_used / load.num_gpu_blocks if load.num_gpu_blocks else 0.0
        for name, documentation, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.",
                 load.num_running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                 load.num_waiting),
                ("vllm:num_requests_swapped", "Number of requests swapped to CPU.",
                 load.num_swapped),
                ("pagedserve:num_requests_paused", "Number of requests not scheduled because "
                 "their client is behind reading their stream.", load.num_paused),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)):
            gauge = GaugeMetricFamily(name, documentation, labels=MODEL)
            gauge.add_metric(labels, value)
            yield gauge
        rebuilds = CounterMetricFamily("pagedserve:worker_rebuilds", "Workers rebuilt after "
                                       "losing their KV cache.", labels=MODEL)
        rebuilds.add_metric(labels, load.num_worker_rebuilds)
        yield rebuilds


class SpecDecodeCollector:
    """Speculative decoding's counters under vLLM's names, read from the speculator's totals when
    scraped."""

    def __init__(self, model_name: str, totals: Callable[[], SpecDecodeTotals | None]) -> None:
        self._model_name = model_name
        self._totals = totals

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        totals = self._totals()
        if totals is None:  # the engine is not started yet
            return
        labels = [self._model_name]
        for name, documentation, value in (
                ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                 totals.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                 totals.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                 totals.num_accepted_tokens)):
            counter = CounterMetricFamily(name, documentation, labels=MODEL)
            counter.add_metric(labels, value)
            yield counter
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.",
                                      labels=[*MODEL, "position"])
        for position, value in enumerate(list(totals.num_accepted_tokens_per_pos)):
            per_pos.add_metric([*labels, str(position)], value)
        yield per_pos
