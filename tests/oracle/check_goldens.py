#!/usr/bin/env python3
"""Re-derive every golden under tests/goldens/ from the files on disk, independently of make_goldens.py.

For each case directory (one with golden.json):
  1. validates the checkpoint format (dtypes, NVFP4 tensor shapes, scalar scales, exclude patterns);
  2. rebuilds fp32 weights with the numpy dequantiser in npref.py (own safetensors parser, own E2M1 /
     E4M3 decoding) and loads them into a fresh transformers GlmMoeDsaForCausalLM via from_pretrained
     (transformers' own per-expert -> fused conversion);
  3. re-runs the recorded prompt: plain for logits_bf16 / logits_w4a16; for logits_w4a4 with the numpy
     NVFP4 activation fake quantiser on the input of every NVFP4 linear (dense MLP and shared experts
     via forward pre-hooks, routed experts via a registered experts implementation);
  4. asserts max |recomputed - golden| <= 1e-4 x rms(golden), both for one prefill and for
     token-by-token decode through transformers' KV cache.

Prints one line per case and ends with 'N passed, M failed' (exit status 1 if any failed).
Usage: python tests/oracle/check_goldens.py [GOLDENS_DIR]
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import npref  # noqa: E402

from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402

REL_TOL = 1e-4


def fq_tensor(x: torch.Tensor, scale: np.float32) -> torch.Tensor:
    y = npref.fake_quant(x.detach().to(torch.float32).cpu().numpy(), scale)
    return torch.from_numpy(y).to(x.dtype)


def check_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Routed experts with optional NVFP4 activation fake quantisation (self._check_scales)."""
    scales = getattr(self, "_check_scales", None)
    inter = self.gate_up_proj.shape[1] // 2
    out = torch.zeros_like(hidden_states)
    for e in torch.unique(top_k_index).tolist():  # ascending expert id
        tok, slot = torch.nonzero(top_k_index == e, as_tuple=True)
        x = hidden_states[tok]
        if scales is not None:
            x = fq_tensor(x, scales["gate_up"][e])
        gu = F.linear(x, self.gate_up_proj[e])
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        if scales is not None:
            h = fq_tensor(h, scales["down"][e])
        y = F.linear(h, self.down_proj[e]) * top_k_weights[tok, slot].unsqueeze(-1)
        out.index_add_(0, tok, y.to(out.dtype))
    return out


ALL_EXPERTS_FUNCTIONS.register("kiln_check", check_experts_forward)


def install_fake_quant(model, info) -> list:
    """Hooks for W4A4; returns the handles."""
    cfg = model.config
    s = info["input_scales"]
    handles = []

    def pre_hook(scale):
        return lambda mod, args: (fq_tensor(args[0], scale),) + tuple(args[1:])

    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}.mlp"
        if cfg.mlp_layer_types[i] == "dense":
            mods = [f"{p}.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
        else:
            mods = [f"{p}.shared_experts.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
            n = cfg.n_routed_experts
            gate = [s[f"{p}.experts.{e}.gate_proj"] for e in range(n)]
            up = [s[f"{p}.experts.{e}.up_proj"] for e in range(n)]
            assert gate == up, f"{p}: gate/up input_scale differ"
            layer.mlp.experts._check_scales = {"gate_up": gate,
                                               "down": [s[f"{p}.experts.{e}.down_proj"] for e in range(n)]}
        for m in mods:
            handles.append(model.get_submodule(m).register_forward_pre_hook(pre_hook(s[m])))
    model.set_experts_implementation("kiln_check")
    return handles


def remove_fake_quant(model, handles):
    for h in handles:
        h.remove()
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.__dict__.pop("_check_scales", None)
    model.set_experts_implementation("eager")


@torch.no_grad()
def prefill(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids[None], use_cache=False).logits[0].float()


@torch.no_grad()
def decode(model, ids: torch.Tensor) -> torch.Tensor:
    cache = DynamicCache(config=model.config)
    rows = []
    for i in range(ids.shape[0]):
        out = model(input_ids=ids[None, i : i + 1], cache=cache, use_cache=True)
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def check_case(case_dir: str) -> tuple[bool, str]:
    with open(os.path.join(case_dir, "golden.json")) as f:
        meta = json.load(f)
    golden = npref.read_safetensors(os.path.join(case_dir, "golden.safetensors"))
    assert golden["ids"].dtype == "I32" and len(golden["ids"].shape) == 1
    ids = torch.from_numpy(golden["ids"].raw.astype(np.int64))
    assert ids.tolist() == meta["prompt_ids"], "ids in golden.safetensors and golden.json differ"
    model, info = npref.load_model(os.path.join(case_dir, "ckpt"), "float32")
    quantised = info["qinfo"] is not None
    names = sorted(k for k in golden if k.startswith("logits_"))
    expected = ["logits_w4a16", "logits_w4a4"] if quantised else ["logits_bf16"]
    assert names == sorted(expected), f"golden tensors {names}, expected {expected}"
    ok = True
    parts = []
    for name in names:
        g = golden[name]
        assert g.dtype == "F32" and g.shape == (ids.shape[0], model.config.vocab_size), (name, g.dtype, g.shape)
        gold = torch.from_numpy(g.f32().copy())
        scale = float(gold.pow(2).mean().sqrt())
        handles = install_fake_quant(model, info) if name == "logits_w4a4" else None
        try:
            res = {"prefill": prefill(model, ids), "decode": decode(model, ids)}
        finally:
            if handles is not None:
                remove_fake_quant(model, handles)
        diffs = []
        for mode, got in res.items():
            d = float((got - gold).abs().max()) / scale
            diffs.append(f"{mode} {d:.1e}")
            ok &= d <= REL_TOL
        parts.append(f"{name} [{', '.join(diffs)}]")
    qdesc = f"NVFP4 ({info['qinfo']['form']} config, {len(info['qmods'])} linears)" if quantised else "BF16"
    return ok, f"{os.path.basename(case_dir)}: {qdesc}, {ids.shape[0]} ids: " + "; ".join(parts)


def check_vectors(case_dir: str) -> tuple[bool, str]:
    """Bit-exact edge cases of the activation fake quantiser and the weight quantiser."""
    t = npref.read_safetensors(os.path.join(case_dir, "golden.safetensors"))
    x, s = t["act_x"].f32(), t["act_input_scale"].f32()
    bad = []
    for r in range(x.shape[0]):
        inv = np.float32(1.0) / s[r]
        xb = x[r].reshape(-1, npref.GROUP)
        sf = npref.e4m3_round((inv * np.abs(xb).max(-1, keepdims=True)) / np.float32(6.0))
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(sf > 0, (xb * inv) / sf, np.float32(0.0)).astype(np.float32)
        if not np.array_equal(sf[:, 0], t["act_block_scale"].f32()[r]):
            bad.append(f"act row {r}: block scale")
        if not np.array_equal(npref.e2m1_code(q).reshape(-1), t["act_codes"].raw[r]):
            bad.append(f"act row {r}: codes")
        if not np.array_equal(npref.fake_quant(x[r], s[r]), t["act_x_hat"].f32()[r]):
            bad.append(f"act row {r}: x_hat")
    q = npref.quantize_nvfp4(t["w"].f32())
    if not np.array_equal(q["weight"], t["weight"].raw):
        bad.append("weight codes")
    if not np.array_equal(q["weight_scale"], t["weight_scale"].f32()):
        bad.append("weight_scale")
    if q["weight_scale_2"] != t["weight_scale_2"].f32():
        bad.append("weight_scale_2")
    deq = npref.dequant_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])
    if not np.array_equal(deq, t["w_dequant"].f32()):
        bad.append("w_dequant")
    line = (f"nvfp4_vectors: {x.shape[0]} activation rows, weight {tuple(t['w'].shape)}: "
            + ("bit exact" if not bad else "MISMATCH " + ", ".join(bad)))
    return not bad, line


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.normpath(os.path.join(here, "..", "goldens"))
    torch.set_num_threads(1)
    cases = sorted(d for d in os.listdir(root) if os.path.exists(os.path.join(root, d, "golden.json")))
    passed = failed = 0
    for c in cases:
        try:
            d = os.path.join(root, c)
            with open(os.path.join(d, "golden.json")) as f:
                kind = json.load(f).get("kind", "model")
            ok, line = check_vectors(d) if kind == "vectors" else check_case(d)
        except Exception as e:  # report and go on with the other cases
            ok, line = False, f"{c}: error: {type(e).__name__}: {e}"
            traceback.print_exc()
        print(("PASS " if ok else "FAIL ") + line, flush=True)
        passed += ok
        failed += not ok
    print(f"{passed} passed, {failed} failed (max |diff| / rms(golden) must be <= {REL_TOL:g})")
    sys.exit(1 if failed or not cases else 0)


if __name__ == "__main__":
    main()
