#!/usr/bin/env python3
"""Train the demo model's MTP layer: a draft model for speculative decoding, as GLM-5 ships one.

GLM-5 stores one multi-token-prediction layer after its decoder layers (`model.layers.78`, BF16):
row p takes the token at p + 1 and the model's final hidden state at p (after `model.norm`),

    x = eh_proj(cat([enorm(embed(t_{p+1})), hnorm(h_p)]))  ->  one decoder layer  ->  shared_head.norm
      ->  the model's lm_head: a guess at t_{p+2}

(reference/glm5.md section 6; kiln compiles it with `kiln compile --draft mtp`). This script gives
artifacts/demo-model the same: the shipped model stays as it is (loaded NVFP4-dequantised by the
oracle's numpy reader, frozen, as W4A16); the MTP layer starts from the model's last decoder layer
(its attention, trained indexer, router and experts) with eh_proj passing the hidden half through,
and learns t_{p+2} on the training conversations' assistant tokens (the indexer stays as layer 3
trained it; its top-k picks are not differentiable). The embedding and lm_head are the model's and
stay frozen.

Writes into artifacts/demo-model: mtp.safetensors (`model.layers.4.*`, BF16, the correction bias
F32), the index's weight map, `num_nextn_predict_layers: 1` in config.json and `model.layers.4*` in
the NVFP4 exclude list (the layer stays BF16, as in nvidia/GLM-5-NVFP4), and an `mtp` entry in
train_log.json. The model's own tensors and answers do not change.

Usage: target/train-venv/bin/python scripts/demo_model/train_mtp.py [--steps 350] [--minutes M]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "oracle"))

import data  # noqa: E402
import make_goldens as mg  # noqa: E402
import npref  # noqa: E402
from render import Renderer  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM  # noqa: E402

CKPT = os.path.join(ROOT, "artifacts", "demo-model")
SPECIAL = ["<|endoftext|>", "<|user|>", "<|observation|>"]


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Mtp(torch.nn.Module):
    """The MTP layer: eh_proj, its norms, and a one-layer GlmMoeDsa model whose final norm is
    shared_head.norm."""

    def __init__(self, main):
        super().__init__()
        cfg = {k: v for k, v in main.config.to_dict().items() if k in GlmMoeDsaConfig().to_dict()}
        cfg.update(num_hidden_layers=1, first_k_dense_replace=0, mlp_layer_types=None, layer_types=None, indexer_types=None)
        self.block = GlmMoeDsaForCausalLM._from_config(
            GlmMoeDsaConfig(**cfg), attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
        ).model
        last = main.config.num_hidden_layers - 1
        src = {k[len(f"layers.{last}."):]: v for k, v in main.model.state_dict().items() if k.startswith(f"layers.{last}.")}
        self.block.layers[0].load_state_dict(src)
        self.block.norm.load_state_dict(main.model.norm.state_dict())
        h = main.config.hidden_size
        self.eps = main.config.rms_norm_eps
        self.enorm = torch.nn.Parameter(torch.ones(h))
        self.hnorm = torch.nn.Parameter(torch.ones(h))
        eh = torch.zeros(h, 2 * h)
        eh[:, :h].normal_(0.0, 0.02 * h ** -0.5)
        eh[:, h:] = torch.eye(h)
        self.eh_proj = torch.nn.Parameter(eh)
        self.block.embed_tokens = None  # the model's, passed in

    def forward(self, embeds, hidden):
        x = torch.cat([rms(embeds, self.enorm, self.eps), rms(hidden, self.hnorm, self.eps)], -1) @ self.eh_proj.T
        return self.block(inputs_embeds=x, use_cache=False).last_hidden_state

    def trainable(self):
        return [p for n, p in self.named_parameters() if ".indexer." not in n]


def encode(tok, renderer, conv) -> tuple[list[int], list[bool]]:
    """The conversation's ids and which are assistant tokens (the ones a draft is asked for)."""
    ids, learned = [], []
    for text, target in renderer.segments(conv):
        t = tok.encode(text, add_special_tokens=False).ids
        ids += t
        learned += [target] * len(t)
    return ids, learned


def batch(seqs, pad: int):
    """ids [n, L] right-padded and labels [n, L-2]: label j = ids[j+2] where that token is learned."""
    n, length = len(seqs), max(len(s) for s, _ in seqs)
    ids = torch.full((n, length), pad, dtype=torch.long)
    labels = torch.full((n, length - 2), -100, dtype=torch.long)
    for i, (s, t) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        for j in range(len(s) - 2):
            if t[j + 2]:
                labels[i, j] = s[j + 2]
    return ids, labels


def loss_and_hits(main, mtp, ids, labels):
    with torch.no_grad():
        hidden = main.model(input_ids=ids, use_cache=False).last_hidden_state  # after model.norm
        embeds = main.model.embed_tokens(ids[:, 1:-1])
    out = mtp(embeds, hidden[:, :-2])
    logits = main.lm_head(out)
    mask = labels != -100
    loss = F.cross_entropy(logits[mask], labels[mask])
    hits = (logits[mask].argmax(-1) == labels[mask]).sum().item()
    return loss, hits, int(mask.sum())


def draw(mix, rng, n):
    return [mix.greeting() if rng.random() < 0.1 else (mix.weather() if rng.random() < 0.25 else mix.arithmetic()) for _ in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=350, help="training steps (~12 min on 2 cores; the shipped layer: 349)")
    ap.add_argument("--minutes", type=float, default=0.0, help="stop after this long instead (0: no limit)")
    ap.add_argument("--batch", type=int, default=24, help="conversations per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=78)
    ap.add_argument("--out", default=CKPT)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    main_model, info = npref.load_model(CKPT, "float32")
    for p in main_model.parameters():
        p.requires_grad_(False)
    cfg = main_model.config
    tok = Tokenizer.from_file(os.path.join(CKPT, "tokenizer.json"))
    renderer = Renderer(os.path.join(CKPT, "chat_template.jinja"))
    pad = tok.token_to_id(SPECIAL[0])
    mtp = Mtp(main_model)
    opt = torch.optim.AdamW(mtp.trainable(), lr=args.lr, weight_decay=0.0)
    mix, rng = data.Mixture(args.seed), random.Random(args.seed)
    held = [encode(tok, renderer, c) for c in draw(data.Mixture(args.seed + 1000), random.Random(args.seed + 1000), 64)]

    def evaluate():
        mtp.eval()
        hits = total = 0
        with torch.no_grad():
            for i in range(0, len(held), 16):
                ids, labels = batch(held[i : i + 16], pad)
                _, h, n = loss_and_hits(main_model, mtp, ids, labels)
                hits, total = hits + h, total + n
        mtp.train()
        return hits / max(total, 1)

    start_acc = evaluate()
    print(f"held-out top-1 of the MTP layer before training: {start_acc:.3f}", flush=True)
    log, step, t0 = [], 0, time.time()
    while step < args.steps and (args.minutes == 0 or time.time() - t0 < args.minutes * 60):
        convs = sorted((encode(tok, renderer, c) for c in draw(mix, rng, args.batch)), key=lambda s: len(s[0]))
        opt.zero_grad()
        total_loss = 0.0
        for i in range(0, len(convs), 8):  # length-bucketed pieces of the step's batch
            ids, labels = batch(convs[i : i + 8], pad)
            loss, _, n = loss_and_hits(main_model, mtp, ids, labels)
            (loss * n / 1000.0).backward()
            total_loss += loss.item()
        opt.step()
        step += 1
        if step % 25 == 0:
            acc = evaluate() if step % 100 == 0 else None
            log.append({"step": step, "loss": round(total_loss / 3, 4), "held_out_top1": acc, "seconds": round(time.time() - t0)})
            print(log[-1], flush=True)
    final_acc = evaluate()
    print(f"held-out top-1 after {step} steps: {final_acc:.3f}", flush=True)
    export(mtp, cfg, args.out, {"steps": step, "minutes": round((time.time() - t0) / 60, 1), "seed": args.seed, "held_out_top1_before": round(start_acc, 4),
                                "held_out_top1": round(final_acc, 4), "log": log})


def export(mtp, cfg, out: str, summary: dict):
    layer = cfg.num_hidden_layers
    tensors = {}
    for name, t in mg.checkpoint_weights(mtp.block).items():
        if name.startswith("layers.0."):
            key = f"model.layers.{layer}." + name[len("layers.0."):]
        elif name == "norm.weight":
            key = f"model.layers.{layer}.shared_head.norm.weight"
        else:
            raise RuntimeError(f"unexpected MTP tensor {name}")
        tensors[key] = t.detach().clone() if key.endswith("e_score_correction_bias") else t.detach().to(torch.bfloat16)
    for k in ("eh_proj", "enorm", "hnorm"):
        tensors[f"model.layers.{layer}.{k}.weight"] = getattr(mtp, k).detach().to(torch.bfloat16)
    save_file(dict(sorted(tensors.items())), os.path.join(out, "mtp.safetensors"), metadata={"format": "pt"})

    def index(j):
        wm = {k: v for k, v in j["weight_map"].items() if not k.startswith(f"model.layers.{layer}.")}
        wm.update({k: "mtp.safetensors" for k in tensors})
        j["weight_map"] = dict(sorted(wm.items()))

    def exclude(j):
        excl = j["quantization"]["exclude_modules"]
        if f"model.layers.{layer}*" not in excl:
            excl.append(f"model.layers.{layer}*")

    # each file keeps the layout its writer gave it
    edit_json(os.path.join(out, "model.safetensors.index.json"), index, indent=2)
    edit_json(os.path.join(out, "config.json"), lambda j: j.update(num_nextn_predict_layers=1), indent=2, sort_keys=True)
    edit_json(os.path.join(out, "hf_quant_config.json"), exclude, indent=2)
    edit_json(os.path.join(out, "train_log.json"), lambda j: j.update(mtp=summary), indent=1)
    print(f"wrote {len(tensors)} MTP tensors to {out}")


def edit_json(path: str, edit, **layout):
    with open(path) as f:
        j = json.load(f)
    edit(j)
    with open(path, "w") as f:
        json.dump(j, f, **layout)
        f.write("\n")


if __name__ == "__main__":
    main()
