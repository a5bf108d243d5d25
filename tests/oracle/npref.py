"""Independent numpy reference for kiln checkpoints (used by check_goldens.py and bench_transformers.py).

Nothing here is shared with make_goldens.py: the safetensors reader, the FP8/FP4 decoders and encoders,
the NVFP4 dequantiser and the activation fake quantiser are written from the format description
(shared/reference/glm5.md §4.3) in plain numpy, so that agreement with the goldens shows that the goldens
describe the bytes on disk.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import struct
import sys
import tempfile

import numpy as np

GROUP = 16

# ---------------------------------------------------------------------------------------------------
# safetensors (read only, own parser)

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,  # raw bits
    "F8_E4M3": np.uint8,  # raw bits
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


class Tensor:
    __slots__ = ("dtype", "shape", "raw")

    def __init__(self, dtype: str, shape: tuple, raw: np.ndarray):
        self.dtype, self.shape, self.raw = dtype, shape, raw

    def f32(self) -> np.ndarray:
        """Exact float32 value of a F32/BF16/F16/F8_E4M3 tensor."""
        if self.dtype == "F32":
            return self.raw.astype(np.float32)
        if self.dtype == "BF16":
            return (self.raw.astype(np.uint32) << 16).view(np.float32)
        if self.dtype == "F16":
            return self.raw.astype(np.float32)
        if self.dtype == "F8_E4M3":
            return E4M3_LUT[self.raw]
        raise TypeError(f"not a float tensor: {self.dtype}")


def read_safetensors(path: str) -> dict[str, Tensor]:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    (n,) = struct.unpack("<Q", data[:8].tobytes())
    header = json.loads(data[8 : 8 + n].tobytes())
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info["dtype"]
        if dt not in _DTYPES:
            raise TypeError(f"{path}: {name}: unsupported dtype {dt}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        arr = np.frombuffer(data, dtype=_DTYPES[dt], count=(end - start) // np.dtype(_DTYPES[dt]).itemsize,
                            offset=base + start)
        out[name] = Tensor(dt, shape, arr.reshape(shape))
    return out


def read_checkpoint(ckpt_dir: str) -> dict[str, Tensor]:
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p for p in os.listdir(ckpt_dir) if p.endswith(".safetensors"))
    tensors = {}
    for fn in files:
        for k, v in read_safetensors(os.path.join(ckpt_dir, fn)).items():
            if k in tensors:
                raise ValueError(f"{k} appears in two shards")
            tensors[k] = v
    return tensors


# ---------------------------------------------------------------------------------------------------
# number formats


def _e4m3_value(bits: int) -> float:
    s = -1.0 if bits & 0x80 else 1.0
    e = (bits >> 3) & 0xF
    m = bits & 0x7
    if e == 0xF and m == 0x7:
        return float("nan")
    if e == 0:
        return s * (m / 8.0) * 2.0**-6
    return s * (1.0 + m / 8.0) * 2.0 ** (e - 7)


E4M3_LUT = np.array([_e4m3_value(b) for b in range(256)], dtype=np.float32)
E4M3_POS = E4M3_LUT[:127].astype(np.float64)  # codes 0x00..0x7E: 0 .. 448, increasing
E2M1_MAG = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)
E2M1_LUT = np.concatenate([E2M1_MAG, -E2M1_MAG]).astype(np.float32)


def _nearest_even_code(mag: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of the increasing table; on an exact tie the even index wins.
    Values above the last entry give the last index (saturation)."""
    mag = mag.astype(np.float64)  # exact for fp32 inputs; distances below are exact too
    hi = np.searchsorted(table, mag, side="left").clip(0, len(table) - 1)
    lo = (hi - 1).clip(0, None)
    d_lo = np.abs(mag - table[lo])
    d_hi = np.abs(table[hi] - mag)
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.where(pick_hi, hi, lo)


def e4m3_round(x: np.ndarray) -> np.ndarray:
    """fp32 (>= 0) -> nearest E4M3 value (ties to even mantissa), saturating at 448, as float32."""
    assert np.all(x >= 0)
    return E4M3_POS[_nearest_even_code(np.minimum(x, np.float32(448.0)), E4M3_POS)].astype(np.float32)


def e2m1_round(x: np.ndarray) -> np.ndarray:
    """fp32 -> nearest E2M1 value (ties to even code, |x| > 6 -> 6), sign kept, as float32."""
    mag = E2M1_MAG[_nearest_even_code(np.abs(x), E2M1_MAG)]
    return (np.sign(x) * mag).astype(np.float32)


def dequant_nvfp4(weight: Tensor, scale: Tensor, scale_2: Tensor) -> np.ndarray:
    assert weight.dtype == "U8" and scale.dtype == "F8_E4M3" and scale_2.dtype == "F32", (
        weight.dtype, scale.dtype, scale_2.dtype)
    n, half = weight.shape
    k = half * 2
    assert scale.shape == (n, k // GROUP) and scale_2.shape == (), (scale.shape, scale_2.shape)
    codes = np.empty((n, k), dtype=np.uint8)
    codes[:, 0::2] = weight.raw & 0x0F  # even k: low nibble
    codes[:, 1::2] = weight.raw >> 4  # odd k: high nibble
    vals = E2M1_LUT[codes].reshape(n, k // GROUP, GROUP)
    w = (vals * scale.f32()[:, :, None]) * scale_2.f32()  # e2m1*scale is exact; one rounding
    return w.reshape(n, k).astype(np.float32)


def e2m1_code(q: np.ndarray) -> np.ndarray:
    """E2M1 code (bit 3 = sign, set for negative inputs) of the value nearest to q, ties to even."""
    return (_nearest_even_code(np.abs(q), E2M1_MAG) + 8 * (q < 0)).astype(np.uint8)


def quantize_nvfp4(w: np.ndarray) -> dict[str, np.ndarray]:
    """ModelOpt NVFP4 export of a [N, K] fp32 weight: packed U8 codes, E4M3 block scales (as float32
    values), fp32 weight_scale_2."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    ws2 = np.float32(np.abs(w).max()) / np.float32(6.0 * 448.0)
    blocks = w.reshape(n, k // GROUP, GROUP)
    s = np.abs(blocks).max(axis=-1) / (np.float32(6.0) * ws2)
    s = np.where(s == 0, np.float32(1.0), s)
    s = np.maximum(s, np.float32(2.0**-9)).astype(np.float32)
    sf = e4m3_round(s)
    codes = e2m1_code((blocks / (sf[:, :, None] * ws2)).astype(np.float32)).reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return {"weight": packed, "weight_scale": sf, "weight_scale_2": ws2}


def fake_quant(x: np.ndarray, input_scale: np.float32) -> np.ndarray:
    """NVFP4 activation fake quantisation along the last axis (16-element blocks), fp32 throughout."""
    x = np.asarray(x, dtype=np.float32)
    shape = x.shape
    xb = x.reshape(-1, shape[-1] // GROUP, GROUP)
    s = np.float32(input_scale)
    inv = np.float32(1.0) / s
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    sf = e4m3_round((inv * amax) / np.float32(6.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        q = (xb * inv) / sf
    q = np.where(sf > 0, q, np.float32(0.0)).astype(np.float32)
    xq = (e2m1_round(q) * sf) * s
    return xq.reshape(shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------------
# checkpoint interpretation


def load_config(ckpt_dir: str) -> dict:
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        return json.load(f)


def quant_info(ckpt_dir: str, config: dict) -> dict | None:
    """ModelOpt NVFP4 settings from config.json (flat) or hf_quant_config.json (nested); None if BF16."""
    qc = config.get("quantization_config")
    if qc is not None:
        assert qc.get("quant_method") == "modelopt", qc
        return {"form": "flat", "algo": qc["quant_algo"], "group_size": qc.get("group_size", GROUP),
                "exclude": qc.get("ignore") or qc.get("modules_to_not_convert") or qc.get("exclude_modules") or []}
    path = os.path.join(ckpt_dir, "hf_quant_config.json")
    if os.path.exists(path):
        with open(path) as f:
            hq = json.load(f)
        assert hq["producer"]["name"] == "modelopt", hq
        q = hq["quantization"]
        return {"form": "nested", "algo": q["quant_algo"], "group_size": q["group_size"],
                "exclude": q.get("exclude_modules") or []}
    return None


def excluded(module: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def validate_checkpoint(tensors: dict[str, Tensor], config: dict, qinfo: dict | None, strict: bool = True) -> list[str]:
    """Format rules; returns the NVFP4 module names. Raises AssertionError naming the culprit.
    strict (the goldens): additionally every non-quantised tensor is BF16 (F32 for
    e_score_correction_bias) and, in NVFP4 checkpoints, every MLP / expert linear is quantised."""
    qmods = sorted(k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale"))
    if qinfo is None:
        assert not qmods, f"quantised tensors without a quantisation config: {qmods[:3]}"
    else:
        assert qinfo["algo"] == "NVFP4" and qinfo["group_size"] == GROUP, qinfo
    qset = set(qmods)
    for m in qmods:
        w, s, s2, i = (tensors.get(f"{m}.{x}") for x in ("weight", "weight_scale", "weight_scale_2", "input_scale"))
        assert w is not None and w.dtype == "U8" and len(w.shape) == 2, f"{m}.weight"
        n, half = w.shape
        assert s.dtype == "F8_E4M3" and s.shape == (n, half * 2 // GROUP), f"{m}.weight_scale {s.dtype} {s.shape}"
        assert s2 is not None and s2.dtype == "F32" and s2.shape == (), f"{m}.weight_scale_2"
        assert i is not None and i.dtype == "F32" and i.shape == (), f"{m}.input_scale"
        assert not excluded(m, qinfo["exclude"]), f"{m} is quantised but matches an exclude pattern"
        assert ".mlp." in m and (m.endswith("gate_proj") or m.endswith("up_proj") or m.endswith("down_proj")), m
    if not strict:
        return qmods
    for k, t in tensors.items():
        mod = k.rsplit(".", 1)[0]
        if mod in qset:
            continue
        want = "F32" if k.endswith("e_score_correction_bias") else "BF16"
        assert t.dtype == want, f"{k}: {t.dtype}, expected {want}"
    if qinfo is not None:
        # every MLP / expert linear is quantised; everything matching an exclude pattern is not
        for k in tensors:
            if k.endswith("_proj.weight") and ".mlp." in k:
                assert k[: -len(".weight")] in qset, f"{k} is not quantised"
    return qmods


def dense_weights(tensors: dict[str, Tensor], qmods: list[str]) -> dict[str, np.ndarray]:
    """fp32 weights under checkpoint names (NVFP4 dequantised, BF16 upcast exactly)."""
    out = {}
    qset = set(qmods)
    for k, t in tensors.items():
        mod, leaf = k.rsplit(".", 1)
        if mod in qset:
            if leaf == "weight":
                out[k] = dequant_nvfp4(t, tensors[f"{mod}.weight_scale"], tensors[f"{mod}.weight_scale_2"])
            continue
        out[k] = t.f32()
    return out


def input_scales(tensors: dict[str, Tensor], qmods: list[str]) -> dict[str, np.float32]:
    return {m: np.float32(tensors[f"{m}.input_scale"].f32()) for m in qmods}


# ---------------------------------------------------------------------------------------------------
# transformers model from a kiln checkpoint


def load_model(ckpt_dir: str, dtype: str = "float32", strict: bool = True):
    """GlmMoeDsaForCausalLM with the checkpoint's weights (NVFP4 dequantised), loaded by transformers'
    own from_pretrained (so its per-expert -> fused conversion is used, not ours).
    Returns (model, info) with info = {config, qinfo, qmods, input_scales}."""
    import torch
    from safetensors.numpy import save_file
    from transformers import GlmMoeDsaForCausalLM

    config = load_config(ckpt_dir)
    qinfo = quant_info(ckpt_dir, config)
    tensors = read_checkpoint(ckpt_dir)
    # the MTP layers after the decoder stack are not part of the model (transformers skips GLM-5's
    # layer 78 the same way); scripts/demo_model/train_mtp.py loads the demo model's own
    mtp = tuple(f"model.layers.{config['num_hidden_layers'] + i}." for i in range(config.get("num_nextn_predict_layers", 0)))
    tensors = {k: v for k, v in tensors.items() if not (mtp and k.startswith(mtp))}
    qmods = validate_checkpoint(tensors, config, qinfo, strict)
    weights = dense_weights(tensors, qmods)
    tmp = tempfile.mkdtemp(prefix="kiln-oracle-")
    try:
        cfg = dict(config)
        cfg.pop("quantization_config", None)  # transformers has no ModelOpt NVFP4 loader
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f)
        save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
        model, loading = GlmMoeDsaForCausalLM.from_pretrained(
            tmp, dtype=getattr(torch, dtype), attn_implementation="eager", experts_implementation="eager",
            output_loading_info=True)
    finally:
        shutil.rmtree(tmp)
    bad = {k: v for k, v in loading.items() if v}
    if strict:
        assert not bad, f"loading {ckpt_dir}: {bad}"
    elif bad:
        print(f"warning: loading {ckpt_dir}: {bad}", file=sys.stderr)
    model.eval()
    return model, {"config": config, "qinfo": qinfo, "qmods": qmods, "input_scales": input_scales(tensors, qmods)}
