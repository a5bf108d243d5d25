"""The official `openai` client against `kiln serve` (tiny demo model, CPU backend).

Run by tests/server.rs, which starts the server with --enable-test-hooks and passes its URL in
KILN_BASE_URL. The test hook `kiln_forced_output` makes the engine emit a given text instead of
sampling (the model still runs every forward pass), so parser results are known exactly while
the HTTP path stays real.
"""

import concurrent.futures
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request

import openai

BASE = os.environ["KILN_BASE_URL"]
MODEL = os.environ.get("KILN_MODEL", "kiln-tiny")
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=120)

WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Get weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                           "required": ["city"]}}}]
FAILURES = []


def check(name, cond, detail=""):
    if not cond:
        FAILURES.append(f"{name}: {detail}")
        print(f"FAIL {name}: {detail}")
    else:
        print(f"ok   {name}")


def raw(path, body, method="POST"):
    req = urllib.request.Request(BASE + path, data=body if isinstance(body, bytes) else json.dumps(body).encode(),
                                 method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(name):
    text = urllib.request.urlopen(BASE + "/metrics", timeout=10).read().decode()
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_models_and_health():
    models = client.models.list()
    check("models lists the served model", [m.id for m in models.data] == [MODEL], models)
    check("health is 200", urllib.request.urlopen(BASE + "/health").status == 200)


def chat(forced=None, **kw):
    extra = dict(kw.pop("extra_body", {}))
    if forced is not None:
        extra["kiln_forced_output"] = forced
    return client.chat.completions.create(model=MODEL, extra_body=extra, **kw)


def test_chat_reasoning():
    r = chat("Thinking about it.</think>The answer is 4.", messages=[{"role": "user", "content": "2+2?"}], max_tokens=200)
    m = r.choices[0].message
    check("chat reasoning_content", getattr(m, "reasoning_content", None) == "Thinking about it.", m)
    check("chat content", m.content == "The answer is 4.", m)
    check("chat finish stop", r.choices[0].finish_reason == "stop", r.choices[0].finish_reason)
    details = r.usage.completion_tokens_details
    check("usage reasoning tokens", details is not None and details.reasoning_tokens > 0, r.usage)
    check("usage totals", r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage)

    off = chat("Hello there.", messages=[{"role": "user", "content": "hi"}], max_tokens=50,
               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m = off.choices[0].message
    check("thinking off: all content", m.content == "Hello there." and getattr(m, "reasoning_content", None) in (None, ""), m)

    trunc = chat("still thinking and thinking", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    m = trunc.choices[0].message
    check("truncated reasoning: content null", m.content is None and trunc.choices[0].finish_reason == "length", trunc)
    check("truncated reasoning: reasoning kept", bool(getattr(m, "reasoning_content", "")), m)


def test_chat_streaming_matches():
    forced = "Plan: answer.</think>Final answer."
    full = chat(forced, messages=[{"role": "user", "content": "q"}], max_tokens=100)
    stream = chat(forced, messages=[{"role": "user", "content": "q"}], max_tokens=100, stream=True,
                  stream_options={"include_usage": True})
    reasoning, content, finish, usage = "", "", None, None
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    m = full.choices[0].message
    check("stream reasoning == non-stream", reasoning == m.reasoning_content, (reasoning, m.reasoning_content))
    check("stream content == non-stream", content == m.content, (content, m.content))
    check("stream finish", finish == "stop", finish)
    check("stream usage", usage is not None and usage.completion_tokens == full.usage.completion_tokens, usage)


def test_tools():
    forced = ("I need the weather.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
              "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call><tool_call>get_weather<arg_key>city</arg_key>"
              "<arg_value>Rome</arg_value></tool_call>")
    msgs = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    r = chat(forced, messages=msgs, tools=WEATHER, max_tokens=300)
    c = r.choices[0]
    calls = c.message.tool_calls or []
    check("tool finish_reason", c.finish_reason == "tool_calls", c.finish_reason)
    check("two tool calls", [t.function.name for t in calls] == ["get_weather", "get_weather"], calls)
    if len(calls) == 2:
        check("typed arguments", json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}, calls[0].function.arguments)
        check("second call", json.loads(calls[1].function.arguments) == {"city": "Rome"}, calls[1].function.arguments)
    check("reasoning before tools", c.message.reasoning_content == "I need the weather.", c.message)

    stream = chat(forced, messages=msgs, tools=WEATHER, max_tokens=300, stream=True)
    args, names, finish = {}, {}, None
    for ch in stream:
        for ci in ch.choices:
            finish = ci.finish_reason or finish
            for tc in ci.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    check("name arrives once", tc.index not in names, tc)
                    names[tc.index] = tc.function.name
                if tc.function and tc.function.arguments:
                    args[tc.index] = args.get(tc.index, "") + tc.function.arguments
    check("streamed tool names", names == {0: "get_weather", 1: "get_weather"}, names)
    check("streamed tool args", {k: json.loads(v) for k, v in args.items()} == {0: {"city": "Paris", "days": 3}, 1: {"city": "Rome"}}, args)
    check("streamed tool finish", finish == "tool_calls", finish)

    # A call to a tool the request does not list is dropped (SGLang's glm47), streamed or not.
    unlisted = "</think>Checking. <tool_call>delete_files<arg_key>path</arg_key><arg_value>/</arg_value></tool_call>"
    r = chat(unlisted, messages=msgs, tools=WEATHER, max_tokens=300).choices[0]
    check("unlisted tool dropped", not r.message.tool_calls and r.finish_reason == "stop" and r.message.content == "Checking.", r)
    streamed = [ci.delta for ch in chat(unlisted, messages=msgs, tools=WEATHER, max_tokens=300, stream=True) for ci in ch.choices]
    check("unlisted tool not streamed", not any(d.tool_calls for d in streamed), streamed)

    # A tool round trip renders through the chat template without error.
    follow = chat("It is sunny.", messages=msgs + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 18}"}], tools=WEATHER, max_tokens=20,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    check("tool result turn", follow.choices[0].message.content == "It is sunny.", follow.choices[0].message)


def test_completions():
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, seed=1)
    check("completion length", r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 8, r)
    again = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, seed=1)
    check("greedy is reproducible", r.choices[0].text == again.choices[0].text, (r.choices[0].text, again.choices[0].text))
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=8, temperature=0, stream=True) if c.choices)
    check("streamed completion == non-streamed", text == r.choices[0].text, (text, r.choices[0].text))
    forced = client.completions.create(model=MODEL, prompt="Hi", max_tokens=50, extra_body={"kiln_forced_output": "abc STOP def"}, stop=["STOP"])
    check("stop string", forced.choices[0].text == "abc " and forced.choices[0].finish_reason == "stop", forced.choices[0])


def test_errors():
    status, body = raw("/v1/chat/completions", b"{not json")
    check("malformed JSON 400", status == 400 and body["error"]["type"] == "invalid_request_error", (status, body))
    for k in ("message", "type", "param", "code"):
        check(f"error has {k}", k in body["error"], body)
    status, body = raw("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    check("unknown model 404", status == 404 and body["error"]["code"] == "model_not_found", (status, body))
    status, body = raw("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1})
    check("negative max_tokens 400", status == 400 and body["error"]["param"] == "max_tokens", (status, body))
    status, body = raw("/v1/completions", {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 4})
    check("prompt longer than context 400", status == 400 and body["error"]["code"] == "context_length_exceeded"
          and body["error"]["param"] == "prompt", (status, body))
    status, body = raw("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "stop": ["s" * 300]})
    check("oversized stop string 400", status == 400 and body["error"]["param"] == "stop", (status, body))
    status, body = raw("/v1/completions", {"model": MODEL, "prompt": [1, 2, 2**40], "max_tokens": 4})
    check("token id out of range 400", status == 400 and body["error"]["param"] == "prompt", (status, body))
    status, body = raw("/v1/chat/completions", {"model": MODEL})
    check("missing messages 400", status == 400 and body["error"]["param"] == "messages", (status, body))
    try:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        check("client raises NotFoundError", False)
    except openai.NotFoundError:
        check("client raises NotFoundError", True)


def test_concurrency_and_disconnects():
    def one(i):
        s = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"count {i}"}],
                                           max_tokens=24, stream=True, temperature=0.7, seed=i)
        n, finish = 0, None
        for ch in s:
            for c in ch.choices:
                n += bool(c.delta.content or getattr(c.delta, "reasoning_content", None))
                finish = c.finish_reason or finish
        return finish
    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        finishes = list(ex.map(one, range(32)))
    check("32 concurrent streams finish", all(f in ("stop", "length") for f in finishes), finishes)

    # Clients that hang up mid-stream leave no KV pages behind.
    for i in range(6):
        s = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=400,
                                           stream=True, extra_body={"ignore_eos": True})
        for j, _ in enumerate(s):
            if j == 2:
                break
        s.close()
    deadline = time.time() + 30
    while time.time() < deadline and metric("kiln_kv_cache_pages_used") != 0:
        time.sleep(0.1)
    check("KV pages return to zero", metric("kiln_kv_cache_pages_used") == 0, metric("kiln_kv_cache_pages_used"))
    check("no request left running", metric("kiln_requests_running") == 0, metric("kiln_requests_running"))
    check("metrics count tokens", (metric("kiln_generation_tokens_total") or 0) > 0)
    check("TTFT histogram", metric("kiln_time_to_first_token_seconds_count") > 0)


if __name__ == "__main__":
    # KILN_SKIP_TESTS: comma-separated test names a caller covers elsewhere (see its comment)
    skip = set(filter(None, os.environ.get("KILN_SKIP_TESTS", "").split(",")))
    unknown = skip - {n for n in globals() if n.startswith("test_")}
    check("KILN_SKIP_TESTS names tests", not unknown, sorted(unknown))
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn) and name not in skip:
            try:
                fn()
            except Exception as e:  # a crash in one test is a failure, not an abort
                check(name, False, repr(e))
    print(f"{'FAILED' if FAILURES else 'PASSED'}: {len(FAILURES)} failures")
    sys.exit(1 if FAILURES else 0)
