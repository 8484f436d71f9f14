#!/usr/bin/env python3
"""Plots csfmoe against humming-kernels from one device run's JSON lines.

    python3 bench/plot_peer.py grouped.jsonl peer.jsonl -o docs/img/moe-vs-humming.png

One column per (shape, format): the fraction of the memory roofline (top) and
TFLOP/s (bottom) against T, for csfmoe (native scales, the kernel bind()
picks: `moe_layer` lines of bench_gpu_moe) and humming-kernels (the fastest
of its GEMM layouts in bench/humming_peer.py's lines, `us`: its whole call).
Both against the same roofline (the FP4 bytes and scales of the distinct
experts a call touches, over the copy bandwidth measured in the run).
Needs matplotlib.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_peer import first, flops as layer_flops, read_lines  # noqa: E402  (no torch at import)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl", nargs="+")
    ap.add_argument("-o", "--output", default="moe-vs-humming.png")
    args = ap.parse_args()
    csf, _, hum, _, _ = read_lines(args.jsonl)
    ours = {k: {"us": first(v, "native_us", "us"), "roof_us": first(v, "roof_native_us", "roof_us"),
                "flops": layer_flops(k[0], k[2])} for k, v in csf.items()}
    peer = {k: {"us": min(v["us"] for v in layouts.values())} for k, layouts in hum.items()}
    keys = sorted({(s, f) for (s, f, _) in ours})
    if not keys:
        print(f"plot_peer: no csfmoe moe_layer lines in {args.jsonl}", file=sys.stderr)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(keys), figsize=(4.6 * len(keys), 7.5), squeeze=False)
    for col, (shape, fmt) in enumerate(keys):
        ts = sorted(t for (s, f, t) in ours if (s, f) == (shape, fmt))
        roof = {t: ours[(shape, fmt, t)]["roof_us"] for t in ts}
        flop = {t: ours[(shape, fmt, t)]["flops"] for t in ts}
        series = [("csfmoe", {t: ours[(shape, fmt, t)]["us"] for t in ts}, "C0")]
        theirs = {t: peer[(shape, fmt, t)]["us"] for t in ts if (shape, fmt, t) in peer}
        if theirs:
            series.append(("humming-kernels", theirs, "C3"))
        for name, us, color in series:
            xs = [t for t in ts if t in us]
            axes[0][col].plot(xs, [100.0 * roof[t] / us[t] for t in xs], "o-", color=color, label=name)
            axes[1][col].plot(xs, [flop[t] / (us[t] * 1e-6) / 1e12 for t in xs], "o-", color=color, label=name)
        axes[0][col].set_title(f"{shape}, {fmt}")
        axes[0][col].set_ylabel("% of the memory roofline")
        axes[1][col].set_ylabel("TFLOP/s")
        for row in (0, 1):
            axes[row][col].set_xscale("log", base=2)
            axes[row][col].set_xlabel("tokens T")
            axes[row][col].grid(True, alpha=0.3)
            axes[row][col].legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"plot_peer: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
