"""Grad-norms across layouts (docs/reliability.md): the teacher-forced comparison (``teacher_forced``), which computes
every step's gradient at a layout at the weights the single-process reference had at that step, the cases compared
(``GRAD_NORM_MATRIX``; ``SPIKING_CASE``, whose bf16 and FP8 norms jumped at tp=2) and their checks."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from nanotron.training.hooks import Feature, Run
from support.configs import grad_norm_config
from support.distributed import run_distributed_each
from support.parity import assemble, assert_reference_trains, logical_pieces
from support.runs import trainer_metrics

# Tied or untied embeddings, one or two micro-batches a step, either TP mode, a small and a large learning rate, 3
# seeds; GRAD_NORM_STEPS steps each (``grad_norm_config``).
GRAD_NORM_MATRIX = [{"tied": tied, "accumulation": accumulation, "mode": mode, "lr": lr, "seed": seed}
                    for tied in (True, False) for accumulation in (1, 2) for mode in ("ALL_REDUCE", "REDUCE_SCATTER")
                    for lr in (5e-4, 3e-3) for seed in (1, 2, 3)]
# Its bf16 and FP8 grad-norms at tp=2 jumped away from tp=1's at steps 9 and 18, which spike at either layout (fp32:
# 2.65 between 1.74 and 1.61; 1.73 between 1.19 and 1.30).
SPIKING_CASE = {"tied": True, "accumulation": 2, "mode": "REDUCE_SCATTER", "lr": 3e-3, "seed": 2}
SPIKING_STEPS = (9, 18)
GRAD_NORM_STEPS = 20
# The cases of a grad-norm test: the spiking one in every tier, the matrix in the full tier.
GRAD_NORM_CASES = [pytest.param([SPIKING_CASE], id="spiking"),
                   pytest.param(GRAD_NORM_MATRIX, id="matrix", marks=pytest.mark.full_tier)]


def case_name(case: dict) -> str:
    return "-".join(str(value) for value in case.values())


def assert_case_trains(case: dict, metrics: list[dict]) -> None:
    """The case's reference learns: at lr 5e-4 the tiny Llama loses about 0.85 nat in 20 steps (measured), at 3e-3
    over 2."""
    assert_reference_trains(metrics, GRAD_NORM_STEPS, margin=0.5 if case["lr"] < 1e-3 else None)


def assert_spikes(norms: list[float], ratio: float = 1.3) -> None:
    """``SPIKING_CASE``'s reference still meets its spikes: their norms are ``ratio`` times both neighbours' or more
    (fp32: 1.33x and more; a bf16 reference's round differently on CPUs with and without bf16 instructions, 1.28x
    measured at step 18 on one without, so bf16 and FP8 references are held to 1.2x)."""
    for step in SPIKING_STEPS:
        assert norms[step - 1] > ratio * max(norms[step - 2], norms[step]), (step, norms)


class WeightsOfEachStep(Feature):
    """Records this rank's pieces of the logical weights (``logical_pieces``) before every step's forward: the
    weights the step's gradient is computed at."""

    def __init__(self):
        self.steps: list[dict] = []

    def start(self, run: Run) -> None:
        from nanotron.parallel.placement import logical_parameters

        self.params, self.pc = logical_parameters(run.model), run.pc

    def before_forward_backward(self, micro_batches: list) -> None:
        self.steps.append(logical_pieces(self.params, self.params, self.pc.coordinates, self.pc.sizes))


def train_recording_weights(config: dict) -> dict:
    """The config's training run with its own features and ``WeightsOfEachStep``: the metrics records (rank 0) and
    this rank's pieces of every step's weights."""
    from nanotron.config import config_from_dict
    from nanotron.features import features_for
    from nanotron.trainer import Trainer

    parsed = config_from_dict(config)
    recorder = WeightsOfEachStep()
    trainer = Trainer(parsed, features=[*features_for(parsed), recorder])
    trainer.train()
    return {"metrics": trainer_metrics(trainer), "weights": recorder.steps}


def grad_norms_at(config: dict, weights: list[dict[str, torch.Tensor]]) -> list[float]:
    """For each step ``k``, the global grad-norm of the step's gradient at ``weights[k - 1]`` (logical tensors, cut
    into this rank's parts by the parameters' placements) on step ``k``'s micro-batches, as the run's training loop
    reads them; the weights are never updated."""
    from nanotron.config import config_from_dict
    from nanotron.parallel.placement import get_placement
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    pc, norms = trainer.pc, []
    loader = trainer.loader(trainer.config.data_stages[0])
    try:
        for step, logical in enumerate(weights, start=1):
            with torch.no_grad():
                for name, param in trainer.params.items():
                    for local, box in get_placement(param).boxes(pc.coordinates, pc.sizes):
                        param[local].copy_(logical[name][box])
            trainer.program.run(loader.next_step(), step)
            norms.append(trainer.grad_norm().item())
            trainer.buckets.zero()
    finally:
        loader.close()
    return norms


def teacher_forced(pairs: list[tuple[dict, dict]], ranks: int,
                   timeout: float = 480) -> list[tuple[list[dict], list[float]]]:
    """Per (reference config, layout config) pair: the single-process reference's metrics records, and the
    layout's grad-norm of every step computed on ``ranks`` gloo ranks at the reference's weights of that step
    (``grad_norms_at``). Free-running layouts separate where rounding differs (bf16, FP8); forced to the same
    weights, each step's gradient must be the same whatever the layout, within the dtype's rounding."""
    references = [ranks_[0] for ranks_ in
                  run_distributed_each(train_recording_weights, 1, [{"config": ref} for ref, _ in pairs], timeout)]
    calls = [{"config": layout, "weights": [assemble([{"weights": step}], "weights") for step in ref["weights"]]}
             for (_, layout), ref in zip(pairs, references, strict=True)]
    forced = run_distributed_each(grad_norms_at, ranks, calls, timeout)
    return [(ref["metrics"], layout_ranks[0]) for ref, layout_ranks in zip(references, forced, strict=True)]


def worst_ratio(reference: list[float], layout: list[float]) -> tuple[float, int]:
    """The largest |layout / reference - 1| over the steps, and its step (from 1)."""
    deviations = [abs(b / a - 1) for a, b in zip(reference, layout, strict=True)]
    worst = max(range(len(deviations)), key=deviations.__getitem__)
    return deviations[worst], worst + 1


def check_teacher_forced(cases: list[dict], tiny_data: dict, folder: Path, bands: dict[float, float],
                         median_band: float, fp8: bool = False, fp32_sums: bool = False) -> None:
    """Teacher-forced bf16 (with FP8 products if ``fp8``; the TP partial sums in fp32 if ``fp32_sums``) at tp=2
    against the trained tp=1 reference, per case: every step's |tp2/tp1 - 1| below the band of its learning rate
    (``bands``: a spike step's) and the median step's below ``median_band`` (a gradient wrong on one shard, even by
    1%, moves every step)."""
    def config(case: dict, tp: int) -> dict:
        return grad_norm_config(tiny_data, folder / f"{case_name(case)}-tp{tp}", tp=tp, fp8=fp8,
                                fp32_sums=fp32_sums and tp > 1, **case)

    results = teacher_forced([(config(case, 1), config(case, 2)) for case in cases], 2, timeout=200 * len(cases))
    outside = []
    for case, (metrics, forced) in zip(cases, results, strict=True):
        assert_case_trains(case, metrics)
        norms = [record["grad_norm"] for record in metrics]
        if case == SPIKING_CASE:
            assert_spikes(norms, ratio=1.2)
        deviations = [abs(b / a - 1) for a, b in zip(norms, forced, strict=True)]
        if max(deviations) >= bands[case["lr"]] or statistics.median(deviations) >= median_band:
            outside.append((case, max(deviations), statistics.median(deviations)))
    assert not outside, outside  # every case outside its band, with its largest and median deviation
