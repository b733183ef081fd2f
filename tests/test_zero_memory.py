"""The memory planner under ZeRO 0-3 against the tensor storage each rank holds, measured on the CPU: the tiny
Llama shape widened so that its state, which ZeRO shards, outweighs its activations; and the advice of
``estimate-memory`` when a run does not fit."""

from __future__ import annotations

import pytest

from support.configs import tiny_config_dict
from support.distributed import run_distributed_each
from support.runs import cli
from support.storage import held_storage_peak, left_out, passes

ZERO_STAGES = (0, 1, 2, 3)
TOLERANCE = 0.05


def wide_config(tiny_data, folder, dp: int, zero: int) -> dict:
    """2.5M parameters in 4 layers; 16-token sequences, one per micro-batch."""
    base = tiny_config_dict(tiny_data, folder)
    model = base["model"] | {"model_config": base["model"]["model_config"] | {
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}}
    return tiny_config_dict(
        tiny_data, folder, model=model, parallelism={"dp": dp, "replica_check_interval": 1000},
        tokens={"sequence_length": 16, "micro_batch_size": 1, "batch_accumulation_per_replica": 2, "train_steps": 2},
        optimizer=base["optimizer"] | {"zero_stage": zero}, checkpoints={"save_final_state": False})


def measured_and_planned(config: dict) -> tuple[int, int]:
    """This rank's peak of held tensor storage over two training steps (forward and backward passes; the update's
    CPU temporaries left out), and the planner's peak less its GPU workspace."""
    from nanotron.config import config_from_dict
    from nanotron.memory import STEP_WORKSPACE_BYTES, estimate_memory
    from nanotron.trainer import Trainer

    with held_storage_peak() as peak:
        trainer = Trainer(config_from_dict(config))
        trainer.grad_norm = left_out(trainer.grad_norm)
        trainer.optimizer.step = left_out(trainer.optimizer.step)
        with passes():
            trainer.train()
    planned = estimate_memory(config_from_dict(config), gpu_memory_gb=80).stages[0].peak - STEP_WORKSPACE_BYTES
    return peak[0], planned


@pytest.mark.parametrize("dp", [pytest.param(1, marks=pytest.mark.full_tier), 2,
                                pytest.param(4, marks=pytest.mark.full_tier)])
def test_the_planner_predicts_the_storage_each_rank_holds_under_every_zero_stage(tiny_data, tmp_path, dp):
    """Within 5% of the least of the ranks' peaks (docs/config.md's table): a rank now and then holds one bucket's
    buffers more for a moment, freed late by gloo's communication thread, which the planner does not model; on a
    loaded machine every rank of a run may (seen once at ZeRO-2: 13% above on both), so a stage off by more is
    measured once again and the lesser peak kept."""
    def measure(stages: tuple[int, ...], attempt: int) -> dict[int, tuple[int, int]]:
        calls = [{"config": wide_config(tiny_data, tmp_path / f"zero{zero}-{attempt}", dp, zero)} for zero in stages]
        results = run_distributed_each(measured_and_planned, dp, calls)
        return {zero: (min(measured for measured, _ in ranks), ranks[0][1]) for zero, ranks in zip(stages, results)}

    def off(row: tuple[int, int]) -> bool:
        return row[1] != pytest.approx(row[0], rel=TOLERANCE)

    table = measure(ZERO_STAGES, 0)
    again = tuple(zero for zero, row in table.items() if off(row))
    if again:
        table |= {zero: min(table[zero], row) for zero, row in measure(again, 1).items()}
    assert not any(off(row) for row in table.values()), (dp, table)


def test_estimate_memory_advises_the_least_zero_sharding_that_fits():
    """The 8B shape at dp 8 needs 150 GB a rank; ZeRO-1 still 80, ZeRO-2 fits in 80 GB. Where nothing fits, no
    advice."""
    from support import ROOT

    shape = ["model.model_config.hidden_size=4096", "model.model_config.intermediate_size=14336",
             "model.model_config.num_hidden_layers=32", "model.model_config.tie_word_embeddings=false",
             "tokens.micro_batch_size=1", "parallelism.dp=8"]

    def estimate(gpu_memory_gb: int) -> list[str]:
        outcome = cli("estimate-memory", "--config-file", ROOT / "examples" / "config_llama1b_bench.yaml",
                      "--gpu-memory-gb", str(gpu_memory_gb), "--override", *shape)
        assert outcome.code == 0, outcome.stderr[-2000:]
        return outcome.stdout.splitlines()

    assert "fits with optimizer.zero_stage=2 (" in estimate(80)[-1]
    assert "does not fit" in estimate(20)[-1]
