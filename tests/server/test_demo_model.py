"""The trained demo model (artifacts/demo-model) through `kiln serve` and the official openai client.

Held-out questions only (scripts/demo_model/data.py draws them; the training data never holds
them): arithmetic with thinking on (non-empty reasoning_content, the answer in content) and off,
and weather questions with the get_weather tool (the right call, finish_reason "tool_calls"),
then the follow-up answer from a tool result. Prints one line per group and a JSON summary, and
exits non-zero when a group is below its threshold.

Environment: KILN_BASE_URL, KILN_MODEL; optional KILN_DEMO_ARITH (200), KILN_DEMO_WEATHER (50),
KILN_DEMO_MIN (0.95, issue 12's bar for every gated group), and per group KILN_DEMO_MIN_THINK_ON,
KILN_DEMO_MIN_THINK_OFF, KILN_DEMO_MIN_WEATHER (default KILN_DEMO_MIN): a caller may hold a model
that misses the bar to its own measured floor; the report always says whether the bar is met.
"""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "demo_model"))
import data  # noqa: E402
from openai import OpenAI  # noqa: E402

client = OpenAI(base_url=os.environ["KILN_BASE_URL"] + "/v1", api_key="none", max_retries=0, timeout=600)
MODEL = os.environ.get("KILN_MODEL", "kiln-demo")
N_ARITH = int(os.environ.get("KILN_DEMO_ARITH", "200"))
N_WEATHER = int(os.environ.get("KILN_DEMO_WEATHER", "50"))
BAR = float(os.environ.get("KILN_DEMO_MIN", "0.95"))
FLOORS = {
    "arithmetic, thinking on": float(os.environ.get("KILN_DEMO_MIN_THINK_ON", BAR)),
    "arithmetic, thinking off": float(os.environ.get("KILN_DEMO_MIN_THINK_OFF", BAR)),
    "weather tool call": float(os.environ.get("KILN_DEMO_MIN_WEATHER", BAR)),
}


def chat(messages, thinking=True, tools=None, max_tokens=160):
    kwargs = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens,
              "extra_body": {"chat_template_kwargs": {"enable_thinking": thinking}}}
    if tools:
        kwargs["tools"] = tools
    return client.chat.completions.create(**kwargs).choices[0]


def arith(item, thinking):
    c = chat([{"role": "user", "content": item["question"]}], thinking=thinking)
    reasoning = getattr(c.message, "reasoning_content", None) or ""
    ok = data.check_arith_answer(c.message.content or "", item["answer"]) and c.finish_reason == "stop"
    ok = ok and (bool(reasoning.strip()) if thinking else not reasoning)
    return ok, {"q": item["question"], "reasoning": reasoning, "content": c.message.content, "finish": c.finish_reason}


def weather(item):
    messages = [{"role": "user", "content": item["question"]}]
    c = chat(messages, tools=[data.WEATHER_TOOL])
    calls = c.message.tool_calls or []
    ok = (c.finish_reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_weather"
          and json.loads(calls[0].function.arguments) == {"city": item["city"]})
    detail = {"q": item["question"], "calls": [(t.function.name, t.function.arguments) for t in calls], "finish": c.finish_reason}
    if not ok:
        return ok, False, detail
    # The follow-up: the tool result goes back, the answer must use it.
    result = data.weather_result(item["city"])
    messages += [{"role": "assistant", "content": None,
                  "tool_calls": [{"id": calls[0].id, "type": "function",
                                  "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
                 {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps(result)}]
    c = chat(messages, tools=[data.WEATHER_TOOL])
    follow = data.check_weather_answer(c.message.content or "", result) and c.finish_reason == "stop"
    detail["answer"] = c.message.content
    return ok, follow, detail


def main():
    items = data.draw_eval_arith(N_ARITH, seed=1)
    cities = data.draw_eval_weather(N_WEATHER, seed=2)
    with ThreadPoolExecutor(16) as pool:
        on = list(pool.map(lambda i: arith(i, True), items))
        off = list(pool.map(lambda i: arith(i, False), items))
        wx = list(pool.map(weather, cities))
    groups = {
        "arithmetic, thinking on": [ok for ok, _ in on],
        "arithmetic, thinking off": [ok for ok, _ in off],
        "weather tool call": [ok for ok, _, _ in wx],
        "weather answer from the tool result": [f for _, f, _ in wx],
    }
    summary = {}
    failed = False
    for name, oks in groups.items():
        acc = sum(oks) / len(oks)
        summary[name] = {"correct": sum(oks), "of": len(oks), "accuracy": acc}
        # The follow-up answer is reported; the bar is on the first three.
        floor = FLOORS.get(name)
        summary[name]["meets_bar"] = acc >= BAR
        failed |= floor is not None and acc < floor
        note = " (reported)" if floor is None else f" (bar {BAR:.0%}: {'met' if acc >= BAR else 'MISSED'}; floor {floor:.0%})"
        print(f"{name}: {sum(oks)}/{len(oks)} = {acc:.1%}{note}")
    for label, rows in (("thinking on", on), ("thinking off", off)):
        for ok, d in rows:
            if not ok:
                print(f"  wrong ({label}): {json.dumps(d)}")
    for ok, _, d in wx:
        if not ok:
            print(f"  wrong (weather): {json.dumps(d)}")
    print(json.dumps(summary))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
