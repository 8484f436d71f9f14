#!/usr/bin/env python3
"""PyTorch baseline for the fused MoE layer: dequantize, then torch matmul per expert.

What a user without a fused FP4 kernel writes: for every expert a call routes
to, expand its packed E2M1 weights and NVFP4 block scales to BF16, run the
gate/up matmul, SiLU(gate) * up, the down matmul, and add the weighted rows.
Weights are random (packed E2M1 bytes, E4M3 scales of realistic size), as
many experts as the real layer, on the GPU. Times: CUDA events around one
layer call, median of --iters calls after 3 warm-ups, the routing switching
among 8 random top-k draws (distinct experts per token). Roofline as in
bench_gpu_moe: distinct experts x (FP4 + scale bytes) / device copy bandwidth
measured here.

    python3 bench/torch_baseline.py [--shapes ds3,kimi,qwen3] [--tokens 1,8,64] [--iters 10] [--json FILE]
"""
import argparse
import json
import statistics
import sys

import torch

SHAPES = {
    "ds3": ("DeepSeek-V3", 256, 7168, 2048, 8),
    "kimi": ("Kimi-K2", 384, 7168, 2048, 8),
    "qwen3": ("Qwen3-30B-A3B", 128, 2048, 768, 8),
}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def copy_bandwidth() -> float:
    n = 1 << 31
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for i in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        if i >= 2:
            times.append(s.elapsed_time(e) * 1e-3)
    return 2 * n / statistics.median(times)


def dequant(packed: torch.Tensor, scales: torch.Tensor, gscale: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[rows, K/2] uint8 + [rows, K/16] float8_e4m3fn + scalar -> [rows, K] bf16."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    w = table[codes]
    s = scales.to(torch.float32).repeat_interleave(16, dim=1) * gscale
    return (w * s).to(torch.bfloat16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="ds3,kimi,qwen3")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch_baseline: no CUDA device, nothing to time")
        return 0
    torch.manual_seed(3)
    bw = copy_bandwidth()
    table = torch.tensor(E2M1, dtype=torch.float32, device="cuda")
    out_json = open(args.json, "a") if args.json else None
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s")
    for key in args.shapes.split(","):
        name, E, H, N, k = SHAPES[key]
        w13 = torch.randint(0, 256, (E, 2 * N, H // 2), dtype=torch.uint8, device="cuda")
        w2 = torch.randint(0, 256, (E, H, N // 2), dtype=torch.uint8, device="cuda")
        # E4M3 scales around 2^0..2^3 (typical ModelOpt blocks), globals ~1e-3.
        s13 = (torch.rand(E, 2 * N, H // 16, device="cuda") * 8 + 1).to(torch.float8_e4m3fn)
        s2 = (torch.rand(E, H, N // 16, device="cuda") * 8 + 1).to(torch.float8_e4m3fn)
        g13 = torch.full((E,), 1e-3, device="cuda")
        g2 = torch.full((E,), 1e-3, device="cuda")
        expert_bytes = 2 * N * H // 2 + H * N // 2 + 2 * N * H // 16 + H * N // 16
        print(f"\n== {name}: E={E} H={H} N={N} top-{k}, NVFP4; expert {expert_bytes / 1e6:.2f} MB")
        print(f"{'T':>6} {'experts':>8} {'roof_us':>9} {'torch_us':>10} {'%roof':>6}")
        for T in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
            draws = []
            for _ in range(8):
                ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
                wts = torch.rand(T, k, device="cuda")
                draws.append((ids, wts))

            def layer(ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
                out = torch.zeros(T, H, device="cuda", dtype=torch.float32)
                for e in torch.unique(ids).tolist():
                    tok, slot = (ids == e).nonzero(as_tuple=True)
                    xe = x[tok]
                    a = xe @ dequant(w13[e], s13[e], g13[e], table).t()
                    h = torch.nn.functional.silu(a[:, :N]) * a[:, N:]
                    y = h @ dequant(w2[e], s2[e], g2[e], table).t()
                    out.index_add_(0, tok, y.float() * wts[tok, slot, None])
                return out.to(torch.bfloat16)

            times = []
            for i in range(args.iters + 3):
                ids, wts = draws[i % 8]
                s, ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                layer(ids, wts)
                ev.record()
                ev.synchronize()
                if i >= 3:
                    times.append(s.elapsed_time(ev) * 1e3)
            distinct = statistics.mean(len(torch.unique(d[0])) for d in draws)
            roof = distinct * expert_bytes / bw * 1e6
            us = statistics.median(times)
            print(f"{T:>6} {distinct:>8.1f} {roof:>9.1f} {us:>10.1f} {100 * roof / us:>6.1f}")
            if out_json:
                out_json.write(json.dumps({"bench": "torch_baseline", "shape": name, "format": "nvfp4", "T": T,
                                           "experts": distinct, "roof_native_us": roof, "torch_us": us,
                                           "copy_GBps": bw / 1e9, "torch": torch.__version__}) + "\n")
        del w13, w2, s13, s2
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
