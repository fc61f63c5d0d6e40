"""CPU stand-ins for captured CUDA graphs, for the decode and the mixed-step graph sets alike:
each "replay" reruns the recorded forward on whatever the static buffers hold now, into the
recorded output tensor, which is what replaying a graph means."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class EagerReplay:
    def __init__(self, graphs: Any, key: int, kv_caches: list[torch.Tensor]) -> None:
        self.graphs, self.key, self.kv_caches = graphs, key, kv_caches

    def replay(self) -> None:
        self.graphs.hidden_states[self.key].copy_(self.graphs.run_static(self.key, self.kv_caches))


def with_eager_replays(graphs: Any, keys: Iterable[int], kv_caches: list[torch.Tensor]) -> Any:
    """`graphs` (DecodeGraphs by batch size, MixedGraphs by token count) with a stand-in
    recorded for each key, as capture would record a graph."""
    with torch.inference_mode():
        for key in keys:
            graphs.hidden_states[key] = graphs.run_static(key, kv_caches)
            graphs.graphs[key] = EagerReplay(graphs, key, kv_caches)
    graphs.kv_caches = kv_caches
    return graphs
