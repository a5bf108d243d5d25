#!/usr/bin/env python3
"""Per-kernel times of one decode step from an Nsight Compute CSV (`ncu --csv --metrics
gpu__time_duration.sum,dram__bytes.sum ... kiln run ...`), as scripts/gpu-check.sh records it.

A step starts at each `kiln_embed` launch; the last complete step is the decode step measured.
Prints each kernel (entry and grid) with its count, time, DRAM bytes and achieved bandwidth, and
the step's totals; with a second CSV (`--before`), the time each kernel had there.

Usage: scripts/ncu_decode_step.py NCU.csv [--before OLD.csv] [--json OUT.json]
"""
import argparse
import collections
import csv
import io
import json


def launches(path):
    text = open(path, errors="replace").read()
    text = text[text.index('"ID"'):]  # ncu prints its warnings before the table
    by_id = collections.OrderedDict()
    for row in csv.DictReader(io.StringIO(text)):
        k = by_id.setdefault(int(row["ID"]), {"kernel": row["Kernel Name"], "grid": row["Grid Size"]})
        k[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    return list(by_id.values())


def decode_step(path):
    ks = launches(path)
    starts = [i for i, k in enumerate(ks) if k["kernel"] == "kiln_embed"]
    if len(starts) < 2:
        raise SystemExit(f"{path}: fewer than two steps (kiln_embed launches) profiled")
    step = ks[starts[-1]:]
    rows = collections.OrderedDict()
    for k in step:
        r = rows.setdefault((k["kernel"], k["grid"]), {"count": 0, "us": 0.0, "bytes": 0.0})
        r["count"] += 1
        r["us"] += k["gpu__time_duration.sum"] / 1e3
        r["bytes"] += k.get("dram__bytes.sum", 0.0)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--before")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = decode_step(a.csv)
    before = decode_step(a.before) if a.before else {}
    total_us = sum(r["us"] for r in rows.values())
    total_b = sum(r["bytes"] for r in rows.values())
    head = f"{'us/step':>9} {'share':>6} {'n':>3} {'us each':>8} {'MB each':>8} {'TB/s':>5}"
    print(head + (f" {'before us':>9}" if before else "") + "  grid        kernel")
    for (name, grid), r in sorted(rows.items(), key=lambda kv: -kv[1]["us"]):
        line = f"{r['us']:9.1f} {100 * r['us'] / total_us:5.1f}% {r['count']:3d} {r['us'] / r['count']:8.1f} {r['bytes'] / r['count'] / 1e6:8.2f} {r['bytes'] / r['us'] / 1e6:5.2f}"
        if before:
            b = before.get((name, grid))
            line += f" {b['us']:9.1f}" if b else f" {'-':>9}"
        print(f"{line}  {grid:11s} {name}")
    launches_n = sum(r["count"] for r in rows.values())
    print(f"step: {total_us / 1e3:.3f} ms of kernels, {launches_n} launches, {total_b / 1e9:.3f} GB of DRAM traffic ({total_b / total_us / 1e6:.2f} TB/s)")
    if before:
        print(f"before: {sum(r['us'] for r in before.values()) / 1e3:.3f} ms")
    if a.json:
        json.dump({"step_kernel_ms": total_us / 1e3, "launches": launches_n, "dram_bytes": total_b,
                   "kernels": [{"kernel": n, "grid": g, **r} for (n, g), r in rows.items()]}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
