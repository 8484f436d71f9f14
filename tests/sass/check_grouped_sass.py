#!/usr/bin/env python3
"""SASS check of the grouped MoE kernels (src/cuda/moe/grouped_kernel.cuh).

Disassembles the CUDA library with cuobjdump and checks, for every
instantiation of moe_grouped_kernel, what the design depends on and what the
compiler could silently lose:
  * HGMMA (wgmma) with the A operand in registers (``HGMMA.64xNx16.F32.BF16 Rd, Ra, gdesc[..]``),
    16 per K block body (two k16 steps per k32 group, 8 groups);
  * UTMALDG (TMA loads of the weights), the register split (USETMAXREG
    TRY_ALLOC and DEALLOC) and mbarrier instructions (SYNCS.*);
  * no local memory (LDL / STL: a spilled or run-time-indexed array);
  * at least one wgmma group left in flight in the main loop
    (``WARPGROUP.DEPBAR.LE gsb0, 0x1``; only the item's last wait drains to 0x0).

usage: check_grouped_sass.py LIBRARY [--cuobjdump PATH]
Exit 0: all pass; 1: a check failed; 77: no cuobjdump (ctest reports a skip;
scripts/test installs it from PyPI's nvidia-cuda-cuobjdump wheel).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

# Instantiations per token tile: formats x dense scale kinds x projections
# (down, gate/up SiLU, gate/up gpt-oss: Projection in src/cuda/moe/launchers.hpp)
# x scale paths (per-thread loads, ring scales: GroupedScalePaths).
PER_TILE = 2 * 2 * 3 * 2
SHAPE_HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "moe", "grouped_shape.hpp")


def token_tiles(header=SHAPE_HEADER):
    """The token-tile classes the kernel is instantiated for (kGroupedTokenTiles)."""
    with open(header) as f:
        m = re.search(r"kGroupedTokenTiles\[\]\s*=\s*\{([^}]*)\}", f.read())
    if not m:
        raise SystemExit(f"check_grouped_sass: no kGroupedTokenTiles in {header}")
    return sorted(int(v) for v in m.group(1).split(","))


def find_cuobjdump(explicit):
    for cand in (explicit, os.environ.get("CSFMOE_CUOBJDUMP"), shutil.which("cuobjdump")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def functions(sass):
    """Yields (mangled name, body) of each function in cuobjdump -sass output."""
    name, body = None, []
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name:
                yield name, "\n".join(body)
            name, body = m.group(1), []
        elif name:
            body.append(line)
    if name:
        yield name, "\n".join(body)


def token_tile_of(name):
    """The token tile NT of a mangled moe_grouped_kernel<F, K, P, NT> name, or None."""
    m = re.search(r"Li(\d+)E(?:Lb[01]E)?EEv", name)
    return int(m.group(1)) if m else None


def check(name, body):
    problems = []
    hgmma = re.findall(r"HGMMA\.64x(\d+)x16\.F32\.BF16 R\d+, (\S+), gdesc", body)
    if not hgmma:
        problems.append("no HGMMA.64xNx16.F32.BF16")
    elif any(not a.startswith("R") for _, a in hgmma):
        problems.append("an HGMMA takes A from shared memory, not registers")
    elif len(hgmma) % 16 != 0:
        problems.append(f"{len(hgmma)} HGMMA, not a multiple of the 16 per K block")
    tile = token_tile_of(name)
    if tile is not None and hgmma and any(int(n) != tile for n, _ in hgmma):
        problems.append(f"HGMMA N {sorted(set(n for n, _ in hgmma))} differs from the token tile {tile}")
    for what, pattern in (("UTMALDG", r"\bUTMALDG"), ("register split (USETMAXREG.TRY_ALLOC)", r"USETMAXREG\.TRY_ALLOC"),
                          ("register release (USETMAXREG.DEALLOC)", r"USETMAXREG\.DEALLOC"),
                          ("mbarrier wait (SYNCS.PHASECHK)", r"SYNCS\.PHASECHK"),
                          ("mbarrier arrive (SYNCS.ARRIVE)", r"SYNCS\.ARRIVE")):
        if not re.search(pattern, body):
            problems.append(f"no {what}")
    local = re.findall(r"\b(LDL|STL)\b", body)
    if local:
        problems.append(f"{len(local)} local-memory accesses (LDL/STL)")
    depth = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d+)", body)
    in_flight, groups = sum(1 for d in depth if int(d, 16) >= 1), len(hgmma) // 2
    if in_flight < groups:
        problems.append(f"{in_flight} waits keep a wgmma group in flight for {groups} groups "
                        f"(waits: {sorted(set(depth))})")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("library")
    ap.add_argument("--cuobjdump")
    args = ap.parse_args()
    tool = find_cuobjdump(args.cuobjdump)
    if tool is None:
        print("check_grouped_sass: no cuobjdump (pip install nvidia-cuda-cuobjdump, or set CSFMOE_CUOBJDUMP): skipped")
        return 77
    run = subprocess.run([tool, "-sass", args.library], capture_output=True, text=True)
    if run.returncode != 0:
        print(f"check_grouped_sass: {tool} -sass {args.library} failed: {run.stderr.strip()}")
        return 1
    found = [(n, b) for n, b in functions(run.stdout) if "moe_grouped_kernel" in n]
    failed = 0
    for name, body in found:
        problems = check(name, body)
        if problems:
            failed += 1
            print(f"FAIL {name}:\n  " + "\n  ".join(problems))
    tiles = token_tiles()
    per_tile = {nt: 0 for nt in tiles}
    for name, _ in found:
        tile = token_tile_of(name)
        if tile in per_tile:
            per_tile[tile] += 1
    missing = {nt: n for nt, n in per_tile.items() if n != PER_TILE}
    if missing or len(found) != PER_TILE * len(tiles):
        hint = "" if "Function :" in run.stdout else " (no SASS at all: cuobjdump needs nvdisasm beside it)"
        print(f"FAIL: {len(found)} moe_grouped_kernel instantiations in {args.library}, expected {PER_TILE} "
              f"for each token tile {tiles}; tiles short: {missing}{hint}")
        failed += 1
    if failed:
        return 1
    print(f"check_grouped_sass: {len(found)} grouped kernels: register-A HGMMA, UTMALDG, USETMAXREG, SYNCS, "
          "no LDL/STL, a wgmma group in flight at every steady-state wait")
    return 0


if __name__ == "__main__":
    sys.exit(main())
