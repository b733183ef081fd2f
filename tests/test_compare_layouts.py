"""The layout-comparison script's parsing and comparison (its runs are torchrun launches of run_train.py)."""

from __future__ import annotations

import compare_layouts
import pytest


def test_layout_parsing():
    layout = compare_layouts.Layout.parse("2,2,2,z1")
    assert (layout.dp, layout.tp, layout.pp, layout.zero_stage, layout.world_size) == (2, 2, 2, 1, 8)
    assert compare_layouts.Layout.parse("4,1,2").name == "dp4_tp1_pp2_z0"


def test_largest_difference_finds_the_worst_step_and_rejects_mismatched_logs():
    reference = [{"step": 1, "lm_loss": 8.0, "grad_norm": 1.0}, {"step": 2, "lm_loss": 4.0, "grad_norm": 2.0}]
    other = [{"step": 1, "lm_loss": 8.0, "grad_norm": 1.0}, {"step": 2, "lm_loss": 4.0, "grad_norm": 2.2}]
    worst, step = compare_layouts.largest_difference(reference, other, ("lm_loss", "grad_norm"))
    assert step == 2 and worst == pytest.approx(0.1)
    assert compare_layouts.largest_difference(reference, reference, ("lm_loss",)) == (0.0, 0)
    with pytest.raises(ValueError):
        compare_layouts.largest_difference(reference, other[:1], ("lm_loss",))
