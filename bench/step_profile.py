"""Step profile: where a decode step's device and host time go, for one model at one batch.

    python -m bench.step_profile --models llama-3-8b qwen2.5-0.5b            # on a GPU
    python -m bench.step_profile --models tiny-llama --device cpu --steps 3  # a smoke run

Each model (random weights of its real shape, as bench.offline_gpu) serves --batch-size
requests of --prompt-len random tokens in the in-process engine until every one decodes, then
two windows of decode steps:
- the device window, under torch.profiler: the kernels a step launches (CUDA graph replays
  included), each with its launches and device time per step, the device's busy time per
  step against the step's wall time, and the host's self time per step in torch operators and
  CUDA runtime calls;
- the host window, unprofiled: a sampling thread reads every thread's Python stack each
  --sample-interval-ms and counts, per thread, the lines that were running (self) and the
  pagedserve functions on the stack (inclusive), waits (locks, queues, conditions) apart, and
  the process's CPU time per step (the sampler's own included).
Records to bench/results/step_profile-<tag>.json."""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType

import torch

from bench.common import Timer, finish, make_workload, quiet_logging
from bench.offline_gpu import DTYPES, MODEL_CONFIGS, write_model_dir
from pagedserve.llm_engine import LLMEngine

# a leaf frame in one of these files is a thread waiting, not working
_WAIT_FILES = ("threading.py", "queue.py", "selectors.py", "futures/_base.py",
               "futures/thread.py")
_REPO = str(Path(__file__).resolve().parents[1]) + os.sep


class HostSampler:
    """Samples every other thread's Python stack from a thread of its own."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.num_samples = 0
        self.self_lines: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self.functions: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-sampler", daemon=True)

    def __enter__(self) -> HostSampler:
        # A thread running Python keeps the GIL up to the switch interval (5 ms) after the
        # sampler asks for it, so the samples would land on the next call that lets go of the
        # GIL (a CUDA call, a copy) instead of the Python before it: a short interval meanwhile.
        self._switch_interval_s = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval_s, self.interval_s / 10))
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch_interval_s)

    def _run(self) -> None:
        names = {}
        while not self._stop.wait(self.interval_s):
            names.update((t.ident, t.name) for t in threading.enumerate())
            self.num_samples += 1
            for ident, frame in sys._current_frames().items():
                if ident != self._thread.ident:
                    self._count(names.get(ident, str(ident)), frame)

    def _count(self, thread: str, frame: FrameType) -> None:
        code = frame.f_code
        if code.co_filename.endswith(_WAIT_FILES):
            self.self_lines[thread]["(waiting)"] += 1
        else:
            self.self_lines[thread][f"{_where(code.co_filename)}:{frame.f_lineno} "
                                    f"{code.co_qualname}"] += 1
        seen = set()
        while frame is not None:
            code = frame.f_code
            if _is_ours(code.co_filename):
                name = f"{_where(code.co_filename)} {code.co_qualname}"
                if name not in seen:
                    seen.add(name)
                    self.functions[thread][name] += 1
            frame = frame.f_back

    def summary(self, top: int) -> dict:
        def shares(counter: collections.Counter) -> list[tuple[str, float]]:
            return [(name, n / self.num_samples) for name, n in counter.most_common(top)]
        return {"num_samples": self.num_samples, "interval_ms": self.interval_s * 1e3,
                "threads": {thread: {"self": shares(self.self_lines[thread]),
                                     "inclusive": shares(self.functions[thread])}
                            for thread in self.self_lines}}


def _is_ours(filename: str) -> bool:
    return filename.startswith(_REPO) and "site-packages" not in filename


def _where(filename: str) -> str:
    """The repository's files from its top folder, others by their last two parts."""
    if _is_ours(filename):
        return filename[len(_REPO):]
    return "/".join(Path(filename).parts[-2:])


def host_ops(prof: torch.profiler.profile, num_steps: int, top: int) -> list[dict]:
    """The host's time per step in torch's operators and the CUDA runtime calls under them,
    by self time (the profiler's own cost is in it too)."""
    ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    ops.sort(key=lambda e: -e.self_cpu_time_total)
    return [{"name": e.key[:120], "calls_per_step": e.count / num_steps,
             "self_us_per_step": e.self_cpu_time_total / num_steps} for e in ops[:top]]


def device_kernels(prof: torch.profiler.profile, num_steps: int, top: int) -> dict:
    """The device's kernels per step, from the profiler's device-side events."""
    per_kernel: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        entry = per_kernel[event.name]
        entry[0] += 1
        entry[1] += event.device_time_total
    busy_us = sum(us for _, us in per_kernel.values())
    table = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])
    return {"num_kernels_per_step": sum(n for n, _ in per_kernel.values()) / num_steps,
            "device_busy_ms_per_step": busy_us / num_steps / 1e3,
            "kernels": [{"name": name[:160], "launches_per_step": n / num_steps,
                         "us_per_step": us / num_steps, "share": us / busy_us}
                        for name, (n, us) in table[:top]]}


def profile_model(name: str, args: argparse.Namespace, root: Path) -> dict:
    model_dir = write_model_dir(name, args.dtype, root)
    vocab = MODEL_CONFIGS[name]["vocab_size"]
    num_decodes = 2 * args.steps + args.warm_steps
    wl = make_workload("profile", args.batch_size, (args.prompt_len, args.prompt_len),
                       (num_decodes + 64, num_decodes + 64), vocab, args.seed)
    kwargs = {"kv_cache_memory_gib": 1.0} if args.device == "cpu" else {}
    engine = LLMEngine.from_kwargs(model=str(model_dir), load_format="dummy", dtype=args.dtype,
                                   device=args.device, max_num_seqs=args.batch_size,
                                   seed=args.seed, **kwargs)
    for i, (prompt, sampling) in enumerate(zip(wl.prompts, wl.sampling_params(), strict=True)):
        engine.add_request(f"profile-{i}", prompt, sampling)
    scheduler = engine.core.scheduler
    while scheduler.waiting or any(not g.is_decode_phase for g in scheduler.running):
        engine.step()
    for _ in range(args.warm_steps):
        engine.step()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    with torch.profiler.profile(activities=activities, experimental_config=_all_threads()
                                ) as prof, Timer() as profiled:
        for _ in range(args.steps):
            engine.step()
        sync()
    device = device_kernels(prof, args.steps, args.top) if args.device == "cuda" else {}
    ops = host_ops(prof, args.steps, args.top)

    step_ms = []
    cpu_start = time.process_time()
    with HostSampler(args.sample_interval_ms / 1e3) as sampler:
        for _ in range(args.steps):
            with Timer() as t:
                engine.step()
            step_ms.append(t.elapsed_s * 1e3)
    host_cpu_ms = (time.process_time() - cpu_start) * 1e3 / args.steps
    result = {"model": name, "batch_size": len(scheduler.running),
              "prompt_len": args.prompt_len, "steps": args.steps,
              "profiled_step_ms": profiled.elapsed_s * 1e3 / args.steps,
              "median_step_ms": statistics.median(step_ms),
              "host_cpu_ms_per_step": host_cpu_ms, **device,
              "host_ops": ops, "host": sampler.summary(args.top)}
    engine.close()
    return result


def _all_threads() -> torch._C._profiler._ExperimentalConfig | None:
    """The model runs on the worker's model thread: the profiler's operator callbacks are
    per thread unless installed for all of them."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # a torch without the option: the host table misses that thread
        return None


def describe(r: dict) -> str:
    device = (f", {r['num_kernels_per_step']:.0f} kernels and "
              f"{r['device_busy_ms_per_step']:.2f} ms of device time a step"
              if "num_kernels_per_step" in r else "")
    return (f"{r['model']} batch {r['batch_size']}: median decode step {r['median_step_ms']:.2f} "
            f"ms ({r['profiled_step_ms']:.2f} ms profiled), host CPU "
            f"{r['host_cpu_ms_per_step']:.2f} ms a step (the sampler's included){device}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama-3-8b", "qwen2.5-0.5b"],
                        choices=sorted(MODEL_CONFIGS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--batch-size", type=int, default=30)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--warm-steps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50, help="decode steps in each window")
    parser.add_argument("--sample-interval-ms", type=float, default=0.5)
    parser.add_argument("--top", type=int, default=40, help="rows kept in each table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="gpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    with tempfile.TemporaryDirectory(prefix="pagedserve-profile-") as tmp:
        results = [profile_model(name, args, Path(tmp)) for name in args.models]
    line = (f"step profile on {args.device} (load average {os.getloadavg()[0]:.1f}): "
            + "; ".join(map(describe, results)))
    return finish("step_profile", args, line, results)


if __name__ == "__main__":
    main()
