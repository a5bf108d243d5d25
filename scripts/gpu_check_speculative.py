"""Figures of gpu-check.sh's glm5-speculative stage: `kiln run` of the same GLM-5 slice without
and with prompt-lookup drafts (128 tokens, the first from the prefill), and the performance
model's prediction for the same plan. Prints one JSON object.

usage: gpu_check_speculative.py PERF_JSON PLAIN_LOG DRAFTS_LOG PLAIN_TEXT DRAFTS_TEXT
"""
import json
import re
import sys


def read(path):
    try:
        return open(path, errors="replace").read()
    except OSError:
        return ""


def speed(log):
    found = re.findall(r"([0-9.]+) tok/s decode", log)
    return float(found[-1]) if found else None


def main(perf_json, plain_log, drafts_log, plain_text, drafts_text):
    perf = json.loads(read(perf_json) or "{}").get("perf", {})
    plain, spec = speed(read(plain_log)), speed(read(drafts_log))
    counts = re.search(r"speculative decoding: (\d+) draft tokens checked, (\d+) accepted", read(drafts_log))
    checked, accepted = (int(counts.group(1)), int(counts.group(2))) if counts else (None, None)
    text_plain, text_drafts = read(plain_text).strip(), read(drafts_text).strip()
    figures = {
        "same_text": bool(text_plain) and text_plain == text_drafts,
        "measured_decode_tok_s_plain": plain,
        "measured_decode_tok_s_speculative": spec,
        "drafts_checked": checked,
        "drafts_accepted": accepted,
    }
    rows = {r["batch"]: r for r in perf.get("decode", []) if r.get("context") == 2048}
    if 1 in rows and 4 in rows:
        figures["predicted_step_ms_1_row"] = rows[1]["step_ms_p2p"]
        figures["predicted_step_ms_4_rows"] = rows[4]["step_ms_p2p"]
        figures["predicted_4_over_1"] = rows[4]["step_ms_p2p"] / rows[1]["step_ms_p2p"]
    if plain and spec and accepted is not None:
        # 127 decoded tokens: one a step plus one for each accepted draft
        steps = 127 - accepted
        figures["steps_speculative"] = steps
        figures["rows_per_step"] = (steps + checked) / steps
        # a speculative step's mean time over a 1-row step's
        figures["measured_step_over_1_row"] = (127 / spec / steps) / (1 / plain)
    print(json.dumps(figures))


if __name__ == "__main__":
    main(*sys.argv[1:6])
