"""Speculative decoding's Prometheus counters under vLLM's names, read from the speculator's
totals when scraped."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pagedserve.scheduler_svc.spec_decode import SpecDecodeTotals
from prometheus_client.core import CounterMetricFamily, Metric

MODEL = ["model_name"]


class SpecDecodeCollector:
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
