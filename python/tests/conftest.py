"""Shared fixtures: a fresh seed per test (printed, and reproducible with
CSFMOE_SEED=<n>), and helpers that build scale grids."""

import os
import random

import pytest
import torch


@pytest.fixture
def seed(request):
    s = int(os.environ.get("CSFMOE_SEED", random.SystemRandom().randrange(2**31)))
    # Shown with the failure report, so a failing draw can be replayed.
    request.node.user_properties.append(("seed", s))
    print(f"CSFMOE_SEED={s}")
    return s


@pytest.fixture
def gen(seed):
    return torch.Generator().manual_seed(seed)


def realistic_scales(gen, shape, exception_rate=0.01, band=16):
    """Bytes in a per-row band of width `band` around a random centre, with
    a fraction of arbitrary bytes (0x00, 0xFF, NaN patterns included)."""
    *lead, rows, cols = shape
    n_rows = 1
    for d in lead:
        n_rows *= d
    n_rows *= rows
    centre = torch.randint(20, 230, (n_rows, 1), generator=gen)
    x = centre + torch.randint(-(band // 2), band - band // 2, (n_rows, cols), generator=gen)
    x = x.clamp(0, 255)
    mask = torch.rand((n_rows, cols), generator=gen) < exception_rate
    wild = torch.randint(0, 256, (n_rows, cols), generator=gen)
    x = torch.where(mask, wild, x).to(torch.uint8)
    return x.reshape(shape)


def adversarial_scales(gen, shape):
    pool = torch.tensor([0x00, 0xFF, 0x7F, 0x80, 0xFE, 0x01, 0x7E], dtype=torch.uint8)
    x = torch.randint(0, 256, shape, generator=gen, dtype=torch.int64).to(torch.uint8)
    pick = torch.randint(0, len(pool), shape, generator=gen)
    use = torch.rand(shape, generator=gen) < 0.3
    return torch.where(use, pool[pick], x)


def cuda_available():
    return torch.cuda.is_available()
