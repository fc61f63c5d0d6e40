"""An engine or LLM that is closed or deleted ends its model thread and lets go of its worker
(the model, KV cache and CUDA graphs: its device memory); a script that uses LLM exits cleanly."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref
from pathlib import Path

from pagedserve.services.common.sampling_params import SamplingParams

from pagedserve.llm_engine import LLMEngine
from tests.unit.tiny_tokenizers import byte_level_bpe

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _engine(model_dir: Path, device: str) -> LLMEngine:
    return LLMEngine.from_kwargs(model=str(model_dir), device=device, sim_model="Llama-3-8B",
                                 sim_time_scale=0.01, num_gpu_blocks_override=32,
                                 num_cpu_blocks_override=4, num_threads=1)


def _generate(engine: LLMEngine) -> list[int]:
    engine.add_request("r", [5, 6, 7, 8], GREEDY)
    token_ids = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            token_ids += output.outputs[0].token_ids
    return token_ids


def _new_model_thread(before: set[threading.Thread]) -> threading.Thread:
    (thread,) = {t for t in threading.enumerate() if t.name == "worker-step"} - before
    return thread


def test_a_deleted_engine_ends_its_model_thread_and_its_worker_is_collected(llama_dir):
    before = set(threading.enumerate())
    engine = _engine(llama_dir, "sim")
    _generate(engine)
    thread, worker = _new_model_thread(before), weakref.ref(engine.core.workers[0])

    del engine
    gc.collect()

    thread.join(timeout=30)
    assert not thread.is_alive()
    assert worker() is None


def test_a_closed_engine_lets_go_of_its_model_and_the_next_one_generates_the_same(llama_dir):
    before = set(threading.enumerate())
    with _engine(llama_dir, "cpu") as engine:
        first = _generate(engine)
        thread, worker = _new_model_thread(before), engine.core.workers[0]
        model = weakref.ref(worker.runner.model)
    engine.close()  # idempotent

    assert not thread.is_alive()
    assert worker.runner is None and worker.cache_engine is None and model() is None
    with _engine(llama_dir, "cpu") as second:
        assert _generate(second) == first


SCRIPT = """
import logging
from pagedserve import LLM, SamplingParams

logging.basicConfig(level=logging.WARNING)
logging.getLogger("pagedserve.worker_svc.model_thread").setLevel(logging.DEBUG)
llm = LLM({model!r}, tokenizer={tokenizer!r}, device="cpu", num_gpu_blocks_override=32,
          num_cpu_blocks_override=4, num_threads=1)
outputs = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4),
                       use_tqdm=False)
print("generated", outputs[0].outputs[0].token_ids)
"""


def test_a_script_that_never_closes_its_llm_ends_the_model_thread_and_exits_0(llama_dir,
                                                                             tmp_path):
    """On CUDA, a model thread left running at exit aborted the process ("terminate called
    without an active exception", status 134) after its results were printed."""
    tokenizer = tmp_path / "tokenizer"
    byte_level_bpe().hf_tokenizer.save_pretrained(tokenizer)
    script = SCRIPT.format(model=str(llama_dir), tokenizer=str(tokenizer))

    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)

    assert done.returncode == 0, done.stderr[-2000:]
    assert "generated [" in done.stdout
    assert "terminate called" not in done.stderr
    assert "model thread worker-step stopped" in done.stderr
