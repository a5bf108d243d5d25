#!/usr/bin/env python3
"""Golden draft logits of a GLM-5 MTP (NextN) layer, for kiln's draft programs.

transformers has no MTP forward (GlmMoeDsa ignores `model.layers.<num_hidden_layers>.*` on load), so
the golden composes transformers' own modules the way the serving engines run the layer (vLLM
`DeepSeekMultiTokenPredictorLayer`, SGLang `DeepseekModelNextN`; reference/glm5.md section 6):

  x_p      = eh_proj( cat([enorm(embed(t_{p+1})), hnorm(h_p)], -1) )     embedding first, hidden second
  y        = DecoderLayer_L(x)  over positions 0..n-2 (causal, its own DSA indexer and KV)
  hidden_p = shared_head.norm(y_p)
  logits_p = lm_head(hidden_p)                                            the main model's lm_head

where h_p is the main model's last hidden state after `model.norm` at position p and t the prompt. The
decoder layer, its masks, rope and the final norm are transformers' GlmMoeDsaModel with one sparse layer
(the MTP block's weights), `model.norm` = `shared_head.norm`, fed `inputs_embeds = x`.

The main model is the `bf16` case of make_goldens.py (same seed, so the same weights and prompt); this
script writes only what the MTP layer adds, under tests/goldens/bf16_mtp/:

  mtp.safetensors               the layer's tensors, `model.layers.4.*` (BF16; the bias F32), as
                                festr2/GLM-5-NVFP4-MTP ships layer 78 next to the main shards
  model.safetensors.index.json  weight map of the main `model.safetensors` (tests/goldens/bf16/ckpt) and
                                `mtp.safetensors`
  config.json                   the bf16 case's config with num_nextn_predict_layers = 1
  golden.safetensors            ids [n], logits_bf16 [n, vocab] (the main model, equal to the bf16 golden),
                                mtp_logits [n-1, vocab], mtp_hidden [n-1, hidden]
  golden.json                   description, seeds, margins, semantics

Tests assemble the checkpoint from both directories. Run with the python of make_goldens.py:
  python tests/oracle/make_mtp_golden.py [--out tests/goldens]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_goldens as mg  # noqa: E402

from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM  # noqa: E402

MTP_SEED = 7800  # first seed tried; steps of 10 until every top-k decision of the layer has a clear margin


def bf16(t: torch.Tensor) -> torch.Tensor:
    return mg.bf16_round(t)


def mtp_model(main_cfg: dict, seed: int):
    """A one-layer GlmMoeDsa model holding the MTP block (a sparse layer), plus the MTP-only weights."""
    cfg = dict(main_cfg, num_hidden_layers=1, first_k_dense_replace=0)
    model = GlmMoeDsaForCausalLM._from_config(
        GlmMoeDsaConfig(**cfg, **mg.GLM5_EXTRA_KEYS), attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )
    model.eval()
    mg.reinit_weights(model, seed)
    gen = torch.Generator().manual_seed(seed + 3)
    h = main_cfg["hidden_size"]
    extra = {
        "eh_proj.weight": bf16(torch.randn(h, 2 * h, generator=gen) / math.sqrt(2 * h)),
        "enorm.weight": bf16(torch.rand(h, generator=gen) * 0.4 + 0.8),
        "hnorm.weight": bf16(torch.rand(h, generator=gen) * 0.4 + 0.8),
    }
    return model, extra


@torch.no_grad()
def draft(main, model, extra, ids):
    """Draft logits and hidden rows for positions 0..n-2 (tokens ids[1:], the main model's hidden rows)."""
    hidden = main.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]  # after model.norm
    eps = main.config.rms_norm_eps

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    e = main.model.embed_tokens(ids[1:])
    x = torch.cat([rms(e, extra["enorm.weight"]), rms(hidden[:-1], extra["hnorm.weight"])], -1) @ extra["eh_proj.weight"].T
    rec = mg.TopkRecorder(model)
    with rec:
        out = model.model(inputs_embeds=x[None], use_cache=False).last_hidden_state[0]
    rec.remove()
    logits = main.lm_head(out)
    return logits.float(), out.float(), rec.margins(), hidden


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.normpath(os.path.join(here, "..", "goldens")))
    args = ap.parse_args()
    torch.set_num_threads(1)

    case, data, stored = mg.stored_bf16_case(args.out)
    main_model, ids = data["model"], data["ids"]
    main_logits = data["result"]["logits"]["logits_bf16"]
    # the same weights; the logits may differ in the last bits with another CPU's BLAS
    assert mg.rel_l2(main_logits, stored["logits_bf16"]) < 1e-6

    layer = case.config["num_hidden_layers"]
    for i in range(mg.MAX_SEED_TRIES):
        seed = MTP_SEED + 10 * i
        model, extra = mtp_model(case.config, seed)
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(main_model.model.embed_tokens.weight)
            model.lm_head.weight.copy_(main_model.lm_head.weight)
        logits, hidden, margins, _ = draft(main_model, model, extra, ids)
        worst = min(m["min_rel_gap"] for m in margins.values())
        print(f"  mtp: seed {seed}: smallest relative top-k margin {worst:.2e}", flush=True)
        if worst >= mg.MIN_REL_GAP:
            break
    else:
        raise RuntimeError("no MTP seed with clear top-k margins")

    # the layer's checkpoint tensors: the one-layer model's layer 0 as layer `layer`, its final norm as
    # shared_head.norm, and the MTP-only weights
    tensors = {}
    for name, t in mg.checkpoint_weights(model).items():
        if name.startswith("model.layers.0."):
            key = f"model.layers.{layer}." + name[len("model.layers.0."):]
        elif name == "model.norm.weight":
            key = f"model.layers.{layer}.shared_head.norm.weight"
        else:
            continue  # embedding and lm_head are the main model's
        tensors[key] = t.clone() if key.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
    for k, v in extra.items():
        tensors[f"model.layers.{layer}.{k}"] = v.to(torch.bfloat16)

    out_dir = os.path.join(args.out, "bf16_mtp")
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    save_file(dict(sorted(tensors.items())), os.path.join(out_dir, "mtp.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "bf16", "ckpt", "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    main_names = sorted(load_file(os.path.join(args.out, "bf16", "ckpt", "model.safetensors")))
    weight_map = {n: "model.safetensors" for n in main_names} | {n: "mtp.safetensors" for n in tensors}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        f.write("\n")
    golden = {"ids": ids.to(torch.int32), "logits_bf16": main_logits.contiguous(), "mtp_logits": logits.contiguous(), "mtp_hidden": hidden.contiguous()}
    save_file(golden, os.path.join(out_dir, "golden.safetensors"), metadata={"format": "pt"})
    meta = {
        "case": "bf16_mtp",
        "description": (
            "the bf16 case's model plus one MTP (NextN) layer stored as model.layers.4 (a sparse layer: 16 "
            "experts, 1 shared, its own DSA indexer with index_topk 8 < 23 draft positions, eh_proj, enorm, "
            "hnorm, shared_head.norm), all BF16; draft logits for positions 0..n-2"
        ),
        "generator": "tests/oracle/make_mtp_golden.py",
        "versions": mg.versions(),
        "seeds": {"main": case.seed, "mtp_layer": seed, "mtp_only_weights": seed + 3},
        "prompt_ids": ids.tolist(),
        "golden_tensors": {k: {"dtype": "I32" if k == "ids" else "F32", "shape": list(v.shape)} for k, v in golden.items()},
        "logit_stats": {"mtp_logits": mg.stats_of(logits)},
        "topk_margins": margins,
        "semantics": {
            "compute": "float32; every BF16 tensor used as its exact fp32 upcast",
            "draft": "row p (0..n-2): x_p = eh_proj(cat([enorm(embed(ids[p+1])), hnorm(h_p)])) with h_p the main "
            "model's hidden state after model.norm at p (RMSNorm eps = rms_norm_eps); then transformers' "
            "GlmMoeDsaModel with the MTP block as its only (sparse) layer over inputs_embeds x at positions "
            "0..n-2, causal, its final norm being shared_head.norm: mtp_hidden; mtp_logits = lm_head(mtp_hidden)",
            "no_position_zero_mask": "the embedding at position 0 is used as is (SGLang); vLLM zeroes it",
        },
        "tolerance_hints": {"mtp_logits": mg.TOLERANCE_HINTS["logits_bf16"]},
    }
    with open(os.path.join(out_dir, "golden.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(f"bf16_mtp: ok, mtp_logits std {float(logits.std()):.3f}, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
