"""Shared bits of the benchmark scripts: seeded workloads, the HF baselines' generate call,
percentiles, machine facts and the JSON record every script writes to bench/results/."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

import torch
from pagedserve.services.common.sampling_params import SamplingParams

RESULTS_DIR = Path(__file__).parent / "results"
DEFAULT_MODEL = str(Path.home() / ".cache" / "pagedserve" / "models" / "SmolLM2-135M-Instruct")


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompts: list[list[int]]  # token ids
    output_lens: list[int]  # tokens to generate for each prompt (ignore_eos)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def sampling_params(self) -> list[SamplingParams]:
        """Greedy, exactly output_lens[i] tokens each: every system does the same work."""
        return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                for n in self.output_lens]

    def describe(self) -> dict:
        return {"workload": self.name, "num_prompts": len(self.prompts),
                "prompt_lens": [min(map(len, self.prompts)), max(map(len, self.prompts))],
                "output_lens": [min(self.output_lens), max(self.output_lens)],
                "num_prompt_tokens": self.num_prompt_tokens,
                "num_output_tokens": self.num_output_tokens}


def make_workload(name: str, num_prompts: int, prompt_lens: tuple[int, int],
                  output_lens: tuple[int, int], vocab_size: int, seed: int = 0) -> Workload:
    """Random token prompts (ids from the middle of the vocabulary, no special tokens) with
    lengths drawn uniformly from the closed ranges; the same seed gives the same workload."""
    rng = random.Random(seed)
    low, high = min(1000, vocab_size // 4), max(vocab_size - 1000, vocab_size * 3 // 4)
    prompts = [[rng.randrange(low, high) for _ in range(rng.randint(*prompt_lens))]
               for _ in range(num_prompts)]
    outs = [rng.randint(*output_lens) for _ in range(num_prompts)]
    return Workload(name, prompts, outs)


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], num_new_tokens: int) -> torch.Tensor:
    """HF greedy generate of exactly num_new_tokens for a left-padded static batch:
    [len(prompts), num_new_tokens] new token ids."""
    device = model.device
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    out = model.generate(ids.to(device), attention_mask=mask.to(device),
                         max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[:, width:]


@contextlib.contextmanager
def serve_process(serve_args: list[str], cwd: Path) -> Iterator[subprocess.Popen]:
    """`pagedserve serve` with these flags, terminated on exit; its output is kept aside and its
    tail logged if the benchmark fails."""
    with tempfile.TemporaryFile("w+") as log_file:
        stack = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "serve", *serve_args],
                                 cwd=cwd, stdout=log_file, stderr=log_file,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            yield stack
        except Exception:
            log_file.seek(0)
            logging.getLogger(__name__).error("stack log:\n%s", log_file.read()[-4000:])
            raise
        finally:
            stack.terminate()
            try:
                stack.wait(60)
            except subprocess.TimeoutExpired:
                stack.kill()


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """{"p50": ..., "p90": ..., "p99": ..., "mean": ...} of the values (nearest rank)."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {f"p{q}": ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]
           for q in qs}
    out["mean"] = sum(ordered) / len(ordered)
    return out


def quiet_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("services", "scheduler_svc", "worker_svc", "kernels", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_error()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_1m": round(os.getloadavg()[0], 2)}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    try:
        import transformers

        info["transformers"] = transformers.__version__
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True).stdout.strip()
    except (ImportError, OSError):
        pass
    return info


def sync_device(device: torch.device) -> None:
    """Waits for the work queued on a CUDA device; nothing to wait for on the others."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed_s = time.perf_counter() - self.start


def write_record(bench: str, record: dict, tag: str = "") -> Path:
    """bench/results/<bench>[-tag].json with the machine facts beside the numbers."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{bench}{'-' + tag if tag else ''}.json"
    record = {"bench": bench, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": machine_info(), **record}
    path.write_text(json.dumps(record, indent=2, default=_jsonable) + "\n")
    return path


def finish(bench: str, args: argparse.Namespace, line: str, results: list, **fields) -> dict:
    """Every script's ending: record the run (its flags, the one result line, the results and
    `fields`), print the line, and return the summary."""
    path = write_record(bench, {**fields, "args": vars(args), "summary": line,
                                "results": results}, args.tag)
    print(line, flush=True)
    logging.getLogger(f"bench.{bench}").info("recorded %s", path)
    return {"summary": line, "results": results}


def _jsonable(obj: object) -> object:
    if is_dataclass(obj):
        return asdict(obj)
    return str(obj)
