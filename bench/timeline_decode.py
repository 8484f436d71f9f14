#!/usr/bin/env python3
"""Summarize decode block timelines (bench_gpu_moe --timeline, a build with
-DCSFMOE_DECODE_TIMELINE=1): where one call's time goes across its blocks.

  python3 bench/timeline_decode.py timeline.jsonl [--plot out.png]

Per call (shape, T, mode) and GEMM: blocks launched and working, when the
first and last started and exited (us from the first gate/up block's start),
the median working block's life, prologue and (down) wait, how long the last
10 % of blocks ran after 90 % had exited (the tail), and the gap between the
last gate/up exit and the first down block passing its wait. `outside` is the
call's event time less the span of the two GEMMs' blocks: routing, combine and
launch latency.
"""
import argparse
import json
import statistics
from collections import defaultdict

MODES = {0: "native", 1: "expanded", 2: "routed", 3: "stage_read", 4: "tiled", 5: "decode", 6: "prefill", 7: "serial"}


def load(path):
    calls = defaultdict(list)
    for line in open(path):
        d = json.loads(line)
        calls[(d["shape"], d["T"], d["mode"])].append(d)
    return calls


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(key, events):
    shape, T, mode = key
    t0 = min(e["t"][0] for e in events if e["gate_up"]) if any(e["gate_up"] for e in events) else 0
    us = lambda ns: (ns - t0) / 1e3
    call_us = events[0]["call_us"]
    lines = [f"{shape} T={T} {MODES.get(mode, mode)}: call {call_us:.1f} us"]
    span = {}
    for gate_up, name in ((1, "gate/up"), (0, "down")):
        evs = [e for e in events if e["gate_up"] == gate_up]
        if not evs:
            continue
        work = [e for e in evs if e["t"][2] != 0]
        starts = [us(e["t"][0]) for e in evs]
        exits = [us(e["t"][4]) for e in work] or [us(e["t"][4]) for e in evs]
        life = [(e["t"][4] - e["t"][0]) / 1e3 for e in work]
        prologue = [(e["t"][2] - e["t"][1]) / 1e3 for e in work]
        wait = [(e["t"][3] - e["t"][2]) / 1e3 for e in work]
        ready = [us(e["t"][3]) for e in work]
        tail = max(exits) - quantile(exits, 0.9)
        sms = len({e["sm"] for e in work})
        span[name] = (min(starts), max(exits), min(ready) if ready else float("nan"))
        lines.append(
            f"  {name:8s} blocks {len(evs):5d} working {len(work):5d} on {sms:3d} SMs | start {min(starts):6.1f}..{max(starts):6.1f}"
            f" exit {min(exits):6.1f}..{max(exits):6.1f} | life med {statistics.median(life):5.1f} max {max(life):5.1f}"
            f" | prologue med {statistics.median(prologue):4.1f} | wait med {statistics.median(wait):5.1f}"
            f" max {max(wait):5.1f} | tail(last 10 %) {tail:5.1f}")
    if "gate/up" in span and "down" in span:
        g, d = span["gate/up"], span["down"]
        lines.append(
            f"  gap: last gate/up exit {g[1]:.1f} -> first down past its wait {d[2]:.1f} ({d[2] - g[1]:+.1f});"
            f" first down start {d[0]:.1f}; GEMM span {d[1] - g[0]:.1f} us; outside {call_us - (d[1] - g[0]):.1f} us")
    return "\n".join(lines)


def plot(calls, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(calls)
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 2.6 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        evs = calls[key]
        t0 = min(e["t"][0] for e in evs)
        for gate_up, color in ((1, "tab:blue"), (0, "tab:orange")):
            pts = sorted([(e["t"][0], 1) for e in evs if e["gate_up"] == gate_up and e["t"][2]] +
                         [(e["t"][4], -1) for e in evs if e["gate_up"] == gate_up and e["t"][2]])
            x, y, n = [], [], 0
            for t, dn in pts:
                x.append((t - t0) / 1e3)
                y.append(n)
                n += dn
                x.append((t - t0) / 1e3)
                y.append(n)
            ax.plot(x, y, color=color, label="gate/up" if gate_up else "down")
        ax.set_title(f"{key[0]} T={key[1]} {MODES.get(key[2], key[2])} (call {evs[0]['call_us']:.1f} us)")
        ax.set_ylabel("working blocks")
        ax.legend(loc="upper right")
    axes[-1, 0].set_xlabel("us from the first gate/up block")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("timeline")
    ap.add_argument("--plot")
    a = ap.parse_args()
    calls = load(a.timeline)
    for key in sorted(calls):
        print(summarize(key, calls[key]))
    if a.plot:
        plot(calls, a.plot)


if __name__ == "__main__":
    main()
