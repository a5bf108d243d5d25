#!/usr/bin/env python3
"""Train kiln's demo model: a small GLM-5-architecture (`glm_moe_dsa`) model that does 2-digit
arithmetic and calls a weather tool, on CPU, reproducibly (fixed seeds, one data stream).

transformers' own GlmMoeDsaForCausalLM is trained (eager attention, fp32), with three additions
it does not do by itself:
- the DSA indexer learns: transformers runs it under no_grad, so its random top-k would drop the
  tokens an answer needs. As in DeepSeek-V3.2, each layer's indexer gets a KL loss towards the
  main attention's distribution (summed over heads, detached; indexer inputs detached so the loss
  trains only the indexer): a dense stage first (every causal token attended), then the sparse
  stage with the real index_topk, the KL restricted to the selected tokens;
- the router's expert load is balanced without an auxiliary loss (DeepSeek-V3's bias update of
  e_score_correction_bias);
- quantisation-aware finishing: the last part of training sees every linear that ships as NVFP4
  (dense MLP, shared and routed experts) through NVFP4 fake quantisation of its BF16-rounded weight
  and of its input (per-16 blocks, static input scale from calibrated amax), with
  straight-through gradients, so the W4A4 model answers like the float one.

Outputs (--out, default target/demo-train): bf16/ (the checkpoint: per-expert tensors as in the
real GLM-5 layout, BF16, F32 e_score_correction_bias, config.json, tokenizer files, the chat
template), calibration.json (input amax of every NVFP4 linear, measured with the final weights on
training prompts, as ModelOpt calibrates) and train_log.json. `kiln quantize` turns bf16/ +
calibration.json into the shipped NVFP4 checkpoint (scripts/demo_model/train.sh does all of it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "oracle"))

import data  # noqa: E402
import tokenizer as demo_tokenizer  # noqa: E402
from render import Renderer, TEMPLATE_PATH  # noqa: E402
import make_goldens as mg  # noqa: E402  (NVFP4 primitives, checkpoint naming, calibration hooks)

import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as modeling  # noqa: E402

VOCAB = 768

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=32,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-5,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    num_nextn_predict_layers=0,
    pad_token_id=256,
    eos_token_id=[256, 263, 265],
)

SPECIAL = {t: 256 + i for i, t in enumerate(demo_tokenizer.SPECIAL_TOKENS)}
USER, OBSERVATION = SPECIAL["<|user|>"], SPECIAL["<|observation|>"]
EOS_IDS = [SPECIAL["<|endoftext|>"], USER, OBSERVATION]
PAD = SPECIAL["<|endoftext|>"]


# ---------------------------------------------------------------------------------------------
# rendering


# ---------------------------------------------------------------------------------------------
# model pieces kiln's training adds


def fq_weight(w: torch.Tensor) -> torch.Tensor:
    """NVFP4 fake quantisation of [..., N, K] weights (one global scale per [N, K] matrix) of their
    BF16 rounding, with a straight-through gradient."""
    wb = w.detach().to(torch.bfloat16).float()
    n, k = wb.shape[-2:]
    s2 = wb.abs().amax(dim=(-2, -1), keepdim=True) / (6.0 * 448.0)
    s2 = torch.where(s2 > 0, s2, torch.ones_like(s2))
    blocks = wb.reshape(*wb.shape[:-1], k // 16, 16)
    bmax = blocks.abs().amax(-1, keepdim=True)
    per = bmax / (6.0 * s2.unsqueeze(-1))
    per = torch.where(bmax == 0, torch.ones_like(per), per).clamp(min=2.0 ** -9)
    sf = mg.fp8_e4m3(per).float()
    step = sf * s2.unsqueeze(-1)
    q = mg.e2m1_decode(mg.e2m1_codes(blocks / step)) * step
    return w + (q.reshape(w.shape) - w).detach()


def fq_act(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    return x + (mg.fake_quant_act(x.detach(), input_scale) - x).detach()


class Quant:
    """QAT state: on/off, and the static input scale of every NVFP4 linear (checkpoint names)."""

    def __init__(self):
        self.on = False
        self.scale: dict[str, torch.Tensor] = {}


QUANT = Quant()


def qat_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' eager expert loop, with NVFP4 fake quantisation when QUANT.on."""
    final = torch.zeros_like(hidden_states)
    gate_up, down = self.gate_up_proj, self.down_proj
    prefix = getattr(self, "_ckpt_prefix", None)
    if QUANT.on:
        e, two_i, h = gate_up.shape
        gate_up = fq_weight(gate_up.reshape(e, 2, two_i // 2, h)).reshape(e, two_i, h)
        down = fq_weight(down)
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for idx in hit:
        idx = idx[0]
        if idx == self.num_experts:
            continue
        ei = int(idx)
        pos, tok = torch.where(mask[idx])
        x = hidden_states[tok]
        if QUANT.on:
            x = fq_act(x, QUANT.scale[f"{prefix}.{ei}.gate_proj"])
        g, u = F.linear(x, gate_up[idx]).chunk(2, dim=-1)
        y = self.act_fn(g) * u
        if QUANT.on:
            y = fq_act(y, QUANT.scale[f"{prefix}.{ei}.down_proj"])
        y = F.linear(y, down[idx]) * top_k_weights[tok, pos, None]
        final.index_add_(0, tok, y.to(final.dtype))
    return final


ALL_EXPERTS_FUNCTIONS.register("kiln_qat", qat_experts_forward)


class QatLinear(torch.nn.Module):
    """Wraps an nn.Linear that ships as NVFP4: fake-quantised weight and input when QUANT.on."""

    def __init__(self, inner: torch.nn.Linear, name: str):
        super().__init__()
        self.inner = inner
        self.name = name

    def forward(self, x):
        if not QUANT.on:
            return self.inner(x)
        return F.linear(fq_act(x, QUANT.scale[self.name]), fq_weight(self.inner.weight))


class IndexerState:
    """What the indexer hooks share with the training loop."""

    def __init__(self, n_layers):
        self.dense = True  # dense stage: every causal token selected
        self.scores = [None] * n_layers  # [B, S, T] indexer scores with gradient (masked)
        self.selected = [None] * n_layers  # [B, S, T] bool: tokens the attention saw
        self.attn = [None] * n_layers  # [B, H, S, T] attention probabilities (detached)


def indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=None):
    """GlmMoeDsaIndexer.forward with gradients for its own weights (inputs detached), and the
    dense stage's select-everything."""
    st: IndexerState = self._kiln_state
    b, s, _ = hidden_states.shape
    x, qr = hidden_states.detach(), q_resid.detach()
    cos, sin = position_embeddings
    q = self.wq_b(qr).view(b, s, self.n_heads, self.head_dim)
    q_rot, q_pass = torch.split(q, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
    k = self.k_norm(self.wk(x)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    if cache is not None:
        k = cache.update_indexer(k.detach(), self.layer_idx)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale)
    weights = self.weights_proj(x).float() * (self.n_heads ** -0.5)
    index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, S, T]
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    index = index.masked_fill(~allowed, float("-inf"))
    t = index.shape[-1]
    topk = t if st.dense else min(self.index_topk, t)
    idx = index.detach().topk(topk, dim=-1).indices
    if self.training:
        sel = torch.zeros_like(allowed).scatter(-1, idx, True) & allowed
        st.scores[self.layer_idx] = index
        st.selected[self.layer_idx] = sel
    return idx.to(torch.int32)


def attention_hook(layer_idx, state: IndexerState):
    def hook(module, args, output):
        if module.training and output[1] is not None:
            state.attn[layer_idx] = output[1].detach()
    return hook


def indexer_kl(state: IndexerState, token_mask: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Mean over layers and real query tokens of KL(attention || softmax(indexer)) over the tokens
    the attention saw; also the indexer's recall of the attention mass in the dense stage."""
    losses, recalls = [], []
    for scores, sel, attn in zip(state.scores, state.selected, state.attn):
        p = attn.sum(1)  # [B, S, T]
        p = p * sel
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
        logq = torch.log_softmax(scores.masked_fill(~sel, float("-inf")), dim=-1)
        kl = (p * (torch.log(p.clamp(min=1e-9)) - logq.masked_fill(~sel, 0.0))).sum(-1)  # [B, S]
        losses.append((kl * token_mask).sum() / token_mask.sum())
        with torch.no_grad():
            top = scores.detach().topk(min(CONFIG["index_topk"], scores.shape[-1]), dim=-1).indices
            mass = torch.gather(attn.sum(1) / attn.shape[1], -1, top).sum(-1)
            recalls.append(float((mass * token_mask).sum() / token_mask.sum()))
    return torch.stack(losses).mean(), sum(recalls) / len(recalls)


def router_hooks(model, loads):
    handles = []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            def hook(mod, args, out, i=i):
                loads[i] = loads.get(i, 0) + torch.bincount(out[2].reshape(-1), minlength=mod.num_experts).float()
            handles.append(layer.mlp.gate.register_forward_hook(hook))
    return handles


def balance(model, loads, rate):
    """DeepSeek-V3's auxiliary-loss-free balancing: nudge each expert's selection bias against its load."""
    with torch.no_grad():
        for i, load in loads.items():
            bias = model.model.layers[i].mlp.gate.e_score_correction_bias
            bias += rate * torch.sign(load.mean() - load)
    loads.clear()


def build_model(seed: int) -> GlmMoeDsaForCausalLM:
    torch.manual_seed(seed)
    cfg = GlmMoeDsaConfig(**CONFIG, **mg.GLM5_EXTRA_KEYS)
    model = GlmMoeDsaForCausalLM._from_config(cfg, attn_implementation="eager", experts_implementation="kiln_qat",
                                              dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith("k_norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name == "model.embed_tokens.weight":
                p.normal_(0.0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            else:
                raise RuntimeError(f"no init for {name}")
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.zero_()
                layer.mlp.experts._ckpt_prefix = f"model.layers.{i}.mlp.experts"
    # NVFP4-shipped nn.Linears behind a QAT wrapper (checkpoint names kept by unwrapping at export).
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp if model.config.mlp_layer_types[i] == "dense" else layer.mlp.shared_experts
        base = f"model.layers.{i}.mlp" + ("" if model.config.mlp_layer_types[i] == "dense" else ".shared_experts")
        for m in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, m, QatLinear(getattr(mlp, m), f"{base}.{m}"))
    state = IndexerState(len(model.model.layers))
    for i, layer in enumerate(model.model.layers):
        ind = layer.self_attn.indexer
        ind._kiln_state = state
        ind.forward = indexer_forward.__get__(ind)
        layer.self_attn.register_forward_hook(attention_hook(i, state))
    model._kiln_state = state
    return model


def unwrapped_state_dict(model) -> dict[str, torch.Tensor]:
    return {k.replace(".inner.", "."): v for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# data


class Batches:
    def __init__(self, tok, renderer, seed):
        self.tok, self.renderer = tok, renderer
        self.mix = data.Mixture(seed)
        self.rng = random.Random(f"batches-{seed}")

    def encode(self, conv):
        prompt, target, stop = self.renderer.example(conv, OBSERVATION, USER)
        p = self.tok.encode(prompt, add_special_tokens=False).ids
        t = self.tok.encode(target, add_special_tokens=False).ids + [stop]
        return p, t

    def next(self, tokens_per_batch: int):
        r = self.rng.random()
        if r < 0.62:
            convs_fn, per = self.mix.arithmetic, 60
        elif r < 0.95:
            convs_fn, per = self.mix.weather, 330
        else:
            convs_fn, per = self.mix.greeting, 40
        n = max(1, tokens_per_batch // per)
        seqs = [self.encode(convs_fn()) for _ in range(n)]
        length = max(len(p) + len(t) for p, t in seqs)
        ids = torch.full((n, length), PAD, dtype=torch.long)
        labels = torch.full((n, length), -100, dtype=torch.long)
        attn = torch.zeros((n, length), dtype=torch.long)
        for i, (p, t) in enumerate(seqs):
            s = p + t
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
            # labels[j] is the token at j + 1: only the reply's tokens are learned
            labels[i, len(p) - 1 : len(s) - 1] = torch.tensor(t)
        return ids, labels, attn


# ---------------------------------------------------------------------------------------------
# evaluation (greedy, through transformers' cache)


@torch.no_grad()
def generate(model, ids: list[int], max_new: int) -> list[int]:
    cache = DynamicCache(config=model.config)
    out = []
    x = torch.tensor([ids])
    for _ in range(max_new):
        logits = model(input_ids=x, cache=cache, use_cache=True).logits[0, -1]
        nxt = int(logits.argmax())
        out.append(nxt)
        if nxt in EOS_IDS:
            break
        x = torch.tensor([[nxt]])
    return out


def reply_text(tok, ids):
    return tok.decode([i for i in ids if i not in EOS_IDS], skip_special_tokens=False)


def split_reply(text: str, thinking: bool) -> tuple[str, str]:
    if thinking and "</think>" in text:
        r, c = text.split("</think>", 1)
        return r.strip(), c.strip()
    return "", text.strip()


@torch.no_grad()
def evaluate(model, tok, renderer, n_arith=30, n_weather=12, quantised=False) -> dict:
    was = model.training
    model.eval()
    QUANT.on = quantised
    res = {}
    for thinking in (True, False):
        good = 0
        for item in data.draw_eval_arith(n_arith, seed=11):
            conv = {"messages": [{"role": "user", "content": item["question"]}], "tools": None, "thinking": thinking}
            prompt = renderer.render(conv["messages"], None, thinking, True)
            text = reply_text(tok, generate(model, tok.encode(prompt, add_special_tokens=False).ids, 96))
            reasoning, content = split_reply(text, thinking)
            good += data.check_arith_answer(content, item["answer"]) and (bool(reasoning) == thinking)
        res["arith_think" if thinking else "arith_nothink"] = good / n_arith
    calls = answers = 0
    for item in data.draw_eval_weather(n_weather, seed=12):
        msgs = [{"role": "user", "content": item["question"]}]
        prompt = renderer.render(msgs, [data.WEATHER_TOOL], True, True)
        text = reply_text(tok, generate(model, tok.encode(prompt, add_special_tokens=False).ids, 64))
        want = f"<tool_call>get_weather<arg_key>city</arg_key><arg_value>{item['city']}</arg_value></tool_call>"
        calls += split_reply(text, True)[1] == want
        result = data.weather_result(item["city"])
        msgs += [{"role": "assistant", "content": "", "tool_calls": [data.tool_call(item["city"])]},
                 {"role": "tool", "content": json.dumps(result)}]
        prompt = renderer.render(msgs, [data.WEATHER_TOOL], True, True)
        text = reply_text(tok, generate(model, tok.encode(prompt, add_special_tokens=False).ids, 64))
        answers += data.check_weather_answer(split_reply(text, True)[1], result)
    res["weather_call"] = calls / n_weather
    res["weather_answer"] = answers / n_weather
    QUANT.on = False
    model.train(was)
    return res


# ---------------------------------------------------------------------------------------------
# calibration and export


class CalibHooks(mg.ActHooks):
    """make_goldens' amax observer on this model's layout (QAT wrappers, kiln_qat experts)."""

    def __init__(self, model):
        self.model = model
        self.mode = "calib"
        self.amax = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            dense = model.config.mlp_layer_types[i] == "dense"
            mlp = layer.mlp if dense else layer.mlp.shared_experts
            for m in ("gate_proj", "up_proj", "down_proj"):
                w = getattr(mlp, m)
                self.handles.append(w.register_forward_pre_hook(self._linear_hook(w.name)))
            if not dense:
                layer.mlp.experts._oracle_act = self._expert_hook(f"model.layers.{i}.mlp")


@torch.no_grad()
def calibrate(model, batches: Batches, n_batches: int, qnames: list[str]) -> dict[str, float]:
    was = model.training
    model.eval()
    hooks = CalibHooks(model)
    model.set_experts_implementation("kiln_oracle")
    for _ in range(n_batches):
        ids, _, attn = batches.next(2048)
        model(input_ids=ids, attention_mask=attn, use_cache=False)
    model.set_experts_implementation("kiln_qat")
    hooks.remove()
    amax = {}
    for q in qnames:
        a = hooks.amax.get(q, 0.0)
        if a == 0.0:  # an expert no calibration token reached: its layer's largest for that projection
            pre, _, proj = q.rsplit(".", 2)
            a = max(v for k, v in hooks.amax.items() if k.startswith(pre + ".") and k.endswith("." + proj))
        amax[q] = a
    model.train(was)
    return amax


def export(model, out_dir: str, tok_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    weights = mg.checkpoint_weights(model)
    weights = {k.replace(".inner.", "."): v for k, v in weights.items()}
    tensors = {}
    for k, v in weights.items():
        tensors[k] = v.float().contiguous() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16).contiguous()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    case = mg.Case(name="demo", description="", seed=0, n_prompt=0, quant="bf16", quant_config_form=None, config=CONFIG)
    mg.write_config(model, case, out_dir)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(tok_dir, f), os.path.join(out_dir, f))
    shutil.copy(TEMPLATE_PATH, os.path.join(out_dir, "chat_template.jinja"))


# ---------------------------------------------------------------------------------------------


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "target", "demo-train"))
    ap.add_argument("--minutes", type=float, default=40.0, help="training time budget (steps adapt to it)")
    ap.add_argument("--steps", type=int, default=0, help="fixed step count instead of --minutes")
    ap.add_argument("--tokens-per-batch", type=int, default=3072)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dense-frac", type=float, default=0.35, help="fraction of steps with dense attention")
    ap.add_argument("--qat-frac", type=float, default=0.25, help="final fraction of steps with NVFP4 fake quant")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a 2-minute run of everything")
    args = ap.parse_args()
    if args.smoke:
        args.minutes, args.eval_every = 2.0, 0
    torch.set_num_threads(2)
    random.seed(args.seed)
    np.random.seed(args.seed)
    t0 = time.time()

    renderer = Renderer()
    tok_dir = os.path.join(args.out, "tokenizer")
    mix = data.Mixture(args.seed + 1)
    corpus = []
    for _ in range(3000):
        for conv in (mix.arithmetic(), mix.weather(), mix.greeting()):
            p, t, _ = renderer.example(conv, OBSERVATION, USER)
            corpus.append(p + t)
    tok_json, used = demo_tokenizer.build(corpus, VOCAB)
    tok = demo_tokenizer.write(tok_dir, tok_json, CONFIG["max_position_embeddings"])
    for text in corpus[:300]:
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text
    print(f"tokenizer: {used} of {VOCAB} ids used ({time.time() - t0:.0f}s)", flush=True)

    model = build_model(args.seed)
    model.train()
    state: IndexerState = model._kiln_state
    batches = Batches(tok, renderer, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    loads = {}
    router_hooks(model, loads)
    qnames = [q.replace(".inner", "") for q in mg.quantized_linears(model)]

    budget = args.minutes * 60
    total = args.steps or 10_000_000
    log, step, started = [], 0, time.time()
    qat_started = None
    est_total = args.steps or None
    while True:
        elapsed = time.time() - started
        if args.steps and step >= args.steps:
            break
        if not args.steps and elapsed >= budget:
            break
        # Stage boundaries by progress (time or steps).
        progress = step / args.steps if args.steps else elapsed / budget
        state.dense = progress < args.dense_frac
        if progress >= 1 - args.qat_frac and qat_started is None:
            qat_started = step
            amax = calibrate(model, batches, 6, qnames)
            QUANT.scale = {k: torch.tensor(v / (6 * 448), dtype=torch.float32) for k, v in amax.items()}
            print(f"step {step}: QAT on (input scales from {len(amax)} calibrated amax)", flush=True)
        QUANT.on = qat_started is not None
        if not args.steps and step >= 20:
            est_total = int(step * budget / elapsed)
        lr = lr_at(step, est_total or total, args.lr, 100)
        for g in opt.param_groups:
            g["lr"] = lr
        ids, labels, attn = batches.next(args.tokens_per_batch)
        out = model(input_ids=ids, attention_mask=attn, use_cache=False)
        lm = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        kl, recall = indexer_kl(state, attn.float())
        loss = lm + kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balance(model, loads, 1e-3)
        QUANT.on = False
        step += 1
        if step % 25 == 0 or step == 1:
            rec = {"step": step, "s": round(time.time() - started, 1), "lm": round(lm.item(), 4),
                   "kl": round(kl.item(), 4), "recall32": round(recall, 3), "lr": round(lr, 6),
                   "dense": state.dense, "qat": qat_started is not None, "seq": ids.shape[1], "batch": ids.shape[0]}
            eta = (est_total - step) * (time.time() - started) / step if est_total else 0
            print(json.dumps(rec) + f"  eta {eta / 60:.1f} min", flush=True)
            log.append(rec)
        if args.eval_every and step % args.eval_every == 0:
            ev = evaluate(model, tok, renderer, n_arith=20, n_weather=6)
            print(f"step {step} eval: {ev}", flush=True)
            log.append({"step": step, "eval": ev})
    train_s = time.time() - started

    amax = calibrate(model, batches, 12, qnames)
    QUANT.scale = {k: torch.tensor(v / (6 * 448), dtype=torch.float32) for k, v in amax.items()}
    n_eval = (8, 4) if args.smoke else (60, 20)
    final = {"float": evaluate(model, tok, renderer, *n_eval),
             "nvfp4_w4a4": evaluate(model, tok, renderer, *n_eval, quantised=True)}
    print(f"final eval: {final}", flush=True)

    export(model, os.path.join(args.out, "bf16"), tok_dir)
    with open(os.path.join(args.out, "calibration.json"), "w") as f:
        json.dump(amax, f, indent=1, sort_keys=True)
        f.write("\n")
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump({"seed": args.seed, "args": vars(args), "config": CONFIG, "steps": step, "train_seconds": train_s,
                   "total_seconds": time.time() - t0, "qat_from_step": qat_started,
                   "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                "python": platform.python_version()},
                   "final_eval": final, "log": log}, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out} in {(time.time() - t0) / 60:.1f} min ({step} steps)", flush=True)


if __name__ == "__main__":
    main()
