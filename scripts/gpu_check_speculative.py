"""Figures of gpu-check.sh's glm5-speculative stage: `kiln run` of the same GLM-5 slice without
and with prompt-lookup drafts (128 tokens, the first from the prefill), optionally with drafts
from its MTP layer, and the performance model's prediction for the same plan. Prints one JSON
object.

usage: gpu_check_speculative.py PERF_JSON PLAIN_LOG DRAFTS_LOG PLAIN_TEXT DRAFTS_TEXT [MTP_LOG MTP_TEXT MTP_PERF_JSON]
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


def draft_counts(log):
    counts = re.search(r"speculative decoding: (\d+) draft tokens checked, (\d+) accepted", log)
    return (int(counts.group(1)), int(counts.group(2))) if counts else (None, None)


def main(perf_json, plain_log, drafts_log, plain_text, drafts_text, mtp_log=None, mtp_text=None, mtp_perf_json=None):
    perf = json.loads(read(perf_json) or "{}").get("perf", {})
    plain, spec = speed(read(plain_log)), speed(read(drafts_log))
    checked, accepted = draft_counts(read(drafts_log))
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
    if mtp_log is not None:
        mtp = speed(read(mtp_log))
        m_checked, m_accepted = draft_counts(read(mtp_log))
        text_mtp = read(mtp_text).strip() if mtp_text else ""
        figures["mtp_same_text"] = (text_mtp == text_plain) if text_mtp else None
        figures["measured_decode_tok_s_mtp"] = mtp
        figures["mtp_drafts_checked"] = m_checked
        figures["mtp_drafts_accepted"] = m_accepted
        if mtp and m_accepted is not None and plain:
            steps = 127 - m_accepted
            # a step's mean time with its draft steps, in ms, and over a 1-row step's
            figures["measured_mtp_step_ms"] = 127 / mtp / steps * 1e3
            figures["measured_mtp_step_over_1_row"] = (127 / mtp / steps) / (1 / plain)
        # the MTP plan's own prediction (its decode programs also keep their hidden rows)
        mtp_perf = json.loads(read(mtp_perf_json) or "{}").get("perf", {}) if mtp_perf_json else perf
        spec_rows = [r for r in mtp_perf.get("speculative", []) if r.get("batch") == 1 and r.get("context") == 2048 and r.get("drafts") == 3]
        if spec_rows and 1 in rows:
            r = spec_rows[0]
            figures["predicted_mtp_step_ms"] = r["step_ms_p2p"] + r.get("draft_ms_p2p", 0.0)
            figures["predicted_mtp_step_over_1_row"] = figures["predicted_mtp_step_ms"] / rows[1]["step_ms_p2p"]
    print(json.dumps(figures))


if __name__ == "__main__":
    main(*sys.argv[1:9])
