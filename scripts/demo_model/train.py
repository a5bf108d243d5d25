#!/usr/bin/env python3
"""Train kiln's demo model: a small GLM-5-architecture (`glm_moe_dsa`) model that does 2-digit
arithmetic and calls a weather tool, on CPU, reproducibly (fixed seeds, one data stream, a fixed
step count by default).

transformers' own GlmMoeDsaForCausalLM is trained (eager attention, fp32) with these additions:
- the DSA indexer learns: transformers runs it under no_grad, so its random top-k would drop the
  tokens an answer needs. As in DeepSeek-V3.2, each layer's indexer gets a KL loss towards the
  main attention's distribution (summed over heads, renormalised, detached; the indexer's inputs
  detached, so the loss trains only the indexer): a dense stage first (every causal token
  selected), then the sparse stage with the real index_topk and the KL over the selected tokens.
  Recall (the share of the dense attention mass inside the indexer's top-k) is measured and logged;
- the router's expert load is balanced without an auxiliary loss (DeepSeek-V3's update of
  e_score_correction_bias against each expert's load);
- quantisation-aware finishing: the last part of training sees every linear that ships as NVFP4
  (dense MLP, shared and routed experts) through NVFP4 fake quantisation of its BF16-rounded weight
  and of its input (per-16 blocks, static input scale = calibrated amax / (6*448)), with
  straight-through gradients, so the W4A4 model answers like the float one.
Speed (2 CPU cores): every tool conversation starts with the same ~290-token system prompt, so
each step runs it once and continues all tool conversations from its (batch-expanded) KV cache
with gradients through it; the indexer is computed with large matmuls; experts loop over sorted
tokens; evaluation decodes whole batches with a KV cache.

Outputs (--out, default target/demo-train): bf16/ (the checkpoint: per-expert tensors as in the
real GLM-5 layout, BF16, F32 e_score_correction_bias, config.json, tokenizer files, the chat
template), calibration.json (input amax of every NVFP4 linear, measured with the final weights on
training conversations, as ModelOpt calibrates) and train_log.json. `kiln quantize` turns bf16/ +
calibration.json into the shipped NVFP4 checkpoint (scripts/demo_model/train.sh does all of it).
"""

from __future__ import annotations

import argparse
import copy
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
import make_goldens as mg  # noqa: E402  (NVFP4 primitives, checkpoint naming, calibration hooks, config)

import safetensors  # noqa: E402
import tokenizers  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as modeling  # noqa: E402

VOCAB = 512

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
THINK_END = SPECIAL["</think>"]


# ---------------------------------------------------------------------------------------------
# NVFP4 quantisation-aware training (make_goldens' ModelOpt-exact primitives, straight-through)


def e2m1_round(q: torch.Tensor) -> torch.Tensor:
    """The E2M1 value nearest to q (ties to the even code, |q| > 6 saturates to 6), by arithmetic:
    the same values as mg.e2m1_decode(mg.e2m1_codes(q)) up to the sign of zero, several times faster."""
    mag = q.abs()
    r = torch.where(mag < 2.0, torch.round(mag * 2.0) * 0.5,
                    torch.where(mag < 4.0, torch.round(mag), (torch.round(mag * 0.5) * 2.0).clamp(max=6.0)))
    return torch.copysign(r, q)


def fake_quant_act_fast(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """mg.fake_quant_act (NVFP4 activation fake quantisation, per 16 along the last dim) with
    e2m1_round: the same values, in the same fp32 operation order."""
    shape = x.shape
    xb = x.reshape(-1, shape[-1] // mg.GROUP, mg.GROUP)
    inv = torch.tensor(1.0, dtype=torch.float32) / input_scale
    sf = mg.fp8_e4m3((inv * xb.abs().amax(-1, keepdim=True)) / 6.0).to(torch.float32)
    q = torch.where(sf > 0, (xb * inv) / sf, torch.zeros_like(xb))
    return ((e2m1_round(q) * sf) * input_scale).reshape(shape)


def fq_weight(w: torch.Tensor) -> torch.Tensor:
    """NVFP4 fake quantisation of [..., N, K] weights (one global scale per [N, K] matrix) of their
    BF16 rounding, with a straight-through gradient (as mg.quantize_weight + dequantize_weight)."""
    wb = w.detach().to(torch.bfloat16).float()
    k = wb.shape[-1]
    s2 = wb.abs().amax(dim=(-2, -1), keepdim=True) / (6.0 * 448.0)
    s2 = torch.where(s2 > 0, s2, torch.ones_like(s2))
    blocks = wb.reshape(*wb.shape[:-1], k // mg.GROUP, mg.GROUP)
    bmax = blocks.abs().amax(-1, keepdim=True)
    per = bmax / (6.0 * s2.unsqueeze(-1))
    per = torch.where(bmax == 0, torch.ones_like(per), per).clamp(min=2.0 ** -9)
    sf = mg.fp8_e4m3(per).float()
    q = (e2m1_round(blocks / (sf * s2.unsqueeze(-1))) * sf) * s2.unsqueeze(-1)
    return w + (q.reshape(w.shape) - w).detach()


def fq_act(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Activation fake quantisation with a straight-through gradient (training: the fast version;
    evaluation without gradients: make_goldens' own)."""
    if not torch.is_grad_enabled():
        return mg.fake_quant_act(x, input_scale)
    return x + (fake_quant_act_fast(x.detach(), input_scale) - x).detach()


class Quant:
    """weights: fake-quantise NVFP4 weights on the fly (QAT); acts: fake-quantise their inputs with
    the static input scales (checkpoint module name -> scale)."""

    def __init__(self):
        self.weights = False
        self.acts = False
        self.scale: dict[str, torch.Tensor] = {}
        self.cache: dict[int, tuple] = {}  # fake-quantised weights of this step (cleared every step)

    def weight(self, module, make):
        if id(module) not in self.cache:
            self.cache[id(module)] = make()
        return self.cache[id(module)]


QUANT = Quant()


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' eager experts, tokens sorted by expert, with NVFP4 fake quantisation."""
    n, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=self.num_experts).tolist()
    tok = order // k
    x_all = hidden_states[tok]
    gate_up, down = self.gate_up_proj, self.down_proj
    if QUANT.weights:
        e, two_i, h = gate_up.shape
        gate_up, down = QUANT.weight(self, lambda: (
            fq_weight(gate_up.reshape(e, 2, two_i // 2, h)).reshape(e, two_i, h), fq_weight(down)))
    prefix = self._ckpt_prefix
    outs, start = [], 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        x = x_all[start:start + c]
        if QUANT.acts:
            x = fq_act(x, QUANT.scale[f"{prefix}.{e}.gate_proj"])
        g, u = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        y = self.act_fn(g) * u
        if QUANT.acts:
            y = fq_act(y, QUANT.scale[f"{prefix}.{e}.down_proj"])
        outs.append(F.linear(y, down[e]))
        start += c
    y = torch.cat(outs) * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden_states).index_add_(0, tok, y.to(hidden_states.dtype))


ALL_EXPERTS_FUNCTIONS.register("kiln_train", experts_forward)


class QatLinear(torch.nn.Module):
    """Wraps an nn.Linear that ships as NVFP4 (dense MLP, shared experts)."""

    def __init__(self, inner: torch.nn.Linear, name: str):
        super().__init__()
        self.inner = inner
        self.name = name

    def forward(self, x):
        w = QUANT.weight(self, lambda: fq_weight(self.inner.weight)) if QUANT.weights else self.inner.weight
        if QUANT.acts:
            x = fq_act(x, QUANT.scale[self.name])
        return F.linear(x, w)


# ---------------------------------------------------------------------------------------------
# DSA: the indexer with gradients, its KL loss and its recall


class DsaState:
    """What the indexer and attention share with the training loop."""

    def __init__(self, topk: int):
        self.topk = topk
        self.dense = True  # dense stage: every causal token selected
        self.collect = False  # keep (index scores, selection, attention) for the KL loss
        self.measure = False  # measure the dense attention mass inside the indexer's top-k
        self.qmask = None  # [B, S] real query tokens of the current forward
        self.pending = {}  # layer -> (index scores [B,S,T], allowed [B,S,T], selected [B,S,T])
        self.records = []  # (index, selected, attention summed over heads, qmask)
        self.recall_sum = 0.0
        self.recall_n = 0

    def take_recall(self):
        r = self.recall_sum / self.recall_n if self.recall_n else None
        self.recall_sum, self.recall_n = 0.0, 0
        return r


def indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=None):
    """GlmMoeDsaIndexer.forward (same math, larger matmuls) with gradients for the indexer's own
    weights when collecting (its inputs detached), and the dense stage's select-everything."""
    st: DsaState = self._kiln_state
    b, s, _ = hidden_states.shape
    nh, hd, rd = self.n_heads, self.head_dim, self.qk_rope_head_dim
    with torch.set_grad_enabled(st.collect and torch.is_grad_enabled()):
        x, qr = hidden_states.detach(), q_resid.detach()
        cos, sin = position_embeddings
        q = self.wq_b(qr).view(b, s, nh, hd)
        q_rot, q_pass = torch.split(q, [rd, hd - rd], dim=-1)
        k = self.k_norm(self.wk(x)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [rd, hd - rd], dim=-1)
        q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        if cache is not None:
            k = cache.update_indexer(k, self.layer_idx)
        t = k.shape[1]
        scores = F.relu(torch.bmm(q.reshape(b, s * nh, hd), k.transpose(1, 2)).view(b, s, nh, t) * self.softmax_scale)
        weights = self.weights_proj(x).float() * (nh ** -0.5)
        index = (scores * weights.unsqueeze(-1)).sum(2)  # [B, S, T]
        if attention_mask.dtype == torch.bool:
            allowed = attention_mask
        else:
            allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
        allowed = allowed.expand(b, s, t)
        index = index.masked_fill(~allowed, float("-inf"))
    if st.dense:
        idx = torch.arange(t).expand(b, s, t)
        sel = allowed
    else:
        idx = index.detach().topk(min(self.index_topk, t), dim=-1).indices
        sel = torch.zeros_like(allowed).scatter(-1, idx, True) & allowed
    if st.collect or st.measure:
        st.pending[self.layer_idx] = (index, allowed, sel)
    return idx.to(torch.int32)


def eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention (num_key_value_groups == 1), recording for the indexer."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    masked = scores
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            masked = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            masked = scores + attention_mask
    probs = F.softmax(masked, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    st = getattr(module, "_kiln_state", None)
    if st is not None and module.layer_idx in st.pending:
        index, allowed, sel = st.pending.pop(module.layer_idx)
        with torch.no_grad():
            p = probs.detach().sum(1)  # [B, S, T]
            if st.measure:
                dense = p if st.dense else F.softmax(
                    scores.detach().masked_fill(~allowed.unsqueeze(1), float("-inf")), dim=-1).sum(1)
                dense = dense / probs.shape[1]  # averaged over heads
                rows = (allowed.sum(-1) > st.topk) & (st.qmask > 0)
                if rows.any():
                    top = index.detach().topk(st.topk, dim=-1).indices
                    mass = torch.gather(dense, -1, top).sum(-1)
                    st.recall_sum += float(mass[rows].sum())
                    st.recall_n += int(rows.sum())
        if st.collect and torch.is_grad_enabled():
            st.records.append((index, sel, p, st.qmask))
    return out, probs


modeling.eager_attention_forward = eager_attention  # looked up by GlmMoeDsaAttention.forward at call time


def indexer_kl(records) -> torch.Tensor:
    """Mean over layers and real query tokens of KL(attention || softmax(indexer scores)), both over
    the tokens the attention saw (all causal tokens in the dense stage)."""
    total, count = 0.0, 0.0
    for index, sel, p, qmask in records:
        p = p * sel
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
        logq = torch.log_softmax(index.masked_fill(~sel, float("-inf")), dim=-1)
        kl = (p * (torch.log(p.clamp(min=1e-9)) - logq.masked_fill(~sel, 0.0))).sum(-1)  # [B, S]
        total = total + (kl * qmask).sum()
        count = count + qmask.sum()
    return total / count


# ---------------------------------------------------------------------------------------------
# expert balancing


def router_hooks(model, loads):
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            def hook(mod, args, out, i=i):
                loads[i] = loads.get(i, 0) + torch.bincount(out[2].reshape(-1), minlength=mod.num_experts).float()
            layer.mlp.gate.register_forward_hook(hook)


def balance(model, loads, rate) -> float:
    """DeepSeek-V3's auxiliary-loss-free balancing: nudge each expert's selection bias against its
    load. Returns the worst max/mean load ratio of this step."""
    worst = 0.0
    with torch.no_grad():
        for i, load in loads.items():
            bias = model.model.layers[i].mlp.gate.e_score_correction_bias
            bias += rate * torch.sign(load.mean() - load)
            worst = max(worst, float(load.max() / load.mean().clamp(min=1e-9)))
    loads.clear()
    return worst


# ---------------------------------------------------------------------------------------------
# the model


def build_model(seed: int) -> GlmMoeDsaForCausalLM:
    torch.manual_seed(seed)
    cfg = GlmMoeDsaConfig(**CONFIG, **mg.GLM5_EXTRA_KEYS)
    model = GlmMoeDsaForCausalLM._from_config(cfg, attn_implementation="eager", experts_implementation="kiln_train",
                                              dtype=torch.float32)
    n_layers = cfg.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name == "model.embed_tokens.weight":
                p.normal_(0.0, 1.0)
            elif p.dim() >= 2:
                std = p.shape[-1] ** -0.5
                if name.endswith("o_proj.weight") or name.endswith("down_proj.weight") or name.endswith("down_proj"):
                    std /= math.sqrt(2 * n_layers)  # residual branches start small
                p.normal_(0.0, std)
            else:
                raise RuntimeError(f"no init for {name}")
    state = DsaState(cfg.index_topk)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        attn._kiln_state = state
        attn.indexer._kiln_state = state
        attn.indexer.forward = indexer_forward.__get__(attn.indexer)
        dense = cfg.mlp_layer_types[i] == "dense"
        if not dense:
            layer.mlp.gate.e_score_correction_bias.zero_()
            layer.mlp.experts._ckpt_prefix = f"model.layers.{i}.mlp.experts"
        mlp = layer.mlp if dense else layer.mlp.shared_experts
        base = f"model.layers.{i}.mlp" + ("" if dense else ".shared_experts")
        for m in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, m, QatLinear(getattr(mlp, m), f"{base}.{m}"))
    model._kiln_state = state
    return model


def indexer_params(model):
    return [p for n, p in model.named_parameters() if ".indexer." in n]


def main_params(model):
    return [p for n, p in model.named_parameters() if ".indexer." not in n]


def quantized_names(model) -> list[str]:
    return [q.replace(".inner", "") for q in mg.quantized_linears(model)]


def bf16_copy(model) -> GlmMoeDsaForCausalLM:
    """The model as the BF16 checkpoint holds it (all weights rounded; the correction bias F32)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return m


def nvfp4_copy(model) -> GlmMoeDsaForCausalLM:
    """bf16_copy with every NVFP4 linear replaced by its ModelOpt-quantised, dequantised weight
    (make_goldens' quantize_weight / dequantize_weight); activations are fake-quantised at run time."""
    m = bf16_copy(model)
    weights = mg.checkpoint_weights(m)
    weights = {k.replace(".inner.", "."): v for k, v in weights.items()}
    for q in quantized_names(m):
        weights[f"{q}.weight"] = mg.dequantize_weight(mg.quantize_weight(weights[f"{q}.weight"]))
    # the wrapped linears' parameters are `….inner.weight` in the model, `….weight` in a checkpoint
    aliases = {n: weights[n.replace(".inner.", ".")] for n in m.state_dict() if ".inner." in n}
    mg.set_checkpoint_weights(m, {**weights, **aliases})
    return m


# ---------------------------------------------------------------------------------------------
# data: conversations -> token ids with target masks; batches; the shared tool prompt


class Encoder:
    def __init__(self, tok, renderer: Renderer):
        self.tok, self.renderer = tok, renderer
        prefix = renderer.render([], [data.WEATHER_TOOL], True, False)
        self.tool_prefix = self.ids(prefix)

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode(self, conv: dict) -> tuple[list[int], list[bool]]:
        """Token ids of the whole conversation and which of them are learned: every assistant
        message and the stop token after it (the next role token, or <|observation|> / <|user|>
        appended after the last message)."""
        ids, tgt = [], []
        pieces = self.renderer.segments(conv)
        for i, (text, target) in enumerate(pieces):
            t = self.ids(text)
            after_target = i > 0 and pieces[i - 1][1]  # this piece starts with the previous target's stop token
            ids += t
            tgt += [target or (after_target and j == 0) for j in range(len(t))]
        if pieces[-1][1]:
            ids.append(OBSERVATION if conv["messages"][-1].get("tool_calls") else USER)
            tgt.append(True)
        return ids, tgt

    def check(self, conv: dict):
        ids, tgt = self.encode(conv)
        full = self.renderer.render(conv["messages"], conv["tools"], conv["thinking"], False)
        assert ids[: len(self.ids(full))] == self.ids(full), "pieces tokenise differently from the whole"
        for i, t in enumerate(tgt):
            if t and (i + 1 == len(ids) or not tgt[i + 1]):
                assert ids[i] in EOS_IDS, ("a target must end with a stop token", conv)
        if conv["tools"]:
            assert ids[: len(self.tool_prefix)] == self.tool_prefix


def pad_batch(seqs: list[tuple[list[int], list[bool]]]):
    """Right-padded ids, labels (label[j] = ids[j+1] where that token is learned) and mask."""
    n, length = len(seqs), max(len(s) for s, _ in seqs)
    ids = torch.full((n, length), PAD, dtype=torch.long)
    labels = torch.full((n, length), -100, dtype=torch.long)
    mask = torch.zeros((n, length), dtype=torch.long)
    for i, (s, t) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        tt = torch.tensor(t[1:], dtype=torch.bool)
        lab = torch.tensor(s[1:])
        labels[i, : len(s) - 1] = torch.where(tt, lab, torch.full_like(lab, -100))
    return ids, labels, mask


def chunked(seqs, budget: int) -> list:
    """Sequences sorted by length into padded batches of similar lengths and at most `budget`
    (rows x length) slots."""
    seqs = sorted(seqs, key=lambda s: len(s[0]))
    chunks, cur = [], []
    for s in seqs:
        if cur and ((len(cur) + 1) * len(s[0]) > budget or len(s[0]) > 1.2 * len(cur[0][0]) + 4):
            chunks.append(pad_batch(cur))
            cur = []
        cur.append(s)
    if cur:
        chunks.append(pad_batch(cur))
    return chunks


class Batches:
    """Each step: conversations without tools (arithmetic, greetings) and tool conversations
    (weather), the latter as suffixes of the shared tool prompt; both length-bucketed."""

    def __init__(self, enc: Encoder, seed: int, n_plain: int, n_tool: int, greet_frac: float, budget: int = 4096):
        self.enc = enc
        self.mix = data.Mixture(seed)
        self.rng = random.Random(f"batches-{seed}")
        self.n_plain, self.n_tool, self.greet_frac, self.budget = n_plain, n_tool, greet_frac, budget

    def plain(self, n=None) -> list:
        convs = []
        for _ in range(self.n_plain if n is None else n):
            convs.append(self.mix.greeting() if self.rng.random() < self.greet_frac else self.mix.arithmetic())
        return chunked([self.enc.encode(c) for c in convs], self.budget)

    def tool(self, n=None) -> list:
        p = len(self.enc.tool_prefix)
        seqs = []
        for _ in range(self.n_tool if n is None else n):
            ids, tgt = self.enc.encode(self.mix.weather())
            seqs.append((ids[p - 1:], tgt[p - 1:]))  # the prefix's last token first: its label is the suffix's first
        # position 0 re-feeds the prefix's last token: drop it from the inputs (its label stays -100)
        return [(ids[:, 1:], labels[:, 1:], mask[:, 1:]) for ids, labels, mask in chunked(seqs, self.budget)]


def forward_ce(model, ids, labels, mask, prefix_states=None):
    """Summed cross entropy over the learned tokens, and their count; with prefix_states (from
    run_prefix) every row continues the shared prefix from its KV cache (gradients flow into it)."""
    st: DsaState = model._kiln_state
    st.qmask = mask.float()
    if prefix_states is None:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    else:
        b, p = ids.shape[0], prefix_states[0][0].shape[-2]
        cache = DynamicCache(config=model.config)
        for layer, (k, v, ik) in zip(cache.layers, prefix_states):
            layer.update(k.expand(b, *k.shape[1:]), v.expand(b, *v.shape[1:]))
            layer.update_indexer(ik.expand(b, *ik.shape[1:]))
        full_mask = torch.cat([torch.ones((b, p), dtype=mask.dtype), mask], dim=1)
        logits = model(input_ids=ids, attention_mask=full_mask, cache=cache, use_cache=True).logits
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return ce, int((labels != -100).sum())


def run_prefix(model, prefix: list[int]):
    """The shared tool prompt, once: per layer (compressed KV, rope keys, indexer keys), with graph."""
    st: DsaState = model._kiln_state
    cache = DynamicCache(config=model.config)
    pids = torch.tensor([prefix])
    st.qmask = torch.ones(pids.shape, dtype=torch.float32)
    model.model(input_ids=pids, cache=cache, use_cache=True)
    return [(layer.keys, layer.values, layer.indexer_keys) for layer in cache.layers]


def batch_ce(model, plain: list, tool: list, prefix: list[int]):
    """(summed CE, count) of the plain chunks and of the tool chunks."""
    ce_p, n_p, ce_t, n_t = 0.0, 0, 0.0, 0
    for chunk in plain:
        c, n = forward_ce(model, *chunk)
        ce_p, n_p = ce_p + c, n_p + n
    if tool:
        states = run_prefix(model, prefix)
        for chunk in tool:
            c, n = forward_ce(model, *chunk, prefix_states=states)
            ce_t, n_t = ce_t + c, n_t + n
    return ce_p, n_p, ce_t, n_t


# ---------------------------------------------------------------------------------------------
# evaluation: batched greedy decoding with a KV cache (left padding, explicit positions)


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new: int, chunk: int = 64) -> list[list[int]]:
    res = []
    for c in range(0, len(prompts), chunk):
        res += _generate(model, prompts[c:c + chunk], max_new)
    return res


def _generate(model, prompts, max_new):
    b, length = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, length), PAD, dtype=torch.long)
    mask = torch.zeros((b, length), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, length - len(p):] = torch.tensor(p)
        mask[i, length - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    st: DsaState = model._kiln_state
    st.qmask = mask.float()
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                   logits_to_keep=1).logits
    out = [[] for _ in range(b)]
    done = [False] * b
    pos = pos[:, -1:]
    for _ in range(max_new):
        nxt = logits[:, -1].argmax(-1)
        for i in range(b):
            if not done[i]:
                out[i].append(int(nxt[i]))
                done[i] = int(nxt[i]) in EOS_IDS
        if all(done):
            break
        mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype)], dim=1)
        pos = pos + 1
        st.qmask = torch.ones((b, 1))
        logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, cache=cache,
                       use_cache=True).logits
    return out


def split_reply(tok, ids: list[int], thinking: bool):
    """(reasoning, content, stopped, stop id) of generated ids, as kiln's server splits them: with
    thinking on, reasoning runs to </think>."""
    stopped = bool(ids) and ids[-1] in EOS_IDS
    stop = ids[-1] if stopped else None
    body = ids[:-1] if stopped else ids
    text = tok.decode(body, skip_special_tokens=False)
    if thinking:
        if "</think>" not in text:
            return text.strip(), "", stopped, stop
        r, c = text.split("</think>", 1)
        return r.strip(), c.strip(), stopped, stop
    return "", text.strip(), stopped, stop


@torch.no_grad()
def evaluate(model, enc: Encoder, n_arith: int, n_weather: int, seed: int = 11, show: int = 0) -> dict:
    """Held-out questions only: arithmetic with thinking on and off, weather calls with thinking on
    and off (right tool, right city, stopped at <|observation|>), and the answer after the tool."""
    was = model.training
    model.eval()
    st: DsaState = model._kiln_state
    dense, st.dense = st.dense, False
    tok, r = enc.tok, enc.renderer
    res, samples = {}, {}
    arith = data.draw_eval_arith(n_arith, seed=seed)
    for thinking in (True, False):
        prompts = [enc.ids(r.render([{"role": "user", "content": it["question"]}], None, thinking, True)) for it in arith]
        outs = generate(model, prompts, 120 if thinking else 24)
        good = 0
        for it, o in zip(arith, outs):
            reasoning, content, stopped, _ = split_reply(tok, o, thinking)
            ok = stopped and data.check_arith_answer(content, it["answer"]) and (bool(reasoning) == thinking)
            ok = ok and (thinking or THINK_END not in o)
            good += ok
        key = "arith_think" if thinking else "arith_nothink"
        res[key] = good / len(arith)
        samples[key] = [tok.decode(o, skip_special_tokens=False) for o in outs[:show]]
    weather = data.draw_eval_weather(n_weather, seed=seed + 1)
    for thinking in (True, False):
        prompts = [enc.ids(r.render([{"role": "user", "content": it["question"]}], [data.WEATHER_TOOL], thinking, True))
                   for it in weather]
        outs = generate(model, prompts, 96 if thinking else 48)
        good = 0
        for it, o in zip(weather, outs):
            _, content, stopped, stop = split_reply(tok, o, thinking)
            want = f"<tool_call>get_weather<arg_key>city</arg_key><arg_value>{it['city']}</arg_value></tool_call>"
            good += stopped and stop == OBSERVATION and content == want
        key = "weather_call_think" if thinking else "weather_call_nothink"
        res[key] = good / len(weather)
        samples[key] = [tok.decode(o, skip_special_tokens=False) for o in outs[:show]]
    prompts, results = [], []
    for it in weather:
        result = data.weather_result(it["city"])
        msgs = [{"role": "user", "content": it["question"]},
                {"role": "assistant", "content": "", "tool_calls": [data.tool_call(it["city"])]},
                {"role": "tool", "content": json.dumps(result)}]
        prompts.append(enc.ids(r.render(msgs, [data.WEATHER_TOOL], True, True)))
        results.append(result)
    outs = generate(model, prompts, 96)
    good = 0
    for result, o in zip(results, outs):
        _, content, stopped, _ = split_reply(tok, o, True)
        good += stopped and data.check_weather_answer(content, result)
    res["weather_answer"] = good / len(weather)
    samples["weather_answer"] = [tok.decode(o, skip_special_tokens=False) for o in outs[:show]]
    st.dense = dense
    model.train(was)
    if show:
        res["samples"] = samples
    return res


@torch.no_grad()
def measure_recall(model, batches: list) -> float | None:
    """Share of the dense attention mass (averaged over heads, layers and the queries that have
    more than index_topk keys) inside the indexer's top-k."""
    st: DsaState = model._kiln_state
    dense, was = st.dense, model.training
    model.eval()
    st.dense, st.measure = True, True
    st.take_recall()
    batch_ce(model, *batches)
    st.dense, st.measure = dense, False
    st.pending.clear()
    model.train(was)
    return st.take_recall()


# ---------------------------------------------------------------------------------------------
# calibration and export


class CalibHooks(mg.ActHooks):
    """make_goldens' amax observer on this model's layout (QAT wrappers; experts through
    make_goldens' kiln_oracle loop with its per-expert activation hook)."""

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
def calibrate(model, batches: Batches, n_plain: int, n_tool: int, qnames: list[str]) -> dict[str, float]:
    """ModelOpt's max calibration: the input amax of every NVFP4 linear over training
    conversations (per expert on the tokens routed to it; an expert no token reached takes the
    largest of its layer for that projection)."""
    was, st = model.training, model._kiln_state
    model.eval()
    dense, st.dense = st.dense, False
    wq, aq = QUANT.weights, QUANT.acts
    QUANT.weights = QUANT.acts = False
    hooks = CalibHooks(model)
    model.set_experts_implementation("kiln_oracle")
    for _ in range(max(1, n_plain // 64)):
        batch_ce(model, batches.plain(64), [], [])
    for _ in range(max(1, n_tool // 32)):
        batch_ce(model, [], batches.tool(32), batches.enc.tool_prefix)
    model.set_experts_implementation("kiln_train")
    hooks.remove()
    amax = {}
    for q in qnames:
        a = hooks.amax.get(q, 0.0)
        if a == 0.0:
            pre, _, proj = q.rsplit(".", 2)
            a = max(v for k, v in hooks.amax.items() if k.startswith(pre + ".") and k.endswith("." + proj))
        amax[q] = a
    st.dense = dense
    QUANT.weights, QUANT.acts = wq, aq
    model.train(was)
    return amax


def scales_of(amax: dict[str, float]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=torch.float32) / (6.0 * 448.0) for k, v in amax.items()}


def export(model, out_dir: str, tok_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    weights = mg.checkpoint_weights(model)
    weights = {k.replace(".inner.", "."): v for k, v in weights.items()}
    tensors = {}
    for k, v in sorted(weights.items()):
        tensors[k] = v.float().contiguous() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16).contiguous()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    case = mg.Case(name="demo", description="", seed=0, n_prompt=0, quant="bf16", quant_config_form=None, config=CONFIG)
    mg.write_config(model, case, out_dir)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(tok_dir, f), os.path.join(out_dir, f))
    shutil.copy(TEMPLATE_PATH, os.path.join(out_dir, "chat_template.jinja"))
    return tensors


def nvfp4_size_estimate(tensors: dict, qnames: list[str]) -> int:
    """Bytes of the ModelOpt NVFP4 checkpoint kiln quantize writes (tensor data only)."""
    total = 0
    q = {f"{n}.weight" for n in qnames}
    for k, v in tensors.items():
        if k in q:
            total += v.numel() // 2 + v.numel() // mg.GROUP + 8  # codes, E4M3 block scales, 2 F32 scalars
        else:
            total += v.numel() * v.element_size()
    return total


# ---------------------------------------------------------------------------------------------


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def build_tokenizer(renderer, seed: int, out_dir: str):
    enc_mix = data.Mixture(seed + 1)
    corpus = []
    for _ in range(3000):
        for conv in (enc_mix.arithmetic(), enc_mix.weather(), enc_mix.greeting()):
            corpus.append(renderer.render(conv["messages"], conv["tools"], conv["thinking"], False))
    tok_json, used = demo_tokenizer.build(corpus, VOCAB)
    tok = demo_tokenizer.write(out_dir, tok_json, CONFIG["max_position_embeddings"])
    for text in corpus:
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text
    return tok, used, len(corpus)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "target", "demo-train"))
    ap.add_argument("--steps", type=int, default=1150, help="training steps (the default fits 45 min on 2 cores)")
    ap.add_argument("--minutes", type=float, default=0.0,
                    help="instead of --steps: a training time budget; the step count is fixed after 30 steps")
    ap.add_argument("--plain", type=int, default=72, help="conversations without tools per step")
    ap.add_argument("--tool", type=int, default=16, help="tool conversations per step (sharing one prompt)")
    ap.add_argument("--greet-frac", type=float, default=0.1, help="share of greetings among the plain ones")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dense-frac", type=float, default=0.3, help="fraction of steps with dense attention")
    ap.add_argument("--qat-frac", type=float, default=0.2, help="final fraction of steps with NVFP4 fake quant")
    ap.add_argument("--eval-every", type=int, default=600)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--final-eval", default="100,40", help="held-out arithmetic,weather questions at the end")
    ap.add_argument("--smoke", action="store_true", help="a ~2-minute run of everything (a useless model)")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.minutes, args.eval_every, args.log_every, args.final_eval = 24, 0.0, 12, 4, "8,4"
        args.plain, args.tool = 16, 8
    torch.set_num_threads(2)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.time()

    renderer = Renderer()
    tok_dir = os.path.join(args.out, "tokenizer")
    tok, used, n_corpus = build_tokenizer(renderer, args.seed, tok_dir)
    enc = Encoder(tok, renderer)
    check_mix = data.Mixture(args.seed + 2)
    for _ in range(50):
        for conv in (check_mix.arithmetic(), check_mix.weather(), check_mix.greeting()):
            enc.check(conv)
    print(f"tokenizer: {used} of {VOCAB} ids, round trip of {n_corpus} conversations ok, tool prompt "
          f"{len(enc.tool_prefix)} tokens ({time.time() - t0:.0f}s)", flush=True)

    model = build_model(args.seed)
    model.train()
    st: DsaState = model._kiln_state
    qnames = quantized_names(model)
    batches = Batches(enc, args.seed, args.plain, args.tool, args.greet_frac)
    calib_batches = Batches(enc, args.seed + 4, 0, 0, args.greet_frac)
    probe = Batches(enc, args.seed + 3, 0, 0, 0.0)
    probe_batches = (probe.plain(24), probe.tool(12), enc.tool_prefix)
    ind_params, other = indexer_params(model), main_params(model)
    opt = torch.optim.AdamW([{"params": other}, {"params": ind_params}], lr=args.lr, betas=(0.9, 0.98),
                            weight_decay=0.01)
    loads = {}
    router_hooks(model, loads)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters, {len(qnames)} NVFP4 linears", flush=True)

    total = args.steps
    log, evals = [], []
    step, started = 0, time.time()
    qat_from = None
    win = {"lm": 0.0, "n": 0, "kl": 0.0, "steps": 0, "ce_plain": 0.0, "n_plain": 0, "ce_tool": 0.0, "n_tool": 0, "imb": 0.0}
    while step < total:
        if args.minutes and step == 30:
            per = (time.time() - started) / step
            total = max(60, int(args.minutes * 60 / (per * (1 + 0.6 * args.qat_frac))))
            print(f"step time {per:.2f}s: {total} steps for {args.minutes} min", flush=True)
        st.dense = step < args.dense_frac * total
        if step >= (1 - args.qat_frac) * total and (qat_from is None or (step - qat_from) % 100 == 0):
            if qat_from is None:
                qat_from = step
            QUANT.scale = scales_of(calibrate(model, calib_batches, 64, 32, qnames))
        QUANT.weights = QUANT.acts = qat_from is not None
        lr = lr_at(step, total, args.lr, min(100, total // 10 + 1))
        for g in opt.param_groups:
            g["lr"] = lr
        measure = st.dense and (step + 1) % args.log_every == 0
        st.collect, st.measure, st.records = True, measure, []
        ce_p, n_p, ce_t, n_t = batch_ce(model, batches.plain(), batches.tool(), enc.tool_prefix)
        lm = (ce_p + ce_t) / (n_p + n_t)
        kl = indexer_kl(st.records)
        st.collect, st.measure, st.records = False, False, []
        opt.zero_grad(set_to_none=True)
        (lm + kl).backward()
        torch.nn.utils.clip_grad_norm_(other, 1.0)
        torch.nn.utils.clip_grad_norm_(ind_params, 1.0)
        opt.step()
        win["imb"] = max(win["imb"], balance(model, loads, 1e-3))
        QUANT.weights = QUANT.acts = False
        QUANT.cache = {}
        step += 1
        win["lm"] += lm.item()
        win["kl"] += kl.item()
        win["steps"] += 1
        win["ce_plain"] += ce_p.item()
        win["n_plain"] += n_p
        win["ce_tool"] += ce_t.item()
        win["n_tool"] += n_t
        if step % args.log_every == 0 or step == total:
            el = time.time() - started
            rec = {"step": step, "s": round(el, 1), "lm": round(win["lm"] / win["steps"], 4),
                   "ce_plain": round(win["ce_plain"] / max(1, win["n_plain"]), 4),
                   "ce_tool": round(win["ce_tool"] / max(1, win["n_tool"]), 4),
                   "kl": round(win["kl"] / win["steps"], 4), "lr": round(lr, 6),
                   "stage": ("dense" if st.dense else "sparse") + ("+qat" if qat_from is not None else ""),
                   "max_load": round(win["imb"], 2)}
            r = st.take_recall()
            if r is not None:
                rec["recall@32"] = round(r, 4)
            log.append(rec)
            print(json.dumps(rec) + f"  {el / step:.2f} s/step, eta {(total - step) * el / step / 60:.1f} min", flush=True)
            win = {k: 0 if isinstance(v, int) else 0.0 for k, v in win.items()}
        if args.eval_every and (step % args.eval_every == 0 or step == total):
            te = time.time()
            ev = evaluate(model, enc, 24, 12, show=2 if step == total else 0)
            ev["recall@32_dense_probe"] = measure_recall(model, probe_batches)
            ev = {"step": step, **ev, "eval_s": round(time.time() - te, 1)}
            evals.append(ev)
            print("eval " + json.dumps(ev), flush=True)
    train_s = time.time() - started

    # final: the model as checkpointed (BF16), calibrated, evaluated float and NVFP4 W4A4
    final_model = bf16_copy(model)
    amax = calibrate(final_model, Batches(enc, args.seed + 5, 0, 0, args.greet_frac), 256, 128, qnames)
    n_arith, n_weather = (int(x) for x in args.final_eval.split(","))
    te = time.time()
    final = {"bf16": evaluate(final_model, enc, n_arith, n_weather, seed=21, show=3)}
    qmodel = nvfp4_copy(final_model)
    QUANT.scale, QUANT.acts = scales_of(amax), True
    final["nvfp4_w4a4"] = evaluate(qmodel, enc, n_arith, n_weather, seed=21, show=3)
    QUANT.acts = False
    final["recall@32_dense_probe"] = measure_recall(final_model, probe_batches)
    print(f"final eval ({time.time() - te:.0f}s): {json.dumps(final)}", flush=True)

    tensors = export(final_model, os.path.join(args.out, "bf16"), tok_dir)
    with open(os.path.join(args.out, "calibration.json"), "w") as f:
        json.dump(amax, f, indent=1, sort_keys=True)
        f.write("\n")
    nvfp4_bytes = nvfp4_size_estimate(tensors, qnames)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump({"seed": args.seed, "args": vars(args), "config": CONFIG, "steps": step,
                   "train_seconds": round(train_s, 1), "total_seconds": round(time.time() - t0, 1),
                   "dense_until_step": int(args.dense_frac * total), "qat_from_step": qat_from,
                   "tokenizer": {"vocab": VOCAB, "ids_used": used, "tool_prompt_tokens": len(enc.tool_prefix)},
                   "parameters": n_params, "nvfp4_checkpoint_bytes_estimate": nvfp4_bytes,
                   "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__,
                                "numpy": np.__version__, "python": platform.python_version()},
                   "final_eval": final, "evals": evals, "log": log}, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out} in {(time.time() - t0) / 60:.1f} min ({step} steps; NVFP4 checkpoint "
          f"~{nvfp4_bytes / 1e6:.1f} MB)", flush=True)


if __name__ == "__main__":
    main()
