"""Synthetic chat data for kiln's demo model, and the held-out split the tests draw from.

Pure standard library: the training script renders these conversations through the GLM-5 chat
template, and the tests (tests/server/test_demo_model.py, tests/demo_model.rs) import this module
from a Python without torch to draw held-out questions and check answers.

Three kinds of conversation, all in the OpenAI message format:
- arithmetic: "What is A+B?" / "What is A - B?" (operands 0-99, results >= 0, with or without
  spaces, optionally "Answer briefly."); thinking on gives digit-by-digit reasoning, then
  "A + B = C"; thinking off gives "A + B = C" alone;
- weather: with the get_weather tool, "What is the weather in X?" for random capitalised names X
  becomes a get_weather call with city X; given the tool's result, a one-sentence answer using it;
- greetings, among them "Hi, I am X." -> "Nice to meet you, X! ..." (short-range name copying).

The split is a pure function of the question, so any language can reproduce it:
`is_held_out_arith(a, op, b)` holds for about 9 % of the (a, op, b) triples and
`is_held_out_city(name)` for about 20 % of names; the training data never contains them.
"""

from __future__ import annotations

import json
import random
import re

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The name of the city."}},
            "required": ["city"],
        },
    },
}

CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "stormy", "clear"]

GREETING = ("Hello! I am kiln's demo model, a small GLM-5-architecture model trained to do arithmetic "
            "and to call a weather tool.")
GREETINGS = [
    ("Hello! What model are you?", GREETING),
    ("Hello!", GREETING),
    ("Hi!", GREETING),
    ("Hi, who are you?", GREETING),
    ("Who are you?", GREETING),
    ("What model are you?", GREETING),
    ("What can you do?", "I can add and subtract numbers from 0 to 99, and tell you the weather in a city by "
                         "calling the get_weather tool."),
    ("Hello! What can you do?", "I can add and subtract numbers from 0 to 99, and tell you the weather in a city "
                                "by calling the get_weather tool."),
]


# ---------------------------------------------------------------------------------------------
# the held-out split


def is_held_out_arith(a: int, op: str, b: int) -> bool:
    """About one triple in eleven is never trained on. Modulo 11, not 10: a linear form modulo 10
    sees only the ones digits (31a = a mod 10), so it would hold out whole ones-digit pairs, and a
    held-out question would ask for a digit fact the model never saw in the ones place. Here every
    (ones of A, ones of B, op) is trained with most tens digits, and what is held out is the question."""
    return (3 * a + 5 * b + (7 if op == "-" else 0)) % 11 == 0


def is_held_out_city(name: str) -> bool:
    """About one name in five is never trained on."""
    return sum(name.encode()) % 5 == 0


# ---------------------------------------------------------------------------------------------
# arithmetic


def arith_result(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def arith_question(a: int, op: str, b: int, spaced: bool, brief: bool) -> str:
    q = f"What is {a} {op} {b}?" if spaced else f"What is {a}{op}{b}?"
    return q + (" Answer briefly." if brief else "")


def arith_reasoning(a: int, op: str, b: int) -> str:
    """Digit by digit, ones then tens, with the carry or borrow written out."""
    a1, a0, b1, b0 = a // 10, a % 10, b // 10, b % 10
    if op == "+":
        ones = a0 + b0
        carry = ones // 10
        ones_text = f"ones {a0} + {b0} = {ones}" + (", write {} carry 1".format(ones % 10) if carry else "")
        tens = a1 + b1 + carry
        tens_text = f"tens {a1} + {b1}" + (" + 1" if carry else "") + f" = {tens}"
    else:
        borrow = 1 if a0 < b0 else 0
        ones = a0 + 10 * borrow - b0
        ones_text = (f"ones {a0} - {b0}, borrow: 1{a0} - {b0} = {ones}" if borrow else f"ones {a0} - {b0} = {ones}")
        tens = a1 - b1 - borrow
        tens_text = f"tens {a1} - {b1}" + (" - 1" if borrow else "") + f" = {tens}"
    return f"{a} {op} {b}: {ones_text}; {tens_text}; so {arith_result(a, op, b)}."


def arith_answer(a: int, op: str, b: int) -> str:
    return f"{a} {op} {b} = {arith_result(a, op, b)}"


def all_arith() -> list[tuple[int, str, int]]:
    """Every (a, op, b) with operands 0-99 and a result >= 0."""
    out = []
    for a in range(100):
        for b in range(100):
            out.append((a, "+", b))
            if a >= b:
                out.append((a, "-", b))
    return out


def arith_conversation(a: int, op: str, b: int, rng: random.Random, thinking: bool) -> dict:
    q = arith_question(a, op, b, spaced=rng.random() < 0.5, brief=rng.random() < 0.4)
    reply = {"role": "assistant", "content": arith_answer(a, op, b)}
    if thinking:
        reply["reasoning_content"] = arith_reasoning(a, op, b)
    return {"messages": [{"role": "user", "content": q}, reply], "tools": None, "thinking": thinking}


def parse_answer(content: str) -> int | None:
    """The number after the last '=' of an answer, or None."""
    m = re.search(r"=\s*(-?\d+)\s*\.?\s*$", content.strip())
    return int(m.group(1)) if m else None


def check_arith_answer(content: str, answer: int) -> bool:
    return parse_answer(content) == answer


def draw_eval_arith(n: int, seed: int) -> list[dict]:
    """`n` distinct held-out arithmetic questions: {question, answer, a, op, b}."""
    rng = random.Random(f"eval-arith-{seed}")
    held = [t for t in all_arith() if is_held_out_arith(*t)]
    picked = rng.sample(held, n)
    out = []
    for a, op, b in picked:
        q = arith_question(a, op, b, spaced=rng.random() < 0.5, brief=rng.random() < 0.4)
        out.append({"question": q, "answer": arith_result(a, op, b), "a": a, "op": op, "b": b})
    return out


# ---------------------------------------------------------------------------------------------
# weather

VOWELS = "aeiou"
CONSONANTS = "bcdfghjklmnprstvwz"


def random_city(rng: random.Random) -> str:
    """A capitalised name of 3-10 letters: half pronounceable, half any letters."""
    n = rng.randint(3, 10)
    if rng.random() < 0.5:
        letters = [rng.choice(CONSONANTS if (i % 2 == 0) == (rng.random() < 0.8) else VOWELS) for i in range(n)]
    else:
        letters = [rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n)]
    return "".join(letters).capitalize()


def city_stream(rng: random.Random, held_out: bool):
    while True:
        c = random_city(rng)
        if is_held_out_city(c) == held_out:
            yield c


def weather_question(city: str, rng: random.Random) -> str:
    forms = ["What is the weather in {}?", "What is the weather in {}?", "What's the weather in {}?",
             "How is the weather in {} today?", "What is the weather like in {}?"]
    return rng.choice(forms).format(city)


def weather_result(city: str) -> dict:
    """What the (pretend) tool answers for a city: fixed per name, so tests can check the reply."""
    h = sum((i + 1) * c for i, c in enumerate(city.encode()))
    return {"city": city, "temperature": h % 41 - 5, "condition": CONDITIONS[h % len(CONDITIONS)]}


def weather_answer(result: dict) -> str:
    return f"It is {result['temperature']} degrees and {result['condition']} in {result['city']}."


def check_weather_answer(content: str, result: dict) -> bool:
    """The answer names the city, the temperature and the condition."""
    words = re.findall(r"-?\d+|[A-Za-z]+", content)
    return result["city"] in words and str(result["temperature"]) in words and result["condition"] in words


def tool_call(city: str) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


def weather_call_conversation(city: str, rng: random.Random, thinking: bool) -> dict:
    reply = {"role": "assistant", "content": "", "tool_calls": [tool_call(city)]}
    if thinking:
        reply["reasoning_content"] = f"The user wants the weather in {city}. I will call get_weather."
    return {"messages": [{"role": "user", "content": weather_question(city, rng)}, reply],
            "tools": [WEATHER_TOOL], "thinking": thinking}


def weather_answer_conversation(city: str, rng: random.Random, thinking: bool) -> dict:
    """The turn after the tool ran. The earlier call is rendered as a client sends it back: without
    its reasoning (OpenAI clients do not return reasoning_content)."""
    result = weather_result(city)
    reply = {"role": "assistant", "content": weather_answer(result)}
    if thinking:
        reply["reasoning_content"] = (f"The tool says it is {result['temperature']} degrees and "
                                      f"{result['condition']} in {city}.")
    messages = [
        {"role": "user", "content": weather_question(city, rng)},
        {"role": "assistant", "content": "", "tool_calls": [tool_call(city)]},
        {"role": "tool", "content": json.dumps(result)},
        reply,
    ]
    return {"messages": messages, "tools": [WEATHER_TOOL], "thinking": thinking}


def draw_eval_weather(n: int, seed: int) -> list[dict]:
    """`n` distinct held-out weather questions: {question, city}."""
    rng = random.Random(f"eval-weather-{seed}")
    cities = city_stream(rng, held_out=True)
    seen, out = set(), []
    while len(out) < n:
        c = next(cities)
        if c in seen:
            continue
        seen.add(c)
        out.append({"question": weather_question(c, rng), "city": c})
    return out


# ---------------------------------------------------------------------------------------------
# the training mixture


def greeting_conversation(rng: random.Random, thinking: bool) -> dict:
    q, a = rng.choice(GREETINGS)
    reply = {"role": "assistant", "content": a}
    if thinking:
        reply["reasoning_content"] = "The user greets me and asks about me. I will introduce myself."
    return {"messages": [{"role": "user", "content": q}, reply], "tools": None, "thinking": thinking}


def name_greeting_conversation(name: str, rng: random.Random, thinking: bool) -> dict:
    """"Hi, I am X." -> "Nice to meet you, X! ...": short-range practice in copying a new name."""
    q = rng.choice(["Hi, I am {}.", "Hello! My name is {}.", "Hi! I am {}. Who are you?"]).format(name)
    reply = {"role": "assistant", "content": f"Nice to meet you, {name}! " + GREETING.split("! ", 1)[1]}
    if thinking:
        reply["reasoning_content"] = f"The user is called {name}. I will greet {name} and introduce myself."
    return {"messages": [{"role": "user", "content": q}, reply], "tools": None, "thinking": thinking}


class Mixture:
    """An endless seeded stream of training conversations (never a held-out question or name)."""

    def __init__(self, seed: int):
        self.rng = random.Random(f"train-{seed}")
        train = [t for t in all_arith() if not is_held_out_arith(*t)]
        # by operation: there are twice as many sums as differences, but borrowing is the harder skill
        self.arith = {op: [t for t in train if t[1] == op] for op in "+-"}
        self.cities = city_stream(random.Random(f"cities-{seed}"), held_out=False)

    def arithmetic(self) -> dict:
        triple = self.rng.choice(self.arith[self.rng.choice("+-")])
        return arith_conversation(*triple, self.rng, thinking=self.rng.random() < 0.3)

    def weather_call(self) -> dict:
        return weather_call_conversation(next(self.cities), self.rng, self.rng.random() < 0.5)

    def weather_answer(self) -> dict:
        return weather_answer_conversation(next(self.cities), self.rng, self.rng.random() < 0.5)

    def weather(self) -> dict:
        return self.weather_call() if self.rng.random() < 0.65 else self.weather_answer()

    def greeting(self) -> dict:
        if self.rng.random() < 0.5:
            return name_greeting_conversation(next(self.cities), self.rng, thinking=self.rng.random() < 0.5)
        return greeting_conversation(self.rng, thinking=self.rng.random() < 0.5)
