"""The request fields real clients send, through the official `openai` client, against
`kiln serve` on the tiny model (random weights, CPU backend): logprobs, `n`, penalties,
min_tokens / stop_token_ids, structured output (json_object, json_schema, forced tool_choice)
and the prefix cache. Run by tests/server.rs; the server's URL is in KILN_BASE_URL.

The weights are random, so outputs are checked against formulas and schemas, never against
fixed text: the chosen token must be the argmax of the penalised log-probabilities the server
itself reports, constrained outputs must parse and validate, and so on.
"""

import json
import math
import os
import re
import sys
import urllib.error
import urllib.request

import openai

BASE = os.environ["KILN_BASE_URL"]
MODEL = os.environ.get("KILN_MODEL", "kiln-tiny")
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=300)
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
FAILURES = []

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Get the time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"]}}}


def check(name, cond, detail=""):
    if not cond:
        FAILURES.append(f"{name}: {detail}")
        print(f"FAIL {name}: {detail}")
    else:
        print(f"ok   {name}")


def raw(path, body):
    req = urllib.request.Request(BASE + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(name):
    text = urllib.request.urlopen(BASE + "/metrics", timeout=10).read().decode()
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def user(text):
    return [{"role": "user", "content": text}]


def test_chat_logprobs():
    r = client.chat.completions.create(model=MODEL, messages=user("Say something."), max_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=5, extra_body=THINKING_OFF)
    entries = r.choices[0].logprobs.content
    check("chat: one logprob entry per token", len(entries) == r.usage.completion_tokens, (len(entries), r.usage))
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        ok = (len(tops) == 5 and tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
              and sum(math.exp(t) for t in tops) <= 1 + 1e-4)
        # Greedy without penalties picks the most likely token: its logprob is the top one.
        ok = ok and abs(e.logprob - tops[0]) < 1e-6 and e.token == e.top_logprobs[0].token
        ok = ok and bytes(e.bytes).decode("utf-8", "replace") == e.token
        if not ok:
            check("chat: logprob entry is a ranked log-softmax", False, e)
            break
    else:
        check("chat: logprob entries are ranked log-softmax values, greedy picks the top", True)

    stream = client.chat.completions.create(model=MODEL, messages=user("Say something."), max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=5, stream=True, extra_body=THINKING_OFF)
    streamed = [e for ch in stream for c in ch.choices if c.logprobs and c.logprobs.content for e in c.logprobs.content]
    check("chat: streamed logprobs == non-streamed",
          [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in entries],
          (len(streamed), len(entries)))
    plain = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=3, extra_body=THINKING_OFF)
    check("chat: no logprobs unless asked", plain.choices[0].logprobs is None, plain.choices[0].logprobs)


def test_completion_logprobs():
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    check("completions: parallel lists per token",
          len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n, lp)
    check("completions: top_logprobs hold 3 alternatives", all(1 <= len(t) <= 3 for t in lp.top_logprobs), lp.top_logprobs)
    check("completions: the greedy token is the most likely",
          all(abs(l - max(t.values())) < 1e-6 for l, t in zip(lp.token_logprobs, lp.top_logprobs)), lp)
    check("completions: text offsets increase", lp.text_offset == sorted(lp.text_offset), lp.text_offset)
    if "\ufffd" not in r.choices[0].text:
        check("completions: tokens spell the text", "".join(lp.tokens) == r.choices[0].text, (lp.tokens, r.choices[0].text))
    chunks = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=3,
                                       stream=True)
    streamed = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.token_logprobs]
    check("completions: streamed logprobs == non-streamed",
          [round(x, 5) for x in streamed] == [round(x, 5) for x in lp.token_logprobs], (streamed, lp.token_logprobs))


def test_n_choices():
    one = client.chat.completions.create(model=MODEL, messages=user("Pick a word."), max_tokens=10, temperature=0,
                                         extra_body=THINKING_OFF)
    three = client.chat.completions.create(model=MODEL, messages=user("Pick a word."), max_tokens=10, temperature=0, n=3,
                                           extra_body=THINKING_OFF)
    check("n=3: three choices, indexed", [c.index for c in three.choices] == [0, 1, 2], three.choices)
    check("n=3 greedy: every choice equals n=1 (shared prompt pages are read, never corrupted)",
          all(c.message.content == one.choices[0].message.content for c in three.choices), three.choices)
    check("n=3: usage counts the prompt once, every completion",
          three.usage.prompt_tokens == one.usage.prompt_tokens
          and three.usage.completion_tokens == 3 * one.usage.completion_tokens, three.usage)
    sampled = client.chat.completions.create(model=MODEL, messages=user("Pick a word."), max_tokens=16, temperature=1.0,
                                             seed=5, n=4, extra_body=THINKING_OFF)
    again = client.chat.completions.create(model=MODEL, messages=user("Pick a word."), max_tokens=16, temperature=1.0,
                                           seed=5, n=4, extra_body=THINKING_OFF)
    texts = [c.message.content for c in sampled.choices]
    check("n=4 sampled: independent choices", len(set(texts)) > 1, texts)
    check("n=4 sampled: reproducible with a seed", texts == [c.message.content for c in again.choices], texts)
    stream = client.chat.completions.create(model=MODEL, messages=user("Pick a word."), max_tokens=10, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True}, extra_body=THINKING_OFF)
    text, finish, usage = {}, {}, None
    for ch in stream:
        usage = ch.usage or usage
        for c in ch.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    check("n=2 streamed: both choices arrive and finish", sorted(text) == [0, 1] and all(finish.values()), (text, finish))
    check("n=2 streamed: same text as non-streamed", all(t == (one.choices[0].message.content or "") for t in text.values()), text)
    check("n=2 streamed: usage", usage is not None and usage.completion_tokens == 2 * one.usage.completion_tokens, usage)
    c = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0, n=2)
    check("completions n=2", len(c.choices) == 2 and c.choices[0].text == c.choices[1].text, c.choices)


def penalised_argmax_holds(entries, presence, frequency):
    """Greedy with penalties must pick the token with the highest raw logprob minus the
    OpenAI penalty (the log-softmax's shift is the same for every token at a step). Tokens are
    `token_id:N` (return_tokens_as_token_ids), as byte tokens' texts collide."""
    counts = {}
    for e in entries:
        score = lambda tok, lp: lp - frequency * counts.get(tok, 0) - (presence if counts.get(tok, 0) else 0)
        chosen = score(e.token, e.logprob)
        if any(score(t.token, t.logprob) > chosen + 1e-5 for t in e.top_logprobs):
            return False, e
        counts[e.token] = counts.get(e.token, 0) + 1
    return True, None


def test_penalties():
    kw = dict(model=MODEL, messages=user("Repeat after me: la la la"), max_tokens=40, temperature=0,
              logprobs=True, top_logprobs=20, extra_body={**THINKING_OFF, "return_tokens_as_token_ids": True, "ignore_eos": True})
    base = client.chat.completions.create(**kw)
    pen = client.chat.completions.create(presence_penalty=0.7, frequency_penalty=1.3, **kw)
    ok, bad = penalised_argmax_holds(pen.choices[0].logprobs.content, 0.7, 1.3)
    check("presence/frequency penalties follow OpenAI's formula", ok, bad)
    ok, bad = penalised_argmax_holds(base.choices[0].logprobs.content, 0.0, 0.0)
    check("without penalties greedy is the raw argmax", ok, bad)
    check("the penalties changed the output", [e.token for e in pen.choices[0].logprobs.content]
          != [e.token for e in base.choices[0].logprobs.content])
    rep = client.chat.completions.create(model=MODEL, messages=user("la la la"), max_tokens=8, temperature=0,
                                         extra_body={**THINKING_OFF, "repetition_penalty": 1.5})
    check("repetition_penalty accepted", rep.choices[0].finish_reason in ("stop", "length"), rep)
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)):
        status, body = raw("/v1/chat/completions", {"model": MODEL, "messages": user("x"), field: value})
        check(f"{field}={value} is a 400 naming it", status == 400 and body["error"]["param"] == field, (status, body))


def test_min_tokens_and_stop_token_ids():
    first = client.completions.create(model=MODEL, prompt="The", max_tokens=1, temperature=0, logprobs=0,
                                      extra_body={"return_tokens_as_token_ids": True})
    tid = int(first.choices[0].logprobs.tokens[0].removeprefix("token_id:"))
    stopped = client.completions.create(model=MODEL, prompt="The", max_tokens=8, temperature=0, extra_body={"stop_token_ids": [tid]})
    check("stop_token_ids end generation before the token", stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop",
          stopped.choices[0])
    held = client.completions.create(model=MODEL, prompt="The", max_tokens=8, temperature=0, logprobs=0,
                                     extra_body={"stop_token_ids": [tid], "min_tokens": 3, "return_tokens_as_token_ids": True})
    ids = [int(t.removeprefix("token_id:")) for t in held.choices[0].logprobs.tokens]
    check("min_tokens holds stop ids back", len(ids) >= 3 and tid not in ids[:3], (tid, ids))
    status, body = raw("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "min_tokens": 5})
    check("min_tokens > max_tokens is a 400", status == 400 and body["error"]["param"] == "min_tokens", (status, body))


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"type": "string", "enum": ["happy", "sad"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
    "required": ["name", "age", "mood"], "additionalProperties": False}


def valid(doc):
    return (isinstance(doc, dict) and set(doc) <= set(SCHEMA["properties"]) and {"name", "age", "mood"} <= set(doc)
            and isinstance(doc["name"], str) and len(doc["name"]) <= 8
            and isinstance(doc["age"], int) and not isinstance(doc["age"], bool) and 0 <= doc["age"] <= 120
            and doc["mood"] in ("happy", "sad")
            and (("tags" not in doc) or (isinstance(doc["tags"], list) and len(doc["tags"]) <= 2
                                         and all(isinstance(t, str) and len(t) <= 4 for t in doc["tags"]))))


def test_json_outputs():
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=user("Describe a person."), max_tokens=400, temperature=1.0,
                                           seed=seed, response_format=fmt, extra_body=THINKING_OFF)
        c = r.choices[0]
        try:
            doc = json.loads(c.message.content)
        except Exception as e:  # noqa: BLE001
            doc = e
        check(f"json_schema (seed {seed}): the content validates", c.finish_reason == "stop" and valid(doc), (c.finish_reason, c.message.content))
    # Thinking on: free reasoning (random weights end it with `</think>` at ~1/320 per token),
    # then the JSON; no max_tokens, so the whole context is the budget. Seeded: deterministic.
    r = client.chat.completions.create(model=MODEL, messages=user("Describe a person."), temperature=1.0,
                                       seed=9, response_format=fmt)
    c = r.choices[0]
    try:
        doc = json.loads(c.message.content or "")
    except Exception as e:  # noqa: BLE001
        doc = e
    check("json_schema with thinking: reasoning first, then valid content", c.finish_reason == "stop" and valid(doc),
          (c.finish_reason, c.message.content))
    # No schema bounds a json_object's strings: the whole context is the budget (seeded).
    for seed in range(3):
        obj = client.chat.completions.create(model=MODEL, messages=user("JSON please"), temperature=1.0, seed=seed,
                                             response_format={"type": "json_object"}, extra_body=THINKING_OFF)
        try:
            parsed = json.loads(obj.choices[0].message.content)
        except Exception as e:  # noqa: BLE001
            parsed = e
        check(f"json_object (seed {seed}): the content is a JSON object", isinstance(parsed, dict), obj.choices[0].message.content)
    comp = client.completions.create(model=MODEL, prompt="{", max_tokens=400, temperature=0.8, seed=2,
                                     extra_body={"response_format": fmt})
    try:
        doc = json.loads(comp.choices[0].text)
    except Exception as e:  # noqa: BLE001
        doc = e
    check("completions json_schema validates", valid(doc), comp.choices[0].text)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=MODEL, messages=user("Describe a person."), max_tokens=400, temperature=1.0, seed=0, response_format=fmt,
        stream=True, extra_body=THINKING_OFF) if ch.choices)
    check("json_schema streamed validates", valid(json.loads(streamed)) if streamed else False, streamed)


def call_args(call):
    try:
        return json.loads(call.function.arguments)
    except Exception:  # noqa: BLE001
        return None


def test_tool_choice():
    msgs = user("What is the weather in Oslo?")
    for thinking in (False, True):
        extra = {} if thinking else THINKING_OFF
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                           temperature=1.0, seed=3, extra_body=extra)
        c = r.choices[0]
        calls = c.message.tool_calls or []
        ok = bool(calls) and c.finish_reason == "tool_calls"
        for t in calls:
            a = call_args(t)
            if t.function.name == "get_weather":
                ok = ok and isinstance(a, dict) and isinstance(a.get("city"), str) and len(a["city"]) <= 12 \
                    and set(a) <= {"city", "days"} and (("days" not in a) or (isinstance(a["days"], int) and 1 <= a["days"] <= 7))
            elif t.function.name == "get_time":
                ok = ok and a in ({"zone": "UTC"}, {"zone": "CET"})
            else:
                ok = False
        check(f"tool_choice required (thinking {thinking}): valid calls to the given tools", ok, (c.finish_reason, c.message))

    named = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           temperature=1.0, seed=4, extra_body=THINKING_OFF)
    calls = named.choices[0].message.tool_calls or []
    check("named tool_choice: exactly one call to that function",
          len(calls) == 1 and calls[0].function.name == "get_time" and call_args(calls[0]) in ({"zone": "UTC"}, {"zone": "CET"}),
          named.choices[0].message)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            temperature=1.0, seed=4, stream=True, extra_body=THINKING_OFF)
    names, args, finish = {}, {}, None
    for ch in stream:
        for c in ch.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    names[tc.index] = tc.function.name
                if tc.function and tc.function.arguments:
                    args[tc.index] = args.get(tc.index, "") + tc.function.arguments
    check("named tool_choice streamed", names == {0: "get_weather"} and finish == "tool_calls"
          and isinstance(json.loads(args.get(0, "null")), dict), (names, args, finish))

    # "none": the tools stay in the prompt, but no call can be generated (the tag is masked).
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none", max_tokens=60,
                                           temperature=1.5, seed=seed, extra_body=THINKING_OFF)
        check(f"tool_choice none (seed {seed}): no tool calls", not r.choices[0].message.tool_calls
              and "<tool_call>" not in (r.choices[0].message.content or ""), r.choices[0].message)


def test_unsupported_values_are_400s_naming_the_field():
    base = {"model": MODEL, "messages": user("x"), "max_tokens": 2}
    cases = [
        ({"n": 0}, "n"), ({"n": 17}, "n"), ({"best_of": 2}, "best_of"), ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"), ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ]
    for extra, param in cases:
        status, body = raw("/v1/chat/completions", {**base, **extra})
        check(f"{extra} -> 400 {param}", status == 400 and body["error"]["param"] == param, (status, body))
    malformed = [
        ({"messages": ["hi"]}, "messages"), ({"messages": [{"content": "hi"}]}, "messages"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, "messages"), ({"messages": [{"role": "user", "content": None}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]}, "messages"),
        ({"tools": [{"type": "function"}]}, "tools"), ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"), ({"tools": "f"}, "tools"),
    ]
    for extra, param in malformed:
        status, body = raw("/v1/chat/completions", {**base, **extra})
        check(f"malformed {extra} -> 400 {param}", status == 400 and body["error"]["param"] == param, (status, body))
    ok_msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "q"}]},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    status, body = raw("/v1/chat/completions", {**base, "messages": ok_msgs, "tools": [WEATHER]})
    check("a well-formed tool round trip is accepted", status == 200, (status, body))
    for extra, param in (({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"logprobs": 21}, "logprobs")):
        status, body = raw("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, **extra})
        check(f"completions {extra} -> 400 {param}", status == 400 and body["error"]["param"] == param, (status, body))


def test_prefix_cache():
    prompt = [(i * 37 + 11) % 256 for i in range(700)]
    before = metric("kiln_prefix_cache_hit_tokens_total") or 0
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    check("a repeated prompt is served from the prefix cache", cached >= 0.8 * len(prompt), again.usage)
    check("the first time nothing was cached", first.usage.prompt_tokens_details.cached_tokens == 0, first.usage)
    check("identical greedy output with the cache", first.choices[0].text == again.choices[0].text,
          (first.choices[0].text, again.choices[0].text))
    after = metric("kiln_prefix_cache_hit_tokens_total")
    check("the hit counter rises by the cached tokens", after - before == cached, (before, after, cached))


if __name__ == "__main__":
    only = sys.argv[1:]
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn) and (not only or name in only):
            try:
                fn()
            except Exception as e:  # a crash in one test is a failure, not an abort
                check(name, False, repr(e))
    print(f"{'FAILED' if FAILURES else 'PASSED'}: {len(FAILURES)} failures")
    sys.exit(1 if FAILURES else 0)
