#!/usr/bin/env python3
"""Golden logits of the bf16 case with the DSA indexer's keys cached as FP8, for `kiln compile
--indexer-keys fp8`.

transformers keeps the indexer keys in the model dtype. DeepSeek's reference, SGLang and vLLM cache them
as FP8 E4M3 with one power-of-two scale per token (reference/glm5.md section 2.4: `act_quant(k, 128,
scale_fmt="ue8m0")`); kiln's fp8 option does the same to the keys only (queries stay f32). This script
runs transformers' own GlmMoeDsa model of the bf16 case (make_goldens.py, same seed: the same weights and
prompt) with every key the indexer scores replaced by its FP8 value, in f32:

  s      = 2 ** ceil(log2(amax(|k|) / 448))          per token, over the key's 128 (here 16) values after RoPE
  k_fp8  = float8_e4m3fn(k / s).float() * s          torch's own E4M3 rounding (to nearest even)

The key reaches the cache through the indexer's `cache.update_indexer(k, layer)` call; with
`use_cache=False` there is no cache, so a forward pre-hook hands each indexer a stand-in whose
`update_indexer` returns the quantised key (the whole prompt is one forward, so every key scored is one of
this forward's). Everything else is transformers' computation unchanged.

Writes tests/goldens/bf16_fp8_keys/golden.safetensors (ids, logits_fp8_keys [n, vocab]) and golden.json
(the smallest top-k margins of the indexer's choices under FP8 keys, and how far these logits are from
the bf16 golden's). Run with the python of make_goldens.py:
  python tests/oracle/make_fp8_keys_golden.py [--out tests/goldens]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_goldens as mg  # noqa: E402

E4M3_MAX = 448.0
# kiln checks this golden at f32 only (its bf16 storage would move every key's FP8 rounding), where
# scores differ from torch's by summation order, ~1e-7 relative: a top-k decision 100x that apart
# cannot flip (make_goldens.py's 1e-3 is for bf16 storage's 2^-9 rounding)
MIN_F32_REL_GAP = 1e-5


def fp8_key(k: torch.Tensor) -> torch.Tensor:
    """Each row (a token's key) as its E4M3 codes times the smallest power of two scale that fits."""
    amax = k.abs().amax(dim=-1, keepdim=True).float()
    mantissa, exponent = torch.frexp(amax / E4M3_MAX)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    one = torch.ones_like(amax)
    scale = torch.where(mantissa == 0.5, torch.ldexp(one, exponent - 1), torch.ldexp(one, exponent))
    scale = torch.where(amax > 0, scale, one)
    return (k.float() / scale).to(torch.float8_e4m3fn).float() * scale


class Fp8KeyCache:
    """Stands in for the cache the indexer would store its keys in: hands back their FP8 values."""

    def __init__(self):
        self.keys = 0

    def update_indexer(self, k: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.keys += k.shape[-2]
        return fp8_key(k).to(k.dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.normpath(os.path.join(here, "..", "goldens")))
    args = ap.parse_args()
    torch.set_num_threads(1)

    case, data, stored = mg.stored_bf16_case(args.out)
    model, ids = data["model"], data["ids"]

    cache = Fp8KeyCache()
    indexers = [m for m in model.modules() if type(m).__name__.endswith("Indexer")]
    assert indexers, "no indexer modules"
    hooks = [m.register_forward_pre_hook(lambda mod, a, kw: (a, dict(kw, cache=cache)), with_kwargs=True) for m in indexers]
    with torch.no_grad():
        logits, margins = mg.run_logits(model, ids, record_topk=True)
    for h in hooks:
        h.remove()
    layers = case.config["num_hidden_layers"]
    assert cache.keys == layers * len(ids), f"{cache.keys} keys quantised, expected {layers} layers x {len(ids)} tokens"
    worst = min(m["min_rel_gap"] for m in margins.values())
    print(f"fp8 keys: smallest relative top-k margin {worst:.2e}; logits {mg.rel_l2(logits, stored['logits_bf16']):.2e} from the bf16 golden")
    assert worst >= MIN_F32_REL_GAP, f"a top-k decision is too close to call under FP8 keys: {margins}"

    out_dir = os.path.join(args.out, "bf16_fp8_keys")
    os.makedirs(out_dir, exist_ok=True)
    golden = {"ids": ids.to(torch.int32), "logits_fp8_keys": logits.contiguous()}
    save_file(golden, os.path.join(out_dir, "golden.safetensors"), metadata={"format": "pt"})
    per_row = [mg.rel_l2(a, b) for a, b in zip(logits, stored["logits_bf16"])]
    meta = {
        "description": "the bf16 case (tests/goldens/bf16/ckpt) with the indexer keys cached as FP8 E4M3 with a power-of-two scale per token, in f32",
        "generator": "tests/oracle/make_fp8_keys_golden.py",
        "versions": mg.versions(),
        "seed": case.seed,
        "prompt_ids": ids.tolist(),
        "golden_tensors": {k: {"dtype": "I32" if k == "ids" else "F32", "shape": list(v.shape)} for k, v in golden.items()},
        "semantics": {
            "key": "k = cat(RoPE(k_norm(wk(x))[:rope]), k_norm(wk(x))[rope:]); s = 2**ceil(log2(amax|k| / 448)) (1 for a zero key); k_fp8 = e4m3(k / s) * s, rounding to nearest even",
            "query": "unchanged (f32)",
        },
        "topk_margins": margins,
        "min_rel_gap_required": MIN_F32_REL_GAP,
        "rel_l2_to_bf16_golden": {"max": max(per_row), "median": sorted(per_row)[len(per_row) // 2]},
    }
    with open(os.path.join(out_dir, "golden.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"wrote {out_dir}")


if __name__ == "__main__":
    main()
