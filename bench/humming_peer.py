#!/usr/bin/env python3
"""humming-kernels peer of bench_gpu_moe: the same MoE layers, the same routing draws.

humming-kernels (PyPI humming-kernels, import humming) is the W4A16 quantized GEMM
that vLLM's humming MoE backend runs. humming itself is a GEMM library: the MoE
layer around it (routing alignment, SiLU(gate) * up, the weighted combine) is
vLLM's code (vllm/model_executor/layers/fused_moe/experts/fused_humming_moe.py).
This script builds the layer the way vLLM does and times one layer call:

  weights   checkpoint-form NVFP4 (E2M1 codes, FP8-E4M3 scale per 16 along K, FP32
            global per expert) or MXFP4 (E2M1, E8M0 scale per 32 along K), w13 =
            [E, 2N, H] (gate rows, then up) and w2 = [E, H, N]; converted with
            humming's checkpoint schema (modelopt NVFP4 / mxfp4 .convert_humming),
            then HummingMethod.prepare_layer_meta + transform_humming_layer (the
            repack), as vLLM's prepare_humming_moe_layer does. 16 distinct experts
            are replicated into the E slots (separate memory for every slot).
  call      indexed GEMM (vLLM's default, VLLM_HUMMING_MOE_GEMM_TYPE unset):
              align(topk_ids, block_m)              [vLLM: moe_align_block_size]
              GEMM1 w13, top_k = k  -> [T*k, 2N]    HummingMethod.forward_layer
              SiLU(gate) * up       -> [T*k, N]     HummingMethod.may_process_input
                                                    (humming's fused activation)
              GEMM2 w2, top_k = 1   -> [T*k, H]     HummingMethod.forward_layer
              out[t] = sum_j w[t, j] * down[t*k+j]  [vLLM: moe_fused_mul_sum]
            grouped (--gemm grouped, VLLM_HUMMING_MOE_GEMM_TYPE=grouped): the
            tokens permuted by expert (humming's process_input scatter layout,
            expert_first_token_offset), grouped-contiguous GEMMs, the combine
            gathering through the inverse permutation [vLLM: moe_permute/unpermute].
            The bracketed vLLM helpers are vLLM CUDA ops that cannot be installed
            on the device (no vLLM wheel there): one grid-parallel Triton kernel
            each stands in for them (--helpers torch: plain torch ops instead).
            Tile configs: HummingMethod.get_default_tuning_configs (humming's
            heuristics, the table vLLM passes); both GEMMs launch at
            valid_shape_m = T * k. --tables used (default) passes the entries the
            run launches plus the one holding shape_m = 1, which humming's
            launcher looks up on every launch; --tables full the whole table.
  timing    a CUDA graph of one layer call (plain launches timed with events when
            capture fails; the output says which); before each replay (untimed)
            the routing ids and weights of the next of the 8 draws are copied in,
            so consecutive calls read different experts from HBM; median of
            --iters replays after 3 warm-ups. "us" is the whole call; "us_humming"
            a second graph of the humming kernels alone (GEMM1 + activation + GEMM2,
            the scatter too when grouped), alignment precomputed per draw.
  check     at --check-tokens: every buffer poisoned with NaN, one call (eager,
            then the graph), output against a float64 reference from the
            dequantized checkpoint weights (bf16 rounding of the GEMM outputs and
            of the activation, as the kernels store them); fails at rel_err >= 2e-2.

Draws: DIR/<shape>-T<T>.bin from bench_gpu_moe --dump-draws: int64 ids [8][T][k]
then float32 weights [8][T][k], little-endian. A missing file skips that point
and the run exits non-zero.

  python3 bench/humming_peer.py --shapes ds3,kimi,qwen3 --format nvfp4 \
      --tokens 1,8,64 --draws DIR --json peer.jsonl
"""

from __future__ import annotations

import argparse
import array
import gc
import json
import math
import os
import sys
import time
import traceback

# key -> (name in bench_gpu_moe's JSON, experts, hidden, intermediate, top-k)
SHAPES = {
    "ds3": ("DeepSeek-V3", 256, 7168, 2048, 8),
    "kimi": ("Kimi-K2", 384, 7168, 2048, 8),
    "qwen3": ("Qwen3-30B-A3B", 128, 2048, 768, 8),
}
FORMATS = ("nvfp4", "mxfp4")
N_DRAWS = 8
# SiLU(gate) * up as humming's process_input activation (a = gate half, b = up half).
SILU_MUL = "a / (1.0f + expf(-a)) * b"
FAIL_REL_ERR = 2e-2
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def parse_ints(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        value = int(item)
        if value <= 0:
            raise ValueError(f"{item}: token counts must be positive")
        out.append(value)
    return out


def draw_path(directory: str, key: str, tokens: int) -> str:
    return os.path.join(directory, f"{key}-T{tokens}.bin")


def read_draws(path: str, tokens: int, topk: int, experts: int):
    """Reads one draw file: returns (ids, weights), flat arrays of N_DRAWS * T * k.

    Raises ValueError naming the file and the reason when the size, an id or a
    weight is off.
    """
    count = N_DRAWS * tokens * topk
    want = count * (8 + 4)
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) != want:
        raise ValueError(
            f"{path}: {len(blob)} bytes, {N_DRAWS} draws x T={tokens} x k={topk} need {want} "
            f"(int64 ids then float32 weights)"
        )
    ids = array.array("q")
    weights = array.array("f")
    if ids.itemsize != 8 or weights.itemsize != 4:
        raise RuntimeError("this Python's array('q')/array('f') are not 8/4 bytes")
    ids.frombytes(blob[: count * 8])
    weights.frombytes(blob[count * 8 :])
    if sys.byteorder != "little":
        ids.byteswap()
        weights.byteswap()
    for i, e in enumerate(ids):
        if e < 0 or e >= experts:
            d, r = divmod(i, tokens * topk)
            raise ValueError(f"{path}: draw {d} token {r // topk} slot {r % topk}: expert id {e} outside [0, {experts})")
    for i, w in enumerate(weights):
        if not math.isfinite(w):
            d, r = divmod(i, tokens * topk)
            raise ValueError(f"{path}: draw {d} token {r // topk} slot {r % topk}: weight {w} is not finite")
    return ids, weights


def distinct_experts(ids, tokens: int, topk: int) -> float:
    """Mean number of distinct experts per draw."""
    per = tokens * topk
    return sum(len(set(ids[d * per : (d + 1) * per])) for d in range(N_DRAWS)) / N_DRAWS


def launcher_pick(table, shape_m: int):
    """The entry of a humming tuning table [[min, max, config], ...] the launcher runs at shape_m.

    humming's launcher (csrc/launcher/launcher.cpp, find_kernel_configs_target_index): the
    first entry with min < shape_m <= max, a max <= 0 meaning unbounded; None when none holds it
    (the launcher then fails with "shape_m is not within any range defined in configs").
    """
    for entry in table:
        lo, hi = entry[0], entry[1]
        hi = hi if hi > 0 else 1 << 30
        if lo < shape_m <= hi:
            return entry
    return None


def find_interval(table, shape_m: int):
    """launcher_pick, raising ValueError when no entry holds shape_m."""
    entry = launcher_pick(table, shape_m)
    if entry is None:
        raise ValueError(f"no humming tuning interval holds shape_m = {shape_m}")
    return entry


# Every launch first looks up the entry holding shape_m = 1 (launch_kernel_impl:
# find_registered_kernel_data(configs, 1), for the kernel's GEMM type), then the one holding
# valid_shape_m. A table must therefore always hold shape_m = 1.
LAUNCHER_PROBE_M = 1


def tuning_subset(table, shape_ms):
    """The entries of a full tuning table that launches at these shape_m touch, in table order.

    vLLM passes the whole table (json.dumps(get_default_tuning_configs(...))) and humming
    compiles every entry at the first call; this subset compiles only the entries the run
    launches, plus the one holding shape_m = 1 that the launcher probes on every launch. The
    kernel each launch runs is the same as with the whole table (check_subset says so).
    """
    wanted = {LAUNCHER_PROBE_M, *shape_ms}
    picked = {id(launcher_pick(table, m)) for m in wanted if launcher_pick(table, m) is not None}
    return [list(entry) for entry in table if id(entry) in picked]


def check_subset(table, subset, shape_ms):
    """None, or why the subset would fail or run another kernel than the whole table at some shape_m."""
    for m in (LAUNCHER_PROBE_M, *shape_ms):
        full, sub = launcher_pick(table, m), launcher_pick(subset, m)
        if sub is None:
            return f"shape_m {m} is in no interval of the table passed"
        if full is None or list(full) != list(sub):
            return f"shape_m {m}: the table passed picks ({sub[0]}, {sub[1]}], the whole table " + (
                "none" if full is None else f"({full[0]}, {full[1]}]"
            )
    return None


def tile_text(config: dict) -> str:
    bm, bn, bk = config["block_shape"]
    parts = [f"{bm}x{bn}x{bk}", f"s{config.get('num_stages', '?')}"]
    if config.get("use_stream_k"):
        parts.append("sk")
    if config.get("num_ctas_per_sm", 1) != 1:
        parts.append(f"c{config['num_ctas_per_sm']}")
    if config.get("use_warp_spec"):
        parts.append("ws")
    return " ".join(parts)


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def scratch_size(experts: int) -> int:
    """int32 scratch of the Triton alignment: cursors, bases, counts (next_pow2(E) each), a counter."""
    return 3 * next_pow2(experts) + 1


def indexed_sizes(n: int, experts: int, block: int) -> tuple[int, int]:
    """(sorted_ids length, expert_ids length) of an alignment: vLLM's bound, rounded to blocks."""
    length = n + experts * (block - 1)
    length = (length + block - 1) // block * block
    return length, length // block


def plan_tables(tables, topk, tokens, mode="used"):
    """Per T the entry each GEMM launches, and per GEMM the JSON tuning table passed to humming.

    tables: sub ("w13", "w2") -> humming's full table (get_default_tuning_configs). Both GEMMs
    launch at valid_shape_m = T * k (vLLM's estimate_local_valid_shape_m; GEMM2 has top_k = 1
    but the same valid_shape_m), indexed and grouped alike. mode "full" passes the whole table
    as vLLM does, "used" tuning_subset. Raises when a launch would fail or pick another kernel.
    """
    shape_ms = [T * topk for T in tokens]
    entries = {T: {sub: find_interval(tables[sub], T * topk) for sub in tables} for T in tokens}
    tuning_json = {}
    for sub in ("w13", "w2"):
        passed = [list(e) for e in tables[sub]] if mode == "full" else tuning_subset(tables[sub], shape_ms)
        bad = check_subset(tables[sub], passed, shape_ms)
        if bad:
            raise RuntimeError(f"{sub} tuning table: {bad}")
        tuning_json[sub] = json.dumps(passed)
    return entries, tuning_json


# ----------------------------------------------------------------------------
# Routing helpers (stand-ins for vLLM's moe_align_block_size, moe_permute,
# moe_fused_mul_sum / moe_unpermute). torch and triton are imported lazily.


def make_triton_helpers():
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _moe_align_kernel(
        ids_ptr,
        n,
        scratch_ptr,
        sorted_ptr,
        sorted_len,
        expert_ids_ptr,
        num_blocks,
        total_ptr,
        inv_ptr,
        offsets_ptr,
        E: tl.constexpr,
        B: tl.constexpr,
        BLOCK_E: tl.constexpr,
        CHUNK: tl.constexpr,
        BCHUNK: tl.constexpr,
        BPAD: tl.constexpr,
        INDEXED: tl.constexpr,
    ):
        # Grid-parallel: program p places the slots [p * CHUNK, (p + 1) * CHUNK) and fills
        # its share of the blocks. scratch (int32, scratch_size(E)): cursors [BLOCK_E] (zero
        # between calls), then bases [BLOCK_E], counts [BLOCK_E], a done counter [1].
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs_e = tl.arange(0, BLOCK_E)
        cursor_ptr = scratch_ptr
        base_ptr = scratch_ptr + BLOCK_E
        cnt_ptr = scratch_ptr + 2 * BLOCK_E
        done_ptr = scratch_ptr + 3 * BLOCK_E
        # Every program counts all n ids itself (n * 8 bytes from L2): no grid-wide sync.
        cnt = tl.zeros([BLOCK_E], dtype=tl.int32)
        for s in range(0, n, CHUNK):
            o = s + tl.arange(0, CHUNK)
            m = o < n
            e = tl.load(ids_ptr + o, mask=m, other=0).to(tl.int32)
            h = tl.histogram(e, BLOCK_E)
            cnt += h - tl.where(offs_e == 0, CHUNK - tl.sum(m.to(tl.int32), axis=0), 0)
        padded = (cnt + (B - 1)) // B * B
        cum = tl.cumsum(padded, axis=0)
        base = cum - padded
        # Identical values from every program; read back below for the per-slot gathers.
        tl.store(base_ptr + offs_e, base)
        tl.store(cnt_ptr + offs_e, cnt)
        if pid == 0:
            if INDEXED:
                tl.store(total_ptr, tl.sum(padded, axis=0))
            else:
                tl.store(offsets_ptr + offs_e + 1, cum.to(tl.int64), mask=offs_e < E)
                tl.store(offsets_ptr + offs_e, tl.zeros([BLOCK_E], dtype=tl.int64), mask=offs_e == 0)
        tl.debug_barrier()
        # This program's slots: rank within the expert from the shared cursors.
        o = pid * CHUNK + tl.arange(0, CHUNK)
        m = o < n
        e = tl.load(ids_ptr + o, mask=m, other=0).to(tl.int32)
        rank = tl.atomic_add(cursor_ptr + e, tl.full([CHUNK], 1, tl.int32), mask=m)
        dest = tl.load(base_ptr + e, mask=m, other=0) + rank
        if INDEXED:
            tl.store(sorted_ptr + dest, o.to(tl.int32), mask=m)
        else:
            tl.store(inv_ptr + o, dest, mask=m)
        if INDEXED:
            # This program's blocks: the owning expert (E - 1 past the end, as vLLM) and the
            # sentinel n in every padding position (positions of real slots are left alone).
            per = (num_blocks + nprog - 1) // nprog
            b_lo = pid * per
            b_hi = tl.minimum(b_lo + per, num_blocks)
            total = tl.sum(padded, axis=0)
            for s in range(b_lo, b_hi, BCHUNK):
                b = s + tl.arange(0, BCHUNK)
                bm = b < b_hi
                before = (cum[None, :] <= (b * B)[:, None]) & (offs_e < E)[None, :]
                eid = tl.minimum(tl.sum(before.to(tl.int32), axis=1), E - 1)
                tl.store(expert_ids_ptr + b, eid, mask=bm)
                eb = tl.load(base_ptr + eid, mask=bm, other=0)
                ec = tl.load(cnt_ptr + eid, mask=bm, other=0)
                j = tl.arange(0, BPAD)
                pos = (b * B)[:, None] + j[None, :]
                pad = (pos >= total) | (pos - eb[:, None] >= ec[:, None])
                pm = bm[:, None] & (j < B)[None, :] & pad & (pos < sorted_len)
                tl.store(sorted_ptr + pos, tl.zeros([BCHUNK, BPAD], dtype=tl.int32) + n, mask=pm)
        # The last program to finish zeroes the cursors for the next call.
        tl.debug_barrier()
        ticket = tl.atomic_add(done_ptr, 1)
        if ticket == nprog - 1:
            tl.store(cursor_ptr + offs_e, tl.zeros([BLOCK_E], dtype=tl.int32))
            tl.atomic_xchg(done_ptr, 0)

    @triton.jit
    def _moe_combine_kernel(
        down_ptr,
        rows_ptr,
        w_ptr,
        out_ptr,
        H,
        K: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HAS_ROWS: tl.constexpr,
    ):
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = offs < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            if HAS_ROWS:
                r = tl.load(rows_ptr + t * K + j).to(tl.int64)
            else:
                r = (t * K + j).to(tl.int64)
            w = tl.load(w_ptr + t * K + j)
            v = tl.load(down_ptr + r * H + offs, mask=m, other=0.0)
            acc += w * v.to(tl.float32)
        tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=m)

    chunk = int(os.environ.get("HUMMING_PEER_ALIGN_CHUNK", "1024"))

    def align(ids_flat, experts, block, scratch, sorted_ids=None, expert_ids=None, total=None, inv=None, offsets=None):
        n = ids_flat.numel()
        block_e = next_pow2(experts)
        assert scratch.numel() >= scratch_size(experts) and scratch.dtype == torch.int32
        indexed = sorted_ids is not None
        if indexed:
            args = (sorted_ids, sorted_ids.numel(), expert_ids, expert_ids.numel(), total, scratch, scratch)
        else:
            args = (scratch, 0, scratch, 0, scratch, inv, offsets)
        _moe_align_kernel[(triton.cdiv(n, chunk),)](
            ids_flat, n, scratch, *args,
            E=experts, B=block, BLOCK_E=block_e, CHUNK=chunk, BCHUNK=16, BPAD=next_pow2(block),
            INDEXED=indexed, num_warps=8,
        )

    def combine(down, weights, out, tokens, topk, rows=None):
        hidden = out.size(-1)
        # Bandwidth-bound (k rows read per output row); at small T smaller slices for more CTAs.
        block_h = 1024 if tokens * triton.cdiv(hidden, 1024) >= 256 else 256
        grid = (tokens, triton.cdiv(hidden, block_h))
        _moe_combine_kernel[grid](
            down, rows if rows is not None else weights, weights, out, hidden,
            K=topk, BLOCK_H=block_h, HAS_ROWS=rows is not None, num_warps=4,
        )

    return align, combine


def make_torch_helpers():
    import torch

    def align(ids_flat, experts, block, scratch, sorted_ids=None, expert_ids=None, total=None, inv=None, offsets=None):
        # Plain torch ops, no host synchronization (capturable); ~15 small kernels.
        n = ids_flat.numel()
        dev = ids_flat.device
        counts = torch.zeros(experts, dtype=torch.int64, device=dev)
        counts.scatter_add_(0, ids_flat, torch.ones_like(ids_flat))
        padded = (counts + (block - 1)) // block * block
        cum = torch.cumsum(padded, 0)
        order = torch.argsort(ids_flat, stable=True)
        sorted_e = ids_flat[order]
        first = torch.cumsum(counts, 0) - counts
        dest = (cum - padded)[sorted_e] + torch.arange(n, device=dev) - first[sorted_e]
        if sorted_ids is not None:
            sorted_ids.fill_(n)
            sorted_ids[dest] = order.to(torch.int32)
            total.copy_(cum[-1:])
            starts = torch.arange(expert_ids.numel(), device=dev, dtype=torch.int64) * block
            expert_ids.copy_(torch.searchsorted(cum, starts, right=True).clamp_(max=experts - 1))
        else:
            inv[order] = dest.to(torch.int32)
            offsets[:1].zero_()
            offsets[1:].copy_(cum)

    def combine(down, weights, out, tokens, topk, rows=None):
        hidden = out.size(-1)
        v = down if rows is None else down.index_select(0, rows.long())
        v = v[: tokens * topk].view(tokens, topk, hidden).float()
        out.copy_((v * weights.view(tokens, topk, 1)).sum(1))

    return align, combine


def probe_helpers(torch, helpers, device):
    """Runs align (both forms) and combine on a small routing; returns None or what went wrong."""
    align, combine = helpers
    try:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(1)
        experts, tokens, topk, block = 96, 37, 8, 16
        ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).view(-1).to(device)
        scratch = torch.zeros(scratch_size(experts), dtype=torch.int32, device=device)
        length, nblocks = indexed_sizes(ids.numel(), experts, block)
        bufs = {
            "sorted_ids": torch.empty(length, dtype=torch.int32, device=device),
            "expert_ids": torch.empty(nblocks, dtype=torch.int32, device=device),
            "total": torch.empty(1, dtype=torch.int32, device=device),
        }
        align(ids, experts, block, scratch, **bufs)
        err = check_alignment(ids, experts, block, **bufs)
        if err:
            return f"alignment: {err}"
        inv = torch.empty(ids.numel(), dtype=torch.int32, device=device)
        offsets = torch.empty(experts + 1, dtype=torch.int64, device=device)
        align(ids, experts, 1, scratch, inv=inv, offsets=offsets)
        err = check_alignment(ids, experts, 1, inv=inv, offsets=offsets)
        if err:
            return f"permutation: {err}"
        hidden = 1100
        down = torch.randn((ids.numel(), hidden), generator=gen).to(torch.bfloat16).to(device)
        w = torch.rand((tokens, topk), generator=gen).to(device)
        ref = (down.double().view(tokens, topk, hidden) * w.double().unsqueeze(-1)).sum(1)
        out = torch.empty((tokens, hidden), dtype=torch.bfloat16, device=device)
        combine(down, w, out, tokens, topk)
        permuted = torch.empty_like(down)
        permuted[inv.long()] = down
        out2 = torch.empty_like(out)
        combine(permuted, w, out2, tokens, topk, rows=inv)
        for o in (out, out2):
            e = float((o.double() - ref).norm() / ref.norm())
            if not e < 1e-2:
                return f"combine: rel_err {e:.2e}"
        return None
    except Exception as e:
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def probe_activation(torch, moe):
    """humming's fused SiLU(gate) * up against torch on [16, 2N]; returns None or what went wrong."""
    from humming.layer import HummingMethod

    N = moe.intermediate
    try:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(2)
        g = torch.randn((16, 2 * N), generator=gen).to(torch.bfloat16).to(moe.device)
        out = torch.empty((16, N), dtype=torch.bfloat16, device=moe.device)
        HummingMethod.may_process_input(
            moe.module, g, outputs=out, activation_type="binary_split", activation_impl=SILU_MUL, sublayer_name="w2"
        )
        gate, up = g[:, :N].double(), g[:, N:].double()
        ref = gate * torch.sigmoid(gate) * up
        e = float((out.double() - ref).norm() / ref.norm())
        return None if e < 1e-2 else f"rel_err {e:.2e} against silu(gate) * up"
    except Exception as e:
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def probe_scatter(torch, moe):
    """humming's process_input scatter layout on a small permutation; returns None or what went wrong."""
    from humming.layer import HummingMethod

    H, k = moe.hidden, moe.topk
    try:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(3)
        x = torch.randn((5, H), generator=gen).to(torch.bfloat16).to(moe.device)
        idx = torch.randperm(5 * k, generator=gen).to(torch.int32).view(5, k).to(moe.device)
        out = torch.full((5 * k, H), float("nan"), dtype=torch.bfloat16, device=moe.device)
        HummingMethod.may_process_input(moe.module, x, outputs=out, layout="scatter", scatter_idx=idx, sublayer_name="w13")
        want = torch.empty_like(out)
        want[idx.view(-1).long()] = x.repeat_interleave(k, 0)
        return None if torch.equal(out, want) else "scattered rows differ from x[t] at scatter_idx[t, j]"
    except Exception as e:
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def check_alignment(ids_flat, experts, block, sorted_ids=None, expert_ids=None, total=None, inv=None, offsets=None):
    """Host-side check of one alignment; returns an error string or None."""
    import torch

    ids = ids_flat.detach().cpu().long()
    n = ids.numel()
    counts = torch.bincount(ids, minlength=experts)
    if sorted_ids is not None:
        padded = (counts + block - 1) // block * block
        want_total = int(padded.sum())
        got_total = int(total.cpu()[0])
        if got_total != want_total:
            return f"num_tokens_padded {got_total}, want {want_total}"
        s = sorted_ids.detach().cpu().long()
        if bool((s[want_total:] != n).any()):
            return "sorted_ids past num_tokens_padded are not the sentinel"
        head = s[:want_total]
        valid = head[head < n]
        if valid.numel() != n or not torch.equal(torch.sort(valid).values, torch.arange(n)):
            return "sorted_ids do not hold every token slot exactly once"
        if bool(((head > n) | (head < 0)).any()):
            return "sorted_ids hold values outside [0, n]"
        blocks = head.view(-1, block)
        eids = expert_ids.detach().cpu().long()[: blocks.size(0)]
        mask = blocks < n
        owner = torch.where(mask, ids[blocks.clamp(max=n - 1)], eids[:, None])
        if not torch.equal(owner, eids[:, None].expand_as(owner)):
            return "a block of sorted_ids holds slots of another expert than expert_ids says"
        # per expert: the blocks named for it hold exactly its slots
        per = torch.zeros(experts, dtype=torch.long).index_add_(0, eids, mask.sum(1))
        if not torch.equal(per, counts):
            return "per-expert slot counts of the blocks differ from the routing"
        return None
    off = offsets.detach().cpu().long()
    want = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
    if not torch.equal(off, want):
        return "expert_first_token_offset differs from the routing's prefix counts"
    p = inv.detach().cpu().long()
    if not torch.equal(torch.sort(p).values, torch.arange(n)):
        return "the permutation is not one"
    if bool(((p < off[ids]) | (p >= off[ids + 1])).any()):
        return "a slot lands outside its expert's rows"
    return None


# ----------------------------------------------------------------------------
# Weights and the float64 reference


def dequantize(torch, packed, scales, global_scale, fmt):
    """[R, C/2] E2M1 bytes (low nibble first) + [R, C/G] scale bytes -> float64 [R, C]."""
    rows, half = packed.shape
    cols = half * 2
    group = 16 if fmt == "nvfp4" else 32
    lut = torch.tensor(E2M1, dtype=torch.float64, device=packed.device)
    codes = torch.stack(((packed & 0xF).long(), (packed >> 4).long()), dim=-1).view(rows, cols)
    values = lut[codes].view(rows, cols // group, group)
    del codes
    if fmt == "nvfp4":
        s = scales.view(torch.float8_e4m3fn).to(torch.float64)
    else:
        s = torch.exp2(scales.to(torch.float64) - 127.0)
    values = (values * s.unsqueeze(-1)).view(rows, cols)
    if global_scale is not None:
        values = values * float(global_scale)
    return values


def reference(torch, base, fmt, x, ids, weights, intermediate, distinct):
    """float64 out[t] = sum_j w[t,j] * W2[e] (silu(W1g[e] x) * W1u[e] x), e = ids[t,j] % distinct.

    The GEMM outputs and the activation are rounded to bf16 as humming stores them.
    """
    tokens, hidden = x.shape
    x64 = x.to(torch.float64)
    out = torch.zeros(tokens, hidden, dtype=torch.float64, device=x.device)
    b_ids = (ids % distinct).long()
    bf16 = torch.bfloat16
    for b in sorted(set(b_ids.view(-1).tolist())):
        t_idx, j_idx = (b_ids == b).nonzero(as_tuple=True)
        p13, s13, g13 = base["w13"]
        w1 = dequantize(torch, p13[b], s13[b], None if g13 is None else g13[b], fmt)
        h = (x64[t_idx] @ w1.T).to(bf16).to(torch.float64)
        del w1
        gate, up = h[:, :intermediate], h[:, intermediate:]
        act = (gate * torch.sigmoid(gate) * up).to(bf16).to(torch.float64)
        p2, s2, g2 = base["w2"]
        w2 = dequantize(torch, p2[b], s2[b], None if g2 is None else g2[b], fmt)
        y = (act @ w2.T).to(bf16).to(torch.float64)
        del w2
        out.index_add_(0, t_idx, y * weights[t_idx, j_idx].to(torch.float64).unsqueeze(1))
    return out


class HummingMoE:
    """One MoE layer on humming: checkpoint tensors -> humming schema -> repacked weights."""

    def __init__(self, key, fmt, device, seed, distinct):
        import torch
        from humming.layer import HummingMethod
        from humming.schema import BaseWeightSchema, HummingInputSchema

        self.key = key
        self.name, self.experts, self.hidden, self.intermediate, self.topk = SHAPES[key]
        self.fmt = fmt
        self.device = device
        self.distinct = distinct
        E, H, N, D = self.experts, self.hidden, self.intermediate, distinct
        group = 16 if fmt == "nvfp4" else 32
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)

        def randint(lo, hi, shape):
            return torch.randint(lo, hi, shape, dtype=torch.int16, device=device, generator=gen)

        # Checkpoint form of the D distinct experts (kept for the reference).
        self.base = {}
        for sub, rows, cols, spread in (("w13", 2 * N, H, 3), ("w2", H, N, 5)):
            packed = randint(0, 256, (D, rows, cols // 2)).to(torch.uint8)  # all 16 codes, both nibbles
            if fmt == "nvfp4":
                # E4M3 exponent field 4..10 (2^-3 .. 2^3), any mantissa: moderate, realistic scales.
                scales = (randint(4, 11, (D, rows, cols // group)) * 8 + randint(0, 8, (D, rows, cols // group)))
                scales = scales.to(torch.uint8)
                glob = torch.tensor(
                    [2.0**-9 * (1 + b % spread) for b in range(D)], dtype=torch.float32, device=device
                )
            else:
                scales = randint(123, 132, (D, rows, cols // group)).to(torch.uint8)  # E8M0 127 +- 4
                glob = None
            self.base[sub] = (packed, scales, glob)

        if fmt == "nvfp4":
            schema = BaseWeightSchema.from_config({"quant_method": "modelopt", "quant_algo": "NVFP4"})
        else:
            schema = BaseWeightSchema.from_config({"quant_method": "mxfp4"})
        self.module = torch.nn.Module()
        slot = torch.arange(E, device=device) % D
        self.schemas = {}
        for sub, n_out, k_in, stacks in (("w13", 2 * N, H, [N, N]), ("w2", H, N, [H])):
            packed, scales, glob = self.base[sub]
            tensors = {"weight": packed[slot]}  # [E, n, k/2]: a copy per slot
            tensors["weight_scale"] = scales[slot].view(torch.float8_e4m3fn) if fmt == "nvfp4" else scales[slot]
            if glob is not None:
                tensors["weight_scale_2"] = glob[slot].contiguous()
            hschema, htensors = schema.convert_humming(
                tensors=tensors,
                shape_n_stacks=stacks,
                shape_k_stacks=[k_in],
                param_dtype=torch.bfloat16,
                num_experts=E,
                device=device,
            )
            del tensors
            for name, tensor in htensors.items():
                setattr(self.module, f"{sub}_{name}", torch.nn.Parameter(tensor, requires_grad=False))
            del htensors
            self.schemas[sub] = hschema
            HummingMethod.prepare_layer_meta(
                layer=self.module,
                shape_n=n_out,
                shape_k=k_in,
                weight_schema=hschema,
                input_schema=HummingInputSchema(),
                num_experts=E,
                pad_n_to_multiple=256,
                pad_k_to_multiple=128,
                has_bias=False,
                torch_dtype=torch.bfloat16,
                sublayer_name=sub,
            )
            HummingMethod.transform_humming_layer(self.module, sublayer_name=sub)
        # Stream-K locks, shared by both GEMMs of the layer (one stream), as vLLM does.
        self.module.register_buffer("locks", torch.zeros(4096, dtype=torch.int32, device=device))
        self.activation = "humming"  # main() switches to "torch" when humming's activation fails its probe
        torch.cuda.synchronize(device)

    def tuning_tables(self, gemm):
        from humming.config import GemmType
        from humming.layer import HummingMethod

        gemm_type = GemmType.INDEXED if gemm == "indexed" else GemmType.GROUPED_CONTIGUOUS
        return {
            sub: HummingMethod.get_default_tuning_configs(
                layer=self.module, use_f16_accum=False, use_batch_invariant=False, gemm_type=gemm_type, sublayer_name=sub
            )
            for sub in ("w13", "w2")
        }


class LayerCall:
    """Buffers and launches of one layer call at T tokens (routing read from static buffers)."""

    def __init__(self, moe, tokens, gemm, helpers, tuning_json, entries, seed):
        import torch

        self.moe = moe
        self.tokens = tokens
        self.gemm = gemm
        self.align_fn, self.combine_fn = helpers
        self.tuning_json = tuning_json  # sub -> JSON list of the intervals compiled for this shape
        self.entries = entries  # sub -> [min, max, config] of this T
        E, H, N, k = moe.experts, moe.hidden, moe.intermediate, moe.topk
        n = tokens * k
        self.n = n
        dev = moe.device
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed * 1000003 + tokens)
        self.x = torch.randn((tokens, H), generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)
        self.ids = torch.zeros((tokens, k), dtype=torch.int64, device=dev)
        self.weights = torch.zeros((tokens, k), dtype=torch.float32, device=dev)
        self.gate_up = torch.empty((n, 2 * N), dtype=torch.bfloat16, device=dev)
        self.act = torch.empty((n, N), dtype=torch.bfloat16, device=dev)
        self.down = torch.empty((n, H), dtype=torch.bfloat16, device=dev)
        self.out = torch.empty((tokens, H), dtype=torch.bfloat16, device=dev)
        self.scratch = torch.zeros(scratch_size(E), dtype=torch.int32, device=dev)
        self.compute_config = json.dumps(
            {
                "use_batch_invariant": False,
                "use_f16_accum": False,
                "gemm_type": "indexed" if gemm == "indexed" else "grouped_contiguous",
            }
        )
        if gemm == "indexed":
            # vLLM aligns once with the w13 tile's block_m and passes the same tables to
            # both GEMMs; where humming's w2 tile has another block_m, a second alignment.
            self.blocks = {sub: entries[sub][2]["block_shape"][0] for sub in ("w13", "w2")}
            self.align_bufs = {}
            for bm in sorted(set(self.blocks.values())):
                length, nblocks = indexed_sizes(n, E, bm)
                self.align_bufs[bm] = {
                    "sorted_ids": torch.empty(length, dtype=torch.int32, device=dev),
                    "expert_ids": torch.empty(nblocks, dtype=torch.int32, device=dev),
                    "total": torch.empty(1, dtype=torch.int32, device=dev),
                }
        else:
            self.blocks = {}
            self.inv = torch.empty(n, dtype=torch.int32, device=dev)
            self.offsets = torch.empty(E + 1, dtype=torch.int64, device=dev)
            self.xperm = torch.empty((n, H), dtype=torch.bfloat16, device=dev)

    def align_text(self):
        if self.gemm != "indexed":
            return "permute (block 1)"
        bms = sorted(set(self.blocks.values()))
        if len(bms) == 1:
            return f"one alignment, block_m {bms[0]}"
        return f"two alignments (w13 block_m {self.blocks['w13']}, w2 block_m {self.blocks['w2']})"

    def align(self):
        flat = self.ids.view(-1)
        if self.gemm == "indexed":
            for bm, buf in self.align_bufs.items():
                self.align_fn(flat, self.moe.experts, bm, self.scratch, **buf)
        else:
            self.align_fn(flat, self.moe.experts, 1, self.scratch, inv=self.inv, offsets=self.offsets)

    def check_alignment(self):
        flat = self.ids.view(-1)
        if self.gemm == "indexed":
            for bm, buf in self.align_bufs.items():
                err = check_alignment(flat, self.moe.experts, bm, **buf)
                if err:
                    return f"alignment (block_m {bm}): {err}"
            return None
        err = check_alignment(flat, self.moe.experts, 1, inv=self.inv, offsets=self.offsets)
        return f"permutation: {err}" if err else None

    def align_state(self):
        if self.gemm == "indexed":
            return [t for buf in self.align_bufs.values() for t in buf.values()]
        return [self.inv, self.offsets]

    def humming(self):
        """The humming kernels of the call: (scatter,) GEMM1, activation, GEMM2."""
        from humming.layer import HummingMethod

        mod, k, n = self.moe.module, self.moe.topk, self.n
        if self.gemm == "indexed":
            a13 = self.align_bufs[self.blocks["w13"]]
            a2 = self.align_bufs[self.blocks["w2"]]
            HummingMethod.forward_layer(
                layer=mod, inputs=self.x, outputs=self.gate_up,
                sorted_ids=a13["sorted_ids"], expert_ids=a13["expert_ids"], num_tokens_padded=a13["total"],
                top_k=k, valid_shape_m=n, compute_config=self.compute_config,
                tuning_config=self.tuning_json["w13"], sublayer_name="w13",
            )
            self.activation()
            HummingMethod.forward_layer(
                layer=mod, inputs=self.act, outputs=self.down,
                sorted_ids=a2["sorted_ids"], expert_ids=a2["expert_ids"], num_tokens_padded=a2["total"],
                top_k=1, valid_shape_m=n, compute_config=self.compute_config,
                tuning_config=self.tuning_json["w2"], sublayer_name="w2",
            )
        else:
            HummingMethod.may_process_input(
                mod, self.x, outputs=self.xperm, layout="scatter",
                scatter_idx=self.inv.view(self.tokens, k), sublayer_name="w13",
            )
            HummingMethod.forward_layer(
                layer=mod, inputs=self.xperm, outputs=self.gate_up, expert_layout=self.offsets,
                valid_shape_m=n, compute_config=self.compute_config,
                tuning_config=self.tuning_json["w13"], sublayer_name="w13",
            )
            self.activation()
            HummingMethod.forward_layer(
                layer=mod, inputs=self.act, outputs=self.down, expert_layout=self.offsets,
                valid_shape_m=n, compute_config=self.compute_config,
                tuning_config=self.tuning_json["w2"], sublayer_name="w2",
            )

    def activation(self):
        """SiLU(gate) * up: humming's fused process_input kernel (torch ops if its probe failed)."""
        if self.moe.activation == "humming":
            from humming.layer import HummingMethod

            HummingMethod.may_process_input(
                self.moe.module, self.gate_up, outputs=self.act, activation_type="binary_split",
                activation_impl=SILU_MUL, sublayer_name="w2",
            )
        else:
            import torch

            N = self.moe.intermediate
            gate = self.gate_up[:, :N].float()
            self.act.copy_(torch.nn.functional.silu(gate) * self.gate_up[:, N:].float())

    def combine(self):
        rows = None if self.gemm == "indexed" else self.inv
        self.combine_fn(self.down, self.weights, self.out, self.tokens, self.moe.topk, rows=rows)

    def full(self):
        self.align()
        self.humming()
        self.combine()

    def poison(self):
        nan = float("nan")
        for t in (self.gate_up, self.act, self.down, self.out):
            t.fill_(nan)
        if self.gemm != "indexed":
            self.xperm.fill_(nan)


def median_upper(values):
    """bench_gpu_moe's median: v[size / 2] of the sorted values."""
    v = sorted(values)
    return v[len(v) // 2] if v else float("nan")


def time_calls(torch, run, select, iters):
    """Median us of run() over iters timed calls after 3 warm-ups; select(i) before each, untimed."""
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(iters + 3):
        select(i % N_DRAWS)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(stop) * 1e3)
    return median_upper(times)


def capture(torch, fn):
    """A CUDA graph of fn(), or (None, reason) when capture fails."""
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up on a side stream, as torch recommends before capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph, None
    except Exception as e:  # capture unsupported somewhere in the call: fall back to launches
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        return None, f"{type(e).__name__}: {first_line}"


def rel_error(torch, got, ref):
    g = got.to(torch.float64)
    nan = int(torch.isnan(got).sum())
    finite = bool(torch.isfinite(got).all())
    err = float(torch.linalg.vector_norm(g - ref) / torch.linalg.vector_norm(ref)) if finite else float("nan")
    return err, nan, finite


# ----------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Times humming-kernels (vLLM's W4A16 MoE GEMM) on bench_gpu_moe's MoE layers and routing draws.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="shapes: " + ", ".join(f"{k} = {v[0]} (E={v[1]}, H={v[2]}, N={v[3]}, k={v[4]})" for k, v in SHAPES.items()),
    )
    p.add_argument("--shapes", default="ds3,kimi,qwen3", help="comma list of ds3, kimi, qwen3 (default all)")
    p.add_argument("--format", default="nvfp4", help="nvfp4 or mxfp4 (a comma list runs each)")
    p.add_argument("--tokens", default="1,8", help="comma list of token counts T")
    p.add_argument("--draws", required=True, help="folder of <shape>-T<T>.bin (bench_gpu_moe --dump-draws)")
    p.add_argument("--iters", type=int, default=20, help="timed replays per point (T >= 1024: max(5, iters / 6))")
    p.add_argument("--json", help="append one JSON line per (shape, format, T) to this file")
    p.add_argument(
        "--check-tokens", default="8",
        help="T (comma list) checked against the float64 reference; when none is in --tokens, the smallest T is",
    )
    p.add_argument("--gemm", default="indexed", choices=("indexed", "grouped", "both"),
                   help="humming MoE GEMM layout: indexed (vLLM's default), grouped (grouped-contiguous), both")
    p.add_argument("--helpers", default="triton", choices=("triton", "torch"),
                   help="stand-ins for vLLM's alignment/permute and combine ops (default triton, one kernel each)")
    p.add_argument(
        "--tables", default="used", choices=("used", "full"),
        help="tuning table passed to humming: the entries the run launches plus the one holding shape_m = 1 "
        "(used, default: fewer JIT compiles) or the whole table as vLLM passes it (full); the kernel each "
        "launch runs is the same",
    )
    p.add_argument("--distinct", type=int, default=16, help="distinct experts replicated into the E slots")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dry-run", action="store_true", help="read and check the draw files, print the plan, no GPU")
    args = p.parse_args(argv)
    try:
        args.shape_keys = [s.strip() for s in args.shapes.split(",") if s.strip()]
        for s in args.shape_keys:
            if s not in SHAPES:
                raise ValueError(f"unknown shape {s} ({', '.join(SHAPES)})")
        args.formats = [f.strip() for f in args.format.split(",") if f.strip()]
        for f in args.formats:
            if f not in FORMATS:
                raise ValueError(f"unknown format {f} (nvfp4, mxfp4)")
        args.token_list = sorted(set(parse_ints(args.tokens)))
        args.check_list = parse_ints(args.check_tokens)
        if not args.token_list:
            raise ValueError("--tokens is empty")
        if args.iters < 1:
            raise ValueError("--iters must be at least 1")
        if args.distinct < 1:
            raise ValueError("--distinct must be at least 1")
    except ValueError as e:
        p.error(str(e))
    args.gemms = ["indexed", "grouped"] if args.gemm == "both" else [args.gemm]
    return args


def load_plan(args):
    """Per shape: {T: (ids, weights)} of the draw files present; problems for the missing/bad ones."""
    plan, problems = {}, []
    for key in args.shape_keys:
        _, E, _, _, k = SHAPES[key]
        plan[key] = {}
        for T in args.token_list:
            path = draw_path(args.draws, key, T)
            if not os.path.exists(path):
                msg = f"{key} T={T}: draw file {path} is missing; point skipped"
                print(f"humming_peer: {msg}", file=sys.stderr)
                problems.append(msg)
                continue
            try:
                plan[key][T] = read_draws(path, T, k, E)
            except (OSError, ValueError) as e:
                msg = f"{key} T={T}: {e}; point skipped"
                print(f"humming_peer: {msg}", file=sys.stderr)
                problems.append(msg)
    return plan, problems


def check_tokens_for(args, tokens_present):
    for T in args.check_list:
        if T in tokens_present:
            return T, None
    if not tokens_present:
        return None, None
    T = min(tokens_present)
    return T, f"none of --check-tokens {args.check_tokens} is among the T run; checking T={T} instead"


def main(argv=None):
    args = parse_args(argv)
    plan, problems = load_plan(args)
    if args.dry_run:
        for key in args.shape_keys:
            name, E, H, N, k = SHAPES[key]
            present = sorted(plan[key])
            check_T, note = check_tokens_for(args, present)
            print(f"{key} ({name}: E={E} H={H} N={N} k={k}): T with draws {present}; check at T={check_T}")
            if note:
                print(f"  note: {note}")
            for T in present:
                ids, _ = plan[key][T]
                print(f"  T={T}: {N_DRAWS} draws, {distinct_experts(ids, T, k):.1f} distinct experts per draw")
        return 1 if problems else 0

    import torch

    import humming

    device = torch.device(args.device)
    torch.cuda.set_device(device)
    version = getattr(humming, "__version__", "unknown")
    gpu = torch.cuda.get_device_name(device)
    helpers_name = args.helpers
    if args.helpers == "triton":
        try:
            helpers = make_triton_helpers()
        except Exception as e:
            print(f"humming_peer: Triton helpers unavailable ({type(e).__name__}: {e}); using torch ops", file=sys.stderr)
            helpers, helpers_name = make_torch_helpers(), "torch"
    else:
        helpers = make_torch_helpers()
    if helpers_name == "triton":
        bad = probe_helpers(torch, helpers, device)
        if bad:
            print(f"humming_peer: Triton helpers failed their probe ({bad}); using torch ops", file=sys.stderr)
            helpers, helpers_name = make_torch_helpers(), "torch"
    bad = probe_helpers(torch, helpers, device)
    if bad:
        print(f"humming_peer: routing helpers ({helpers_name}) failed their probe: {bad}", file=sys.stderr)
        return 1
    print(f"device: {gpu}; torch {torch.__version__}; humming-kernels {version}; helpers: {helpers_name}")
    json_file = open(args.json, "a") if args.json else None
    failures = list(problems)

    def emit(record):
        if json_file:
            json_file.write(json.dumps(record, default=str) + "\n")
            json_file.flush()

    for fmt in args.formats:
        for key in args.shape_keys:
            name, E, H, N, k = SHAPES[key]
            present = sorted(plan[key])
            if not present:
                continue
            check_T, note = check_tokens_for(args, present)
            if note:
                print(f"humming_peer: {key}: {note}")
            t0 = time.time()
            try:
                moe = HummingMoE(key, fmt, device, args.seed, args.distinct)
            except Exception as e:
                traceback.print_exc()
                failures.append(f"{key} {fmt}: layer preparation failed: {type(e).__name__}: {e}")
                continue
            w_bytes = sum(
                getattr(moe.module, f"{s}_{n}").numel() * getattr(moe.module, f"{s}_{n}").element_size()
                for s in ("w13", "w2")
                for n in ("weight", "weight_scale", "weight_scale_2")
                if hasattr(moe.module, f"{s}_{n}")
            )
            print(
                f"\n== {name} ({key}): E={E} H={H} N={N} top-{k}, {fmt}; humming layer {w_bytes / 1e9:.2f} GB "
                f"({w_bytes / E / 1e6:.2f} MB per expert), prepared in {time.time() - t0:.1f} s"
            )
            bad = probe_activation(torch, moe)
            if bad:
                moe.activation = "torch"
                print(f"humming_peer: humming's fused activation failed its probe ({bad}); SiLU * up in torch ops")
            for gemm in args.gemms:
                if gemm == "grouped":
                    bad = probe_scatter(torch, moe)
                    if bad:
                        failures.append(f"{key} {fmt} grouped: humming's scatter layout failed its probe: {bad}")
                        print(f"humming_peer: {failures[-1]}", flush=True)
                        continue
                try:
                    tables = moe.tuning_tables(gemm)
                    entries, tuning_json = plan_tables(tables, k, present, args.tables)
                except Exception as e:
                    traceback.print_exc()
                    failures.append(f"{key} {fmt} {gemm}: tuning tables: {type(e).__name__}: {e}")
                    continue
                print(f"-- {gemm} GEMM; tile per T: block MxNxK, stages, sk = stream-K, c = CTAs per SM, ws = warp-specialized")
                print(
                    f"{'T':>6} {'experts':>7} {'us':>9} {'us_humm':>9} {'graph':>5} {'rel_err':>9}  "
                    f"{'w13 tile':<22} {'w2 tile':<22} align"
                )
                for T in present:
                    ids_h, w_h = plan[key][T]
                    try:
                        rec = run_point(torch, args, moe, T, gemm, helpers, tuning_json, entries[T], ids_h, w_h, T == check_T)
                    except Exception as e:
                        traceback.print_exc()
                        failures.append(f"{key} {fmt} {gemm} T={T}: {type(e).__name__}: {e}")
                        continue
                    rec.update(
                        peer="humming-kernels", version=version, gpu=gpu, shape=name, shape_key=key, format=fmt,
                        helpers=helpers_name, activation=moe.activation, torch=torch.__version__,
                    )
                    if rec.get("first_call_s", 0) > 5:
                        print(f"       (first call {rec['first_call_s']:.1f} s: humming's JIT compile)", flush=True)
                    if rec.get("failure"):
                        failures.append(f"{key} {fmt} {gemm} T={T}: {rec['failure']}")
                    emit(rec)
                    err = "-" if rec["rel_err"] is None else f"{rec['rel_err']:.2e}"
                    print(
                        f"{T:>6} {rec['experts']:>7.1f} {rec['us']:>9.1f} {rec['us_humming']:>9.1f} "
                        f"{'yes' if rec['graph'] else 'no':>5} {err:>9}  {rec['w13_tile']:<22} {rec['w2_tile']:<22} "
                        f"{rec['align']}",
                        flush=True,
                    )
                    if rec.get("failure"):
                        print(f"       FAILED: {rec['failure']}", flush=True)
            del moe
            gc.collect()
            torch.cuda.empty_cache()
    if json_file:
        json_file.close()
    if failures:
        print(f"\nhumming_peer: {len(failures)} problem(s):", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        return 1
    return 0


def run_point(torch, args, moe, T, gemm, helpers, tuning_json, entries, ids_h, w_h, check):
    k = moe.topk
    dev = moe.device
    call = LayerCall(moe, T, gemm, helpers, tuning_json, entries, args.seed)
    ids_all = torch.frombuffer(ids_h, dtype=torch.int64).to(dev).view(N_DRAWS, T, k)
    w_all = torch.frombuffer(w_h, dtype=torch.float32).to(dev).view(N_DRAWS, T, k)
    iters = max(5, args.iters // 6) if T >= 1024 else args.iters
    rec = {
        "tokens": T, "gemm": gemm, "experts": distinct_experts(ids_h, T, k), "iters": iters,
        "w13_config": entries["w13"][2], "w2_config": entries["w2"][2],
        "w13_tile": tile_text(entries["w13"][2]), "w2_tile": tile_text(entries["w2"][2]),
        "align": call.align_text(), "rel_err": None, "graph": False, "tables": args.tables,
    }

    def select(d):
        call.ids.copy_(ids_all[d])
        call.weights.copy_(w_all[d])

    # First call: compiles humming's kernels (all intervals of this shape) and the helpers.
    t0 = time.time()
    select(0)
    call.full()
    torch.cuda.synchronize()
    rec["first_call_s"] = round(time.time() - t0, 2)
    # Every draw's alignment, checked on the host; kept for the humming-only timing.
    saved = []
    for d in range(N_DRAWS):
        select(d)
        call.align()
        torch.cuda.synchronize()
        err = call.check_alignment()
        if err:
            raise RuntimeError(f"draw {d}: {err}")
        saved.append([t.clone() for t in call.align_state()])

    last = (iters + 2) % N_DRAWS  # the draw the timed replays end on (bench_gpu_moe's choice)
    failure = None
    ref = None
    if check:
        select(last)
        ref = reference(
            torch, moe.base, moe.fmt, call.x, call.ids, call.weights, moe.intermediate, moe.distinct
        )
        call.poison()
        call.full()
        torch.cuda.synchronize()
        err, nan, finite = rel_error(torch, call.out, ref)
        rec["rel_err_eager"] = err
        if not finite or err >= FAIL_REL_ERR:
            failure = f"eager call: rel_err {err:.3e}, {nan} NaN of {call.out.numel()} outputs (limit {FAIL_REL_ERR})"

    graph, why = capture(torch, call.full)
    if graph is not None:
        rec["graph"] = True
        rec["us"] = time_calls(torch, graph.replay, select, iters)
    else:
        rec["graph_error"] = why
        print(f"       CUDA graph capture failed ({why}); timing plain launches", flush=True)
        rec["us"] = time_calls(torch, call.full, select, iters)

    def select_aligned(d):
        for dst, src in zip(call.align_state(), saved[d]):
            dst.copy_(src)
        call.weights.copy_(w_all[d])

    part_graph, _ = capture(torch, call.humming) if graph is not None else (None, None)
    if part_graph is not None:
        rec["us_humming"] = time_calls(torch, part_graph.replay, select_aligned, iters)
    else:
        rec["us_humming"] = time_calls(torch, call.humming, select_aligned, iters)

    if check:
        select(last)
        call.poison()
        if graph is not None:
            graph.replay()
        else:
            call.full()
        torch.cuda.synchronize()
        err, nan, finite = rel_error(torch, call.out, ref)
        rec["rel_err"] = err
        if not finite or err >= FAIL_REL_ERR:
            what = "graph replay" if graph is not None else "call"
            failure = (failure + "; " if failure else "") + (
                f"{what}: rel_err {err:.3e}, {nan} NaN of {call.out.numel()} outputs (limit {FAIL_REL_ERR})"
            )
        rec["check_draw"] = last
    if failure:
        rec["failure"] = failure
    del graph, part_graph
    return rec


if __name__ == "__main__":
    sys.exit(main())
