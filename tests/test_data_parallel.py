"""The full 3D composition: dp × tp × pp with ZeRO-0 and ZeRO-1 against one process with the same global batch."""

from __future__ import annotations

import json

import pytest
import torch

from support.configs import tiny_config_dict
from support.distributed import run_distributed, run_distributed_each
from support.parity import assemble, assert_reference_trains, first_step_gradients, logical_pieces
from support.tiers import parity_steps

STEPS = parity_steps()  # 6, or 20 under NANOTRON_TEST_TIER=full; the first-step gradients are checked exactly in both


def layout_config(tiny_data, tmp_path, name: str, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0,
                  **overrides) -> dict:
    """The same 8-sequence global batch for every layout: micro_batch_size shrinks as dp grows."""
    base = tiny_config_dict(tiny_data, tmp_path / name)
    model = base["model"] | overrides.pop("model", {})
    model["model_config"] = model["model_config"] | {"num_hidden_layers": 4}
    optimizer = base["optimizer"] | {"zero_stage": zero}
    tokens = {"train_steps": STEPS, "micro_batch_size": 4 // dp, "batch_accumulation_per_replica": 2}
    tokens |= overrides.pop("tokens", {})
    parallelism = {"dp": dp, "tp": tp, "pp": pp, "tp_mode": "REDUCE_SCATTER", "replica_check_interval": 5}
    return tiny_config_dict(tiny_data, tmp_path / name, model=model, optimizer=optimizer, tokens=tokens,
                            parallelism=parallelism)


def _run(config: dict) -> dict:
    """Gradients of the first step (no update), then STEPS training steps. The gradients are returned at ZeRO-0
    only: ZeRO-1 reduces each bucket onto one shard, so no rank holds a whole gradient."""
    from nanotron.config import config_from_dict
    from nanotron.layout import Axis
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    pc = trainer.pc
    _, grads = first_step_gradients(trainer)
    trainer.buckets.zero()
    trainer.train()
    metrics = []
    if pc.rank == 0:
        metrics = [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]
    weights = {}
    if pc.coord(Axis.DP) == 0:
        weights = logical_pieces(dict(trainer.params), trainer.params, pc.coordinates, pc.sizes)
    return {"metrics": metrics, "weights": weights, "state_numel": trainer.optimizer.local_state_numel(),
            "grads": grads if config["optimizer"]["zero_stage"] == 0 else {}}



def logging_metrics(results: list[dict]) -> list[dict]:
    (metrics,) = [r["metrics"] for r in results if r["metrics"]]
    return metrics


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    (result,) = run_distributed(_run, 1, config=layout_config(tiny_data, tmp_path_factory.mktemp("ref"), "ref"))
    assert_reference_trains(result["metrics"], STEPS)
    return result


# dp alone in the default tier (the 3D grid is also the resharding tests' source); the rest in the full tier.
@pytest.mark.parametrize("dp, tp, pp", [(2, 1, 1), pytest.param(2, 2, 2, marks=pytest.mark.full_tier),
                                        *(pytest.param(*layout, marks=pytest.mark.full_tier)
                                          for layout in [(2, 2, 1), (2, 1, 2), (1, 2, 2)])])
@pytest.mark.slow
def test_layout_matches_single_process_with_zero_0_and_1(reference, tiny_data, tmp_path, dp, tp, pp):
    calls = [{"config": layout_config(tiny_data, tmp_path, f"zero{zero}", dp, tp, pp, zero)} for zero in (0, 1)]
    runs = dict(enumerate(run_distributed_each(_run, dp * tp * pp, calls)))
    # Exact first-step gradients: every reduction (over dp, tp and the tied pipeline ends) is in place.
    reference_grads, grads = assemble([reference], "grads"), assemble(runs[0], "grads")
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    for zero in (0, 1):
        for expected, got in zip(reference["metrics"], logging_metrics(runs[zero]), strict=True):
            assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), (zero, got["step"])
            assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), (zero, got["step"])

    zero0, zero1 = assemble(runs[0], "weights"), assemble(runs[1], "weights")
    for name in zero0:
        # Same update rule on shards; only the summation order of the grad-norm (hence the clip factor) differs.
        assert (zero1[name] - zero0[name]).abs().max().item() <= 1e-6, name
    if dp > 1:  # ZeRO-1 holds 1/dp of the optimizer state (up to bucket padding)
        ratio = runs[1][0]["state_numel"] / runs[0][0]["state_numel"]
        assert ratio == pytest.approx(1 / dp, rel=0.02)


def _first_gradients(config: dict) -> dict:
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    _, pieces = first_step_gradients(Trainer(config_from_dict(config)))
    return {"grads": pieces}


@pytest.mark.full_tier
def test_fp32_accumulation_of_bf16_gradients_is_closer_to_fp32(tiny_data, tmp_path):
    accumulate = {"tokens": {"micro_batch_size": 1, "batch_accumulation_per_replica": 8}}
    fp32 = assemble(run_distributed(_first_gradients, 1, config=layout_config(
        tiny_data, tmp_path, "fp32", model={"dtype": "float32"}, **accumulate)), "grads")
    errors = {}
    for fp32_accumulation in (True, False):
        config = layout_config(tiny_data, tmp_path, f"bf16-{fp32_accumulation}", model={"dtype": "bfloat16"},
                               **accumulate)
        config["optimizer"]["accumulate_grad_in_fp32"] = fp32_accumulation
        grads = assemble(run_distributed(_first_gradients, 1, config=config), "grads")
        errors[fp32_accumulation] = sum((grads[n].double() - fp32[n].double()).norm() ** 2 for n in fp32) ** 0.5
    assert errors[True] < errors[False]


def _diverged_replica() -> str:
    import torch.distributed as dist
    from torch import nn

    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext
    from nanotron.parallel.data_parallel import GradientBuckets, ReplicaDivergenceError, check_replicas_agree
    from nanotron.parallel.placement import annotate_placements

    pc = ParallelContext(Layout(dp=2))
    holder = nn.Linear(4, 4, bias=False)
    annotate_placements(holder)
    buckets = GradientBuckets({"weight": holder.weight}, set(), True, 1 << 20, pc.reduction_groups)
    with torch.no_grad():
        holder.weight.fill_(1.0)
        check_replicas_agree(buckets, step=3)
        holder.weight[0, 0] += dist.get_rank() * 1e-7
    with pytest.raises(ReplicaDivergenceError) as error:
        check_replicas_agree(buckets, step=4)
    return str(error.value)


def test_replica_check_fails_loudly_on_divergence():
    messages = run_distributed(_diverged_replica, 2)
    assert all("step 4" in message and "dp x cp x ep" in message for message in messages)


def _expert_parallel_norm_and_replica_check() -> dict:
    """dp=2 x ep=2 with ZeRO-1: a dense weight (replicated over dp and ep) and an expert weight (sharded over ep)."""
    import torch.distributed as dist
    from torch import nn

    from nanotron.layout import Axis, Layout
    from nanotron.optim.clip import GlobalGradNorm
    from nanotron.parallel.context import ParallelContext
    from nanotron.parallel.data_parallel import (
        GradientBuckets,
        ReplicaDivergenceError,
        ZeroSettings,
        check_replicas_agree,
    )
    from nanotron.parallel.placement import Shard, annotate_placements, logical_parameters

    pc = ParallelContext(Layout(dp=2, ep=2))
    holder = nn.Module()
    holder.dense, holder.expert = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    holder.expert.parameter_shards = {"weight": ((8, 4), (Shard(Axis.EP, 0),))}  # experts 0-3 on ep 0, 4-7 on ep 1
    annotate_placements(holder)
    params = logical_parameters(holder)
    buckets = GradientBuckets(params, set(), True, 1 << 20, pc.reduction_groups, ZeroSettings(stage=1))
    rank = dist.get_rank()
    with torch.no_grad():
        holder.dense.weight.fill_(1.0)
        holder.expert.weight.fill_(float(pc.coord(Axis.EP)))  # different experts hold different weights
    buckets.final_micro_batch = True
    ((rank + 1) * holder.dense.weight.sum() + 2 * (rank + 1) * holder.expert.weight.sum()).backward()
    buckets.finish_reduction()
    norm = GlobalGradNorm(buckets, pc)().item()
    check_replicas_agree(buckets, step=1)
    with torch.no_grad():
        holder.dense.weight[0, 0] += 1e-3 * (rank == 3)
    try:
        check_replicas_agree(buckets, step=2)
        divergence = None
    except ReplicaDivergenceError as error:
        divergence = str(error)
    return {"norm": norm, "divergence": divergence}


@pytest.mark.slow
def test_expert_parallel_counts_dense_gradients_over_dp_and_ep_and_expert_ones_over_dp():
    """Rank r = 2 * dp + ep gives the dense weight the gradient r + 1 and its expert shard 2 (r + 1). Dense weights
    are reduced over all 4 ranks (1+2+3+4 = 10 per element), experts over the 2 dp ranks holding them (ep 0:
    2 (1+3) = 8, ep 1: 2 (2+4) = 12): the norm is sqrt(16 * 10² + 16 * 8² + 16 * 12²). The replica check passes
    although the two ep ranks hold different experts, and catches a dense weight that drifted on one rank."""
    results = run_distributed(_expert_parallel_norm_and_replica_check, 4)
    expected = (16 * 10**2 + 16 * 8**2 + 16 * 12**2) ** 0.5
    assert all(abs(r["norm"] - expected) < 1e-4 for r in results), [r["norm"] for r in results]
    assert all(r["divergence"] is not None and "dp x cp x ep" in r["divergence"] for r in results)
