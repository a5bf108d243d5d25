"""The demo model's tokenizer: byte-level BPE with the GLM special tokens.

Layout (like kiln's synthetic `tiny` tokenizer, compiler/src/synth/tokenizer.rs): ids 0-255 are
the 256 bytes in GPT-2's byte-to-unicode alphabet, 256-275 the GLM special tokens in kiln's order,
then merges learned on the training text. Pre-tokenisation splits letters runs, single digits,
single whitespace characters and punctuation runs apart, so
- every digit is its own token (arithmetic works digit by digit),
- a space is never glued to the word after it: " Zorvik" and "Zorvik" share their word tokens,
  so copying a city name into a tool call is copying tokens.
"""

from __future__ import annotations

import json
import os
import tempfile

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = [
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
]
SPLIT = r"(?<![A-Za-z])[a-z]+|[A-Za-z]|[0-9]|\s|[^A-Za-z0-9\s]+"


def byte_to_char(b: int) -> str:
    """GPT-2's reversible byte -> printable character map."""
    def printable(x):
        return 0x21 <= x <= 0x7E or 0xA1 <= x <= 0xAC or 0xAE <= x <= 0xFF
    if printable(b):
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if not printable(x)))


def pre_tokenizer_json() -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ]}


def learn_merges(texts: list[str], n_merges: int) -> list[tuple[str, str]]:
    """BPE merges over the texts (special tokens removed), in the order they were learned."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    alphabet = [byte_to_char(b) for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=256 + n_merges, initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=[], limit_alphabet=256)
    strip = SPECIAL_TOKENS

    def clean(t):
        for s in strip:
            t = t.replace(s, "\n")
        return t

    tok.train_from_iterator((clean(t) for t in texts), trainer=trainer)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.json")
        tok.save(path)
        with open(path) as f:
            merges = json.load(f)["model"]["merges"]
    out = []
    for m in merges:
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        out.append((a, b))
    return out[:n_merges]


def build(texts: list[str], vocab_size: int) -> dict:
    """tokenizer.json contents with exactly `vocab_size` ids."""
    n_merges = vocab_size - 256 - len(SPECIAL_TOKENS)
    merges = learn_merges(texts, n_merges)
    vocab = {byte_to_char(b): b for b in range(256)}
    # The special tokens sit in the model's vocabulary too, at their added-token ids: a loader
    # numbers added tokens it cannot find there after the vocabulary, whatever ids the file gives.
    vocab.update({t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)})
    next_id = 256 + len(SPECIAL_TOKENS)
    kept = []
    for a, b in merges:
        if a not in vocab or b not in vocab or a + b in vocab:
            continue
        vocab[a + b] = next_id
        next_id += 1
        kept.append(f"{a} {b}")
    assert next_id <= vocab_size, next_id
    # Fewer merges than asked (a tiny corpus): the ids stay dense, the vocab just ends earlier.
    added = [{"id": 256 + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer_json(),
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": kept},
    }, next_id


def write(out_dir: str, tokenizer_json: dict, max_positions: int) -> Tokenizer:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json, f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
                   "model_max_length": max_positions}, f, indent=2)
        f.write("\n")
    ids = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]],
                   "pad_token_id": ids["<|endoftext|>"]}, f, indent=2)
        f.write("\n")
    return Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
