#!/usr/bin/env python3
"""Plots bench_gpu_moe's JSON lines: fraction of the memory roofline against T.

    python3 bench/plot_moe.py bench.jsonl [more.jsonl ...] -o docs/img/moe-roofline.png
    python3 bench/plot_moe.py --prefill prefill.jsonl -o docs/img/moe-prefill.png

--prefill plots the fraction of the dense BF16 tensor rate (measured in the
same run) against T instead: the kernel bind() picks, the decode kernel and
the prefill kernel (rows from T = 256 on).

One panel per (shape, format). Lines: csfmoe with native scales and with
stage-read CSF scales (each against the roofline of the bytes it reads), the
tiled kernel, and the BF16 cuBLAS peer (against the same FP4 roofline, so the
curves compare times directly). Needs matplotlib.
"""
import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl", nargs="+")
    ap.add_argument("-o", "--output", default="moe-roofline.png")
    ap.add_argument("--prefill", action="store_true", help="fraction of the dense BF16 rate, T >= 256")
    args = ap.parse_args()
    rows = []
    for path in args.jsonl:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    r = json.loads(line)
                    if r.get("bench") == "moe_layer":
                        rows.append(r)
    if not rows:
        print(f"plot_moe: no moe_layer rows in {args.jsonl}", file=sys.stderr)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if args.prefill:
        rows = [r for r in rows if r["T"] >= 256 and r.get("prefill_us", 0) > 0]
        if not rows:
            print("plot_moe: no prefill rows (T >= 256 with prefill_us)", file=sys.stderr)
            return 1
    panels = sorted({(r["shape"], r["format"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (shape, fmt) in zip(axes[0], panels):
        pr = sorted((r for r in rows if r["shape"] == shape and r["format"] == fmt), key=lambda r: r["T"])
        t = [r["T"] for r in pr]
        if args.prefill:
            rate = lambda key: [100 * r["flops"] / (r[key] * 1e-6) / (r["dense_bf16_TFLOPs"] * 1e12) for r in pr]
            series = [(label, rate(key), style)
                      for label, key, style in (("csfmoe (kernel bind picks)", "native_us", "o-"),
                                                ("decode kernel", "decode_us", "s:"),
                                                ("prefill kernel", "prefill_us", "x--"))]
            target, ylabel, title, ymax = 50, "% of dense BF16 tensor rate", f"{shape} {fmt}, prefill", 60
        else:
            roof = lambda num, key: [100 * r[num] / r[key] if r[key] > 0 else float("nan") for r in pr]
            series = [
                ("csfmoe, native scales", roof("roof_native_us", "native_us"), "o-"),
                ("csfmoe, stage-read CSF", roof("roof_csf_us", "stage_read_us"), "s-"),
                ("tiled kernel", roof("roof_native_us", "tiled_us"), "x:"),
            ]
            if any(r["bf16_cublas_us"] > 0 for r in pr):
                series.append(("BF16 cuBLAS peer", roof("roof_native_us", "bf16_cublas_us"), "^--"))
            target, ylabel, title, ymax = 80, "% of FP4 memory roofline", f"{shape} {fmt}", 100
        for label, y, style in series:
            ax.plot(t, y, style, label=label)
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T (top-8)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_ylim(0, ymax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"plot_moe: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
