#!/usr/bin/env python3
"""CPU decode speed of Hugging Face transformers on a kiln-format GLM-5 checkpoint, for comparison with
kiln's own CPU decode benchmark.

Loads CKPT_DIR (ModelOpt NVFP4 or BF16; NVFP4 weights are dequantised with the numpy dequantiser in
npref.py, i.e. W4A16 semantics) into GlmMoeDsaForCausalLM (torch, CPU, eager attention), runs one
prefill of a fixed pseudo-random prompt, then N greedy decode steps through the KV cache (one token per
forward; the token predicted by the prefill is the first decode input). After --warmup untimed decode
steps, only the N decode steps are timed.
Prints one JSON line per dtype:
  {"impl": "transformers", "dtype": "bf16", "decode_tok_s": ..., "prompt_len": ..., "new_tokens": ..., ...}

Usage: python tests/oracle/bench_transformers.py CKPT_DIR --tokens 32 [--prompt-len 16] [--dtype bf16|fp32|both]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import npref  # noqa: E402

import transformers  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@torch.no_grad()
def bench(ckpt: str, dtype: str, tokens: int, prompt_len: int, seed: int, experts: str, warmup: int) -> dict:
    t_load = time.perf_counter()
    model, info = npref.load_model(ckpt, DTYPES[dtype], strict=False)
    if experts != "eager":
        model.set_experts_implementation(experts)
    t_load = time.perf_counter() - t_load
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=gen)

    cache = DynamicCache(config=cfg)
    t0 = time.perf_counter()
    out = model(input_ids=prompt, cache=cache, use_cache=True)
    prefill_s = time.perf_counter() - t0
    nxt = out.logits[0, -1].argmax().view(1, 1)
    generated = []
    for _ in range(warmup):  # untimed decode steps (first-call overheads)
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        nxt = out.logits[0, -1].argmax().view(1, 1)
        generated.append(int(nxt))
    t0 = time.perf_counter()
    for _ in range(tokens):
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        nxt = out.logits[0, -1].argmax().view(1, 1)
        generated.append(int(nxt))
    decode_s = time.perf_counter() - t0
    return {
        "impl": "transformers",
        "dtype": dtype,
        "decode_tok_s": tokens / decode_s,
        "prompt_len": prompt_len,
        "new_tokens": tokens,
        "warmup_tokens": warmup,
        "decode_s": decode_s,
        "prefill_s": prefill_s,
        "load_s": t_load,
        "threads": torch.get_num_threads(),
        "weights": "nvfp4 dequantised (w4a16)" if info["qinfo"] else "bf16",
        "experts_implementation": experts,
        "ckpt": os.path.abspath(ckpt),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "generated_ids": generated,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--tokens", type=int, default=32, help="timed decode steps")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--dtype", choices=["bf16", "fp32", "both"], default="both")
    ap.add_argument("--threads", type=int, default=available_cores())
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps before the timed ones")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt ids")
    ap.add_argument("--experts", default="eager", help="transformers experts implementation (eager, grouped_mm, ...)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for dt in (["bf16", "fp32"] if args.dtype == "both" else [args.dtype]):
        res = bench(args.ckpt, dt, args.tokens, args.prompt_len, args.seed, args.experts, args.warmup)
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
