"""Tensor parallelism (both modes, tp 2 and 4) against the single-process reference, on gloo."""

from __future__ import annotations

import pytest

from support.configs import tp_config
from support.distributed import run_distributed, run_distributed_each
from support.parity import assert_reference_trains, check_against_reference, parity_run
from support.tiers import parity_steps

STEPS = parity_steps()  # 6, or 20 under NANOTRON_TEST_TIER=full; the first-step gradients are checked exactly in both


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    (result,) = run_distributed(parity_run, 1, config=tp_config(tiny_data, tmp_path_factory.mktemp("ref"), "ref", 1,
                                                                "ALL_REDUCE"))
    assert_reference_trains(result["metrics"], STEPS)
    return result


@pytest.mark.parametrize("tp, variants", [
    (2, [("ALL_REDUCE", False), ("REDUCE_SCATTER", False), ("REDUCE_SCATTER", True)]),
    pytest.param(4, [("ALL_REDUCE", False), ("REDUCE_SCATTER", False)], marks=pytest.mark.slow),
])
def test_tensor_parallel_matches_single_process(reference, tiny_data, tmp_path, tp, variants):
    calls = [{"config": tp_config(tiny_data, tmp_path, f"{mode}-{overlap}", tp, mode, overlap)}
             for mode, overlap in variants]
    for variant, results in zip(variants, run_distributed_each(parity_run, tp, calls)):
        check_against_reference(reference, results, tp, variant)


def test_heads_not_divisible_by_tp_is_rejected(tiny_data, tmp_path):
    from nanotron.config import ConfigError, config_from_dict

    config = tp_config(tiny_data, tmp_path, "bad", 2, "ALL_REDUCE")
    config["model"]["model_config"] |= {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 60}
    config["parallelism"]["tp"] = 4
    with pytest.raises(ConfigError) as error:
        config_from_dict(config)
    assert "num_attention_heads (6)" in str(error.value) and "parallelism.tp (4)" in str(error.value)
