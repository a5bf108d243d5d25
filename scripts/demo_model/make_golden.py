#!/usr/bin/env python3
"""The upstream check of the trained demo model: golden logits from Hugging Face transformers.

Loads artifacts/demo-model (ModelOpt NVFP4, as kiln ships it) with the oracle's independent numpy
dequantiser (tests/oracle/npref.py) into transformers' GlmMoeDsaForCausalLM (float32, eager), runs
one realistic conversation (a held-out weather question with the get_weather tool, the model's
tool call, the tool result and the start of its answer: long enough that the DSA indexer's top-k
drops tokens), and writes tests/goldens/demo/{golden.safetensors, golden.json} like
tests/oracle/make_goldens.py does: `ids`, `logits_w4a16` (dequantised weights, activations
unquantised) and `logits_w4a4` (plus NVFP4 fake quantisation of every NVFP4 linear's input).
tests/goldens/demo/ckpt is a link to artifacts/demo-model, so tests/cpu_goldens.rs and
tests/oracle/check_goldens.py treat it as one more case.

Usage: target/train-venv/bin/python scripts/demo_model/make_golden.py
"""

from __future__ import annotations

import json
import os
import platform
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "oracle"))
sys.path.insert(0, HERE)
import check_goldens  # noqa: E402
import npref  # noqa: E402
import data  # noqa: E402
from render import Renderer  # noqa: E402

from safetensors.numpy import save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
import transformers  # noqa: E402


def conversation_ids(ckpt: str) -> tuple[list[int], str]:
    """The token ids of one held-out weather exchange, rendered by the chat template."""
    city = data.draw_eval_weather(1, seed=4242)[0]["city"]
    messages = [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]},
        {"role": "tool", "content": json.dumps({"city": city, "temperature": 17, "condition": "cloudy"})},
    ]
    text = Renderer(os.path.join(ckpt, "chat_template.jinja")).render(messages, [data.WEATHER_TOOL], True, True)
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    return tok.encode(text, add_special_tokens=False).ids, text


def main():
    torch.set_num_threads(2)
    ckpt = os.path.join(ROOT, "artifacts", "demo-model")
    out = os.path.join(ROOT, "tests", "goldens", "demo")
    os.makedirs(out, exist_ok=True)
    link = os.path.join(out, "ckpt")
    if not os.path.islink(link):
        os.symlink(os.path.join("..", "..", "..", "artifacts", "demo-model"), link)
    ids, text = conversation_ids(ckpt)
    model, info = npref.load_model(ckpt, "float32")
    x = torch.tensor(ids, dtype=torch.int64)
    w4a16 = check_goldens.prefill(model, x)
    handles = check_goldens.install_fake_quant(model, info)
    try:
        w4a4 = check_goldens.prefill(model, x)
    finally:
        check_goldens.remove_fake_quant(model, handles)
    save_file({"ids": np.array(ids, dtype=np.int32), "logits_w4a16": w4a16.numpy(), "logits_w4a4": w4a4.numpy()},
              os.path.join(out, "golden.safetensors"))
    cfg = model.config
    meta = {
        "case": "demo",
        "description": "the trained demo model (artifacts/demo-model, NVFP4) on a held-out weather tool-call exchange "
                       f"of {len(ids)} tokens (index_topk {cfg.index_topk}: the indexer drops tokens)",
        "generator": "scripts/demo_model/make_golden.py",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__,
                     "python": platform.python_version()},
        "text": text,
        "prompt_ids": ids,
        "argmax_w4a16": w4a16.argmax(-1).tolist(),
    }
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(f"wrote {out}: {len(ids)} ids, vocab {cfg.vocab_size}")


if __name__ == "__main__":
    main()
