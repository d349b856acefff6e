"""The GPU check's measurements (bench/gpu/gpu-check.sh runs them; see bench/gpu/README.md).

- `burst`: workload A, a burst of 64 prompts of 512 tokens asking 128 tokens each (greedy,
  ignore_eos), through the engine in this process (`LLMEngine.generate`) and through
  transformers' `generate` as one static batch of the same 64 on the same GPU; output tokens/s.
- `online`: Poisson arrivals of the same shape against a live replica (`inferops serve --device
  cuda`, driven by `inferops bench`'s load generator over HTTP), and against transformers run as
  a static-batch server in this process: each batch takes every request waiting (at most 64)
  when the previous batch ends. While the replica serves, its /metrics is read every second for
  the DCGM series (GPU utilisation, memory, power) its NVML reader exports.
- `summary`: the step results in one file, with the GPU's name.

Each subcommand writes JSON to --out. The peer runs in the same process on the same GPU, never
at the same time as the engine.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ENGINE_OPTIONS = {"max_num_seqs": 128, "max_num_batched_tokens": 8192}


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Token ids clear of the special tokens at the bottom of the vocabulary."""
    rng = random.Random(seed)
    low = min(1000, vocab // 2)
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(count)]


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({__import__('platform').machine()})"


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()


def engine_burst(model: str, prompts: list[list[int]], output_len: int, device: str) -> dict:
    from runtime.engine.config import EngineConfig
    from runtime.engine.engine import LLMEngine
    from runtime.engine.sampling import SamplingParams

    started = time.monotonic()
    engine = LLMEngine(EngineConfig(model=model, device=device, **ENGINE_OPTIONS))
    startup_s = time.monotonic() - started
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    # Warm-up on other prompts (reversed), so that the measured run finds none in the prefix cache.
    engine.generate([p[::-1] for p in prompts[:4]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    synchronize(device)
    started = time.monotonic()
    outputs = engine.generate(prompts, params)
    elapsed = time.monotonic() - started
    tokens = sum(map(len, outputs))
    result = {"output_tokens": tokens, "seconds": round(elapsed, 3), "output_tok_s": round(tokens / elapsed, 1),
              "startup_s": round(startup_s, 1), "plan": engine.plan.describe(),
              "kv_blocks": engine.num_kv_blocks, "cuda_graphs": engine.runner.graphs is not None,
              "options": ENGINE_OPTIONS}
    del engine
    release(device)
    return result


def load_transformers(model: str, device: str):
    """In the engine's dtype on that device: bf16 on a GPU, float32 on a CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()


def hf_static_batch(hf, prompts: list[list[int]], output_len: int) -> int:
    """One `generate` of these prompts as a batch (left-padded where lengths differ), every row
    to exactly `output_len` tokens; returns the tokens generated per row."""
    import torch

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        out = hf.generate(ids.to(hf.device), attention_mask=mask.to(hf.device), max_new_tokens=output_len,
                          min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    synchronize(hf.device.type)
    return out.shape[1] - width


def transformers_burst(model: str, prompts: list[list[int]], output_len: int, device: str) -> dict:
    hf = load_transformers(model, device)
    hf_static_batch(hf, prompts[:4], 8)  # warm-up
    started = time.monotonic()
    generated = hf_static_batch(hf, prompts, output_len)
    elapsed = time.monotonic() - started
    tokens = generated * len(prompts)
    del hf
    release(device)
    return {"output_tokens": tokens, "seconds": round(elapsed, 3), "output_tok_s": round(tokens / elapsed, 1),
            "batch": len(prompts), "transformers": __import__("transformers").__version__}


def burst(args: argparse.Namespace) -> dict:
    from runtime.engine.config import ModelConfig

    vocab = ModelConfig.from_dir(args.model).vocab_size
    prompts = random_prompts(args.prompts, args.input_len, vocab, args.seed)
    engine = engine_burst(args.model, prompts, args.output_len, args.device)
    peer = transformers_burst(args.model, prompts, args.output_len, args.device)
    ratio = engine["output_tok_s"] / peer["output_tok_s"]
    workload = {"prompts": args.prompts, "input_len": args.input_len, "output_len": args.output_len}
    return {"device": device_name(args.device), "workload": workload, "engine": engine,
            "transformers_static_batch": peer,
            "ratio": round(ratio, 2), "target": ">= 3.0x", "met": ratio >= 3.0}


# -- online ------------------------------------------------------------------------------------

def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 1)

    return {"p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99),
            "mean_ms": round(1000 * statistics.mean(values), 1)}


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    clock, times = 0.0, []
    for _ in range(count):
        clock += rng.expovariate(rate)
        times.append(clock)
    return times


def transformers_online(args: argparse.Namespace) -> dict:
    """A static-batch server: a batch is every request that has arrived when the last one ended
    (at most 64), run to its end; a request's latency runs from its arrival to its batch's end."""
    from runtime.engine.config import ModelConfig

    count = args.requests
    vocab = ModelConfig.from_dir(args.model).vocab_size
    prompts = random_prompts(count, args.input_len, vocab, args.seed + 1)
    arrivals = arrival_times(count, args.rate, args.seed)
    hf = load_transformers(args.model, args.device)
    hf_static_batch(hf, prompts[:4], 8)
    latencies, batches, start = [], [], time.monotonic()
    served = 0
    while served < count:
        now = time.monotonic() - start
        if arrivals[served] > now:
            time.sleep(arrivals[served] - now)
            now = arrivals[served]
        batch = [i for i in range(served, count) if arrivals[i] <= now][:64]
        hf_static_batch(hf, [prompts[i] for i in batch], args.output_len)
        done = time.monotonic() - start
        latencies += [done - arrivals[i] for i in batch]
        batches.append(len(batch))
        served += len(batch)
    duration = time.monotonic() - start
    del hf
    release(args.device)
    return {"requests": count, "duration_s": round(duration, 2),
            "output_tok_s": round(count * args.output_len / duration, 1),
            "e2e": percentiles(latencies), "ttft_note": "no streaming: the first token shows at the batch's end",
            "batches": len(batches), "mean_batch": round(statistics.mean(batches), 1)}


def scrape_dcgm(url: str) -> dict[str, list[dict]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    series: dict[str, list[dict]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("DCGM_FI_DEV_"):
            series[family.name] = [{"labels": sample.labels, "value": sample.value} for sample in family.samples]
    return series


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            raise SystemExit(f"the replica exited with {process.returncode} before it was ready")
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the replica was not ready within {timeout_s:.0f} s")


def engine_online(args: argparse.Namespace) -> dict:
    from runtime.loadgen import BenchConfig, LengthRange, run_benchmark

    url = f"http://127.0.0.1:{args.port}"
    argv = [sys.executable, "-m", "project.cli", "serve", "--model", args.model, "--served-model-name", "demo",
            "--device", args.device, "--port", str(args.port),
            "--max-num-seqs", str(ENGINE_OPTIONS["max_num_seqs"]),
            "--max-num-batched-tokens", str(ENGINE_OPTIONS["max_num_batched_tokens"])]
    with open(args.log, "w") as output:
        process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT)
    try:
        ready_s = wait_healthy(url, process, 600)
        idle = scrape_dcgm(url)
        samples: list[dict] = []
        stop = threading.Event()

        def sample_gpu() -> None:
            while not stop.wait(1.0):
                try:
                    samples.append(scrape_dcgm(url))
                except OSError:
                    pass

        sampler = threading.Thread(target=sample_gpu, daemon=True)
        sampler.start()
        metrics = run_benchmark(BenchConfig(
            base_url=url, model="demo", num_prompts=args.requests, request_rate=args.rate, seed=args.seed,
            input_len=LengthRange(args.input_len, args.input_len),
            output_len=LengthRange(args.output_len, args.output_len),
            tokenizer_dir=args.model, show_progress=False))
        stop.set()
        sampler.join()
    finally:
        process.terminate()
        process.wait(60)

    def values(name: str) -> list[float]:
        return [s["value"] for snapshot in samples for s in snapshot.get(name, [])]

    utilisation = values("DCGM_FI_DEV_GPU_UTIL")
    return {"ready_s": round(ready_s, 1), "load": metrics,
            "nvml": {"series_at_idle": idle, "scrapes_under_load": len(samples),
                     "gpu_util_max": max(utilisation, default=None),
                     "gpu_util_mean": round(statistics.mean(utilisation), 1) if utilisation else None,
                     "fb_used_mib_max": max(values("DCGM_FI_DEV_FB_USED"), default=None),
                     "power_w_max": max(values("DCGM_FI_DEV_POWER_USAGE"), default=None)}}


def online(args: argparse.Namespace) -> dict:
    engine = engine_online(args)
    peer = transformers_online(args)
    nvml = engine["nvml"]["series_at_idle"]
    labelled = all({"gpu", "UUID"} <= set(s["labels"]) for series in nvml.values() for s in series)
    workload = {"requests": args.requests, "rate_rps": args.rate, "input_len": args.input_len,
                "output_len": args.output_len}
    return {"device": device_name(args.device), "workload": workload, "engine": engine,
            "transformers_static_server": peer,
            "dcgm_series_exported": sorted(nvml), "dcgm_labels_ok": bool(nvml) and labelled}


def summary(args: argparse.Namespace) -> dict:
    steps = {path.stem: json.loads(path.read_text()) for path in sorted(Path(args.results).glob("*.json"))
             if path.name != Path(args.out).name}
    return {"gpu": device_name("cuda"), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "torch": __import__("torch").__version__, **steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("burst", "online"):
        command = commands.add_parser(name)
        command.add_argument("--model", required=True)
        command.add_argument("--seed", type=int, default=0)
        command.add_argument("--out", required=True)
        # cpu: a smoke run of the script itself (tests/test_gpu_check.py), not a figure.
        command.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
        command.add_argument("--input-len", type=int, default=512)
        command.add_argument("--output-len", type=int, default=128)
    commands.choices["burst"].add_argument("--prompts", type=int, default=64)
    commands.choices["online"].add_argument("--requests", type=int, default=400)
    commands.choices["online"].add_argument("--rate", type=float, default=16.0)
    commands.choices["online"].add_argument("--port", type=int, default=8431)
    commands.choices["online"].add_argument("--log", default="replica.log")
    command = commands.add_parser("summary")
    command.add_argument("--results", required=True)
    command.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"burst": burst, "online": online, "summary": summary}[args.command](args)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k in ("ratio", "met", "gpu", "dcgm_labels_ok")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
