"""examples/transformers_generate.py on the CPU: each model class builds,
patches, generates and matches its dequantized reference at a geometry with
the large presets' attention layout (hidden >= 1024: their head sizes, and
fewer key-value heads than heads, which DeepSeek-V3's latent attention does
not take)."""

import importlib.util
import pathlib
import sys

import pytest

pytest.importorskip("transformers")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "transformers_generate.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("transformers_generate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # hidden, moe intermediate, experts, top-k, heads, key-value heads
    module.GEOMETRIES["probe"] = (1024, 64, 8, 2, 8, 2)
    return module


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_example_generates_at_a_large_attention_layout(example, family, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["transformers_generate.py", "--family", family, "--geometry", "probe",
                                      "--layers", "1", "--prompt-len", "8", "--new-tokens", "2"])
    assert example.main() == 0
    out = capsys.readouterr().out
    assert out.count("vs reference: identical") == 2, out
