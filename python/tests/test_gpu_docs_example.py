"""Runs the integration example of docs/python.md as written: a fresh
namespace, the repo root as working directory (the doc says so)."""

import pytest
import torch

import csfmoe
from docs_example import ROOT, example

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not getattr(csfmoe._csfmoe, "has_moe_cuda", False), reason="no CUDA MoE in this build"),
]


def test_gpu_docs_integration_example(monkeypatch):
    src = example("integration")
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": "__docs_example__"}
    exec(compile(src, "docs/python.md:integration", "exec"), namespace)
    # The block's own asserts did the checking; make sure it got that far.
    assert "err" in namespace and namespace["err"] < 2e-2
