"""compare_peer.py's closing sections ("Against the targets", "The grouped
kernel below the plan's threshold") on hand-made JSON lines."""

import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import compare_peer  # noqa: E402


def write_lines(path, lines):
    with open(path, "w") as f:
        for obj in lines:
            f.write(json.dumps(obj) + "\n")


def layer(shape, fmt, T, us, roof, kernel):
    return {"bench": "moe_layer", "shape": shape, "format": fmt, "T": T, "kernel": kernel,
            "native_us": us, "roof_native_us": roof}


def peer(shape, fmt, T, us, gemm="indexed"):
    return {"peer": "humming-kernels", "shape": shape, "format": fmt, "tokens": T, "us": us, "gemm": gemm}


def section(tmp_path, capsys, ours, theirs, heading="### Against the targets"):
    write_lines(tmp_path / "csf.jsonl", ours)
    write_lines(tmp_path / "peer.jsonl", theirs)
    assert compare_peer.main([str(tmp_path / "csf.jsonl"), str(tmp_path / "peer.jsonl")]) == 0
    out = capsys.readouterr().out
    return out[out.index(heading):]


def test_grid_counts_and_targets(tmp_path, capsys):
    rng = random.Random()
    fast = rng.uniform(0.5, 0.8)   # meets the goal
    slow = rng.uniform(1.01, 1.5)  # slower than humming
    h256, h8192 = rng.uniform(1e3, 3e3), rng.uniform(1e4, 2e4)
    roof = rng.uniform(0.5, 0.9) * fast * h256
    ours = [
        layer("DeepSeek-V3", "nvfp4", 256, fast * h256, roof, "grouped"),
        layer("DeepSeek-V3", "nvfp4", 8192, slow * h8192, 1.0, "grouped"),
        layer("DeepSeek-V3", "nvfp4", 1, 90.0, 60.0, "decode"),  # no peer line: not counted
    ]
    # The fastest of humming's layouts is the peer.
    theirs = [peer("ds3", "nvfp4", 256, h256), peer("ds3", "nvfp4", 256, 2 * h256, "grouped"),
              peer("ds3", "nvfp4", 8192, h8192)]
    text = section(tmp_path, capsys, ours, theirs)
    row = next(line for line in text.splitlines() if line.startswith("| DeepSeek-V3, nvfp4"))
    assert row == f"| DeepSeek-V3, nvfp4 | **{fast:.2f}** | **{slow:.2f}** |"
    assert "csfmoe <= humming: 1 of 2 points (slower: DeepSeek-V3 nvfp4 T=8192" in text
    assert "goal <= 0.83: 1 of 2 points." in text
    assert f"T=256 nvfp4 {100.0 * roof / (fast * h256):.1f}%" in text
    flops = 2.0 * 8192 * 8 * 3 * 7168 * 2048
    assert f"DeepSeek-V3 T=8192 nvfp4: {flops / (slow * h8192 * 1e-6) / 1e12:.0f} TFLOP/s (target 470)" in text


def test_decode_points_are_not_bold_and_missing_points_dash(tmp_path, capsys):
    ours = [layer("Qwen3-30B-A3B", "mxfp4", 8, 80.0, 30.0, "decode"),
            layer("Qwen3-30B-A3B", "mxfp4", 128, 150.0, 100.0, "grouped"),
            layer("Qwen3-30B-A3B", "nvfp4", 128, 150.0, 100.0, "grouped")]
    theirs = [peer("qwen3", "mxfp4", 8, 100.0), peer("qwen3", "mxfp4", 128, 100.0),
              peer("qwen3", "nvfp4", 128, 300.0)]
    text = section(tmp_path, capsys, ours, theirs)
    assert "| Qwen3-30B-A3B, mxfp4 | 0.80 | **1.50** |" in text
    assert "| Qwen3-30B-A3B, nvfp4 | - | **0.50** |" in text
    assert "csfmoe <= humming: 2 of 3 points" in text
    assert "DeepSeek-V3 T <=" not in text  # no DeepSeek-V3 point, no roofline line


def forced(shape, fmt, T, tile, us, planned, planned_us):
    return {"bench": "moe_grouped", "shape": shape, "format": fmt, "T": T, "tile": tile, "us": us,
            "bound_kernel": planned, "bound_us": planned_us}


def test_crossover_lists_forced_grouped_runs_below_the_threshold(tmp_path, capsys):
    rng = random.Random()
    dec64, dec128 = rng.uniform(1e3, 2e3), rng.uniform(2e3, 3e3)
    g64, g128 = dec64 * rng.uniform(1.01, 1.2), dec128 * rng.uniform(0.8, 0.99)
    h128 = rng.uniform(2e3, 3e3)
    ours = [layer("DeepSeek-V3", "nvfp4", 64, dec64, 1.0, "decode"),
            layer("DeepSeek-V3", "nvfp4", 128, dec128, 1.0, "decode"),
            layer("DeepSeek-V3", "nvfp4", 256, 3e3, 1.0, "grouped"),
            # T = 128: two tiles, the faster one is reported.
            forced("DeepSeek-V3", "nvfp4", 64, 16, g64, "decode", dec64),
            forced("DeepSeek-V3", "nvfp4", 128, 16, g128, "decode", dec128),
            forced("DeepSeek-V3", "nvfp4", 128, 24, g128 * 1.5, "decode", dec128),
            # Where the plan runs the grouped kernel itself there is no crossover to show.
            forced("DeepSeek-V3", "nvfp4", 256, 24, 3e3, "grouped", 3e3)]
    theirs = [peer("ds3", "nvfp4", 128, h128)]
    text = section(tmp_path, capsys, ours, theirs, "### The grouped kernel below the plan's threshold")
    rows = [line for line in text.splitlines() if line.startswith("| DeepSeek-V3")]
    assert rows == [
        f"| DeepSeek-V3, nvfp4 | 64 | decode | {dec64:.1f} | {g64:.1f} (16) | {g64 / dec64:.2f} | - |",
        f"| DeepSeek-V3, nvfp4 | 128 | decode | {dec128:.1f} | {g128:.1f} (16) | {g128 / dec128:.2f} | "
        f"{g128 / h128:.2f} |",
    ]
    assert "- the grouped kernel faster than the planned kernel: 1 of 2 points." in text
