"""The GLM-5 chat template rendered as transformers' apply_chat_template renders it (and kiln's
engine: engine/src/chat_template.rs): trim_blocks and lstrip_blocks, the trailing newline
dropped, and `tojson` = json.dumps(ensure_ascii=False) with the keys in their given order (Jinja's
own tojson sorts keys and escapes HTML, which would change the prompt)."""

from __future__ import annotations

import json
import os

import jinja2

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
TEMPLATE_PATH = os.path.join(ROOT, "compiler", "src", "synth", "chat_template.jinja")


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class Renderer:
    def __init__(self, path: str = TEMPLATE_PATH):
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        with open(path) as f:
            self.template = env.from_string(f.read())

    def render(self, messages, tools, thinking: bool, add_generation_prompt: bool) -> str:
        kw = {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt}
        if not thinking:
            kw["enable_thinking"] = False
        return self.template.render(**kw)

    def example(self, conv: dict, stop_after_call: int, stop_after_answer: int) -> tuple[str, str, int]:
        """(prompt, reply text, stop token) of a conversation whose last message is the reply: the
        prompt ends with the generation prompt (`<|assistant|><think>` or `<|assistant|></think>`)
        and the reply is what the model writes after it."""
        msgs, tools, thinking = conv["messages"], conv["tools"], conv["thinking"]
        prompt = self.render(msgs[:-1], tools, thinking, True)
        full = self.render(msgs, tools, thinking, False)
        head = prompt.rsplit("<|assistant|>", 1)[1]
        cut = len(prompt) - len(head)
        assert full[:cut] == prompt[:cut] and full[cut:].startswith(head), (prompt, full)
        stop = stop_after_call if msgs[-1].get("tool_calls") else stop_after_answer
        return prompt, full[cut + len(head):], stop

    def segments(self, conv: dict) -> list[tuple[str, bool]]:
        """The whole conversation as (text, is_target) pieces: every assistant message is a target
        (what the model writes after its generation prompt). An earlier assistant turn (the tool
        call before the tool's result) appears without reasoning, exactly as the thinking-off
        generation prompt `<|assistant|></think>` continues, so it is a thinking-off example too.
        The caller adds each target's stop token (the next role token, or one after the last)."""
        msgs, tools, thinking = conv["messages"], conv["tools"], conv["thinking"]
        full = self.render(msgs, tools, thinking, False)
        pieces, pos = [], 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            last = i == len(msgs) - 1
            prompt = self.render(msgs[:i], tools, thinking if last else False, True)
            upto = self.render(msgs[: i + 1], tools, thinking, False)
            assert full.startswith(prompt) and full.startswith(upto) and len(upto) > len(prompt), (prompt, full)
            pieces.append((full[pos:len(prompt)], False))
            pieces.append((full[len(prompt):len(upto)], True))
            pos = len(upto)
        if pos < len(full):
            pieces.append((full[pos:], False))
        return pieces
