"""compare_peer.py's "Against the targets" section on hand-made JSON lines."""

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


def section(tmp_path, capsys, ours, theirs):
    write_lines(tmp_path / "csf.jsonl", ours)
    write_lines(tmp_path / "peer.jsonl", theirs)
    assert compare_peer.main([str(tmp_path / "csf.jsonl"), str(tmp_path / "peer.jsonl")]) == 0
    out = capsys.readouterr().out
    return out[out.index("### Against the targets"):]


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
