"""Which tests run: the tiers (``NANOTRON_TEST_TIER``, read by ``conftest.py``: quick, default, full), the
training steps of a layout-parity run in each, and the GPU a test needs."""

from __future__ import annotations

import os

import pytest
import torch

TIER_VARIABLE = "NANOTRON_TEST_TIER"
TIERS = ("quick", "default", "full")
FULL_TIER_REASON = f"full tier only; run it with {TIER_VARIABLE}=full bash scripts/run_tests.sh"


def tier_name() -> str:
    """``quick``, ``default`` or ``full``, from the environment (unset or empty means ``default``)."""
    tier = os.environ.get(TIER_VARIABLE, "").strip().lower() or "default"
    if tier not in TIERS:
        raise pytest.UsageError(f"{TIER_VARIABLE}={os.environ[TIER_VARIABLE]!r}: expected one of {', '.join(TIERS)}")
    return tier


def full_tier() -> bool:
    return tier_name() == "full"


def quick_tier() -> bool:
    return tier_name() == "quick"


def parity_steps(short: int = 6, full: int = 20) -> int:
    """Training steps of a layout-parity run: ``full`` under NANOTRON_TEST_TIER=full, ``short`` otherwise."""
    return full if full_tier() else short


def require_gpu(capability: tuple[int, int], exact: bool = False) -> None:
    """Skip unless a GPU of this compute capability (or a later one, unless ``exact``) is here. Called in a test's
    body, never at import: the gloo ranks come from a forkserver that has queried CUDA (``nn/kernels.py`` does on
    import), and a rank importing a test module that asked for the capability on import failed there ("Cannot
    re-initialize CUDA in forked subprocess")."""
    here = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if here is None or here < capability or (exact and here != capability):
        pytest.skip(f"needs a GPU of compute capability {'' if exact else 'at least '}{capability[0]}.{capability[1]}")
