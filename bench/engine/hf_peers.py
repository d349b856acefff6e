"""Offline transformers peers for the built-in engine, on one checkpoint and one prompt set.

Peers (all greedy, all forced to produce exactly --output-len tokens, torch at --threads):
- `hf_generate_sequential`: `model.generate` one request at a time (what a naive server does);
- `hf_generate_static_batch`: `model.generate` on all requests as one left-padded batch;
- `hf_continuous_batching`: transformers' own continuous batching (`model.generate_batch`, a
  paged KV cache with a FIFO scheduler), when the installed transformers has it.

Workload A (the defaults): 32 requests, 64-token prompts (plus BOS, as a server sees a completion
prompt from `inferops bench --input-len 64 --tokenizer DIR`), 64 output tokens, tiny demo preset.
Prints one JSON object with output tokens/s per peer and writes it to --result-json if given.

    .venv/bin/python bench/engine/hf_peers.py --result-json bench/engine/work/hf_peers.json
"""

from __future__ import annotations

import argparse
import logging
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from serving_bench import emit_report  # noqa: E402

from runtime.engine.demo_model import write_demo_model  # noqa: E402
from runtime.loadgen import ExactTokenizer  # noqa: E402

DEFAULT_MODEL_DIR = REPO_ROOT / "bench" / "engine" / "work" / "tiny"
WARMUP_TOKENS = 4
PAGE_SIZE = 256
# Tokens per forward pass for continuous batching (prefill chunks plus decodes), as vLLM's
# max_num_batched_tokens.
MAX_BATCH_TOKENS = 2048


def workload_prompts(model_dir: Path, num_requests: int, input_len: int, seed: int):
    """Token ids of `num_requests` prompts with exactly `input_len` text tokens plus BOS."""
    lengths = ExactTokenizer(model_dir)
    rng = random.Random(seed)
    texts = [lengths.text_of_length(input_len, rng) for _ in range(num_requests)]
    return [lengths.tokenizer.encode(text).ids for text in texts]


class Peer:
    name = ""

    def __init__(self, model, output_len: int):
        self.model = model
        self.output_len = output_len

    def generate(self, prompts: list[list[int]]) -> int:
        """Run all prompts; return the number of generated tokens."""
        raise NotImplementedError

    def measure(self, prompts: list[list[int]]) -> dict:
        self.warm_up(prompts[0])
        started = time.perf_counter()
        output_tokens = self.generate(prompts)
        seconds = time.perf_counter() - started
        return {
            "requests": len(prompts),
            "output_tokens": output_tokens,
            "seconds": round(seconds, 3),
            "output_tokens_per_s": round(output_tokens / seconds, 2),
        }

    def warm_up(self, prompt: list[int]) -> None:
        # First calls allocate and pick kernels; keep that out of the timed run.
        saved = self.output_len
        self.output_len = WARMUP_TOKENS
        try:
            self.generate([prompt, prompt])
        finally:
            self.output_len = saved


class SequentialGenerate(Peer):
    name = "hf_generate_sequential"

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]]) -> int:
        generated = 0
        for prompt in prompts:
            input_ids = torch.tensor([prompt])
            output = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=self.output_len,
                min_new_tokens=self.output_len,
            )
            generated += output.shape[1] - input_ids.shape[1]
        return generated


class StaticBatchGenerate(Peer):
    name = "hf_generate_static_batch"

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]]) -> int:
        pad_id = self.model.config.pad_token_id
        longest = max(len(prompt) for prompt in prompts)
        # Left padding keeps every row's last prompt token at the same position for decoding.
        input_ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        output = self.model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=self.output_len,
            min_new_tokens=self.output_len,
            pad_token_id=pad_id,
        )
        return (output.shape[1] - longest) * len(prompts)


class ContinuousBatchingGenerate(Peer):
    name = "hf_continuous_batching"

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]]) -> int:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        # eos -1: no stop token, so every request produces exactly max_new_tokens (ignore_eos).
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=self.output_len,
            eos_token_id=-1,
            pad_token_id=self.model.config.pad_token_id,
        )
        # warmup=False: its warm-up pre-captures CUDA graphs, which a CPU run has none of.
        # Sized for the workload: left to itself the cache is sized from "free GPU memory",
        # which on CPU means most of the RAM, and zeroing that dominates the run.
        pages_per_request = math.ceil((max(map(len, prompts)) + self.output_len) / PAGE_SIZE)
        cache = ContinuousBatchingConfig(
            page_size=PAGE_SIZE,
            num_blocks=len(prompts) * pages_per_request + len(prompts),
            max_batch_tokens=MAX_BATCH_TOKENS,
        )
        results = self.model.generate_batch(
            prompts,
            generation_config=config,
            continuous_batching_config=cache,
            progress_bar=False,
            warmup=False,
        )
        failed = [result.error for result in results.values() if result.error]
        if failed or len(results) != len(prompts):
            raise RuntimeError(f"continuous batching failed: {failed[:3]} ({len(results)} results)")
        return sum(len(result.generated_tokens) for result in results.values())


PEERS = {
    peer.name: peer
    for peer in (SequentialGenerate, StaticBatchGenerate, ContinuousBatchingGenerate)
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help=f"checkpoint folder (default: write the tiny demo to {DEFAULT_MODEL_DIR})",
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--peers", default=",".join(PEERS), help=f"comma-separated subset of {', '.join(PEERS)}"
    )
    parser.add_argument("--result-json", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import transformers
    from transformers import AutoModelForCausalLM

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    model_dir = args.model
    if model_dir is None:
        model_dir = DEFAULT_MODEL_DIR
        if not (model_dir / "config.json").is_file():
            write_demo_model(model_dir, preset="tiny", seed=0)
    prompts = workload_prompts(model_dir, args.num_requests, args.input_len, args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    report = {
        "workload": {
            "model": str(model_dir),
            "requests": args.num_requests,
            "prompt_tokens": len(prompts[0]),
            "output_tokens": args.output_len,
            "sampling": "greedy, eos ignored",
        },
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
        },
        "peers": {},
    }
    for name in args.peers.split(","):
        peer_class = PEERS[name.strip()]
        if peer_class is ContinuousBatchingGenerate and not hasattr(model, "generate_batch"):
            report["peers"][peer_class.name] = {"skipped": "transformers has no generate_batch"}
            continue
        print(f"running {peer_class.name} ...", file=sys.stderr)
        report["peers"][peer_class.name] = peer_class(model, args.output_len).measure(prompts)
    emit_report(report, args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
