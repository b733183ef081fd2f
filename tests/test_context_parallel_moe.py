"""A mixture of experts' router losses under context parallelism: each rank holds part of every sequence, the
router's per-sequence selection counts are summed over the cp group (``ContextParallelSequenceSum``), and the
load-balancing loss and the router z-loss train exactly as on one rank holding whole sequences."""

from __future__ import annotations

import pytest
import torch

from support.configs import tiny_config_dict
from support.distributed import run_distributed, run_distributed_each
from support.parity import assemble, assert_reference_trains, first_step_then_train
from support.tiers import parity_steps

# Coefficients large enough that the router losses move the gradients well past the tolerance.
EXPERTS = {"is_llamoe_config": True, "moe_num_experts": 4, "num_experts_per_tok": 2, "moe_aux_loss_coef": 0.1,
           "moe_z_loss_coef": 0.01}
GLOBAL_BATCH = 8


def moe_config(tiny_data, folder, *, cp: int = 1, dp: int = 1, ep: int = 1) -> dict:
    base = tiny_config_dict(tiny_data, folder)
    llama = {key: value for key, value in base["model"]["model_config"].items() if key != "is_llama_config"}
    config = tiny_config_dict(
        tiny_data, folder, model=base["model"] | {"model_config": llama | EXPERTS},
        parallelism={"dp": dp, "tp": 1, "pp": 1, "context_parallel_size": cp, "expert_parallel_size": ep},
        tokens={"train_steps": parity_steps(), "micro_batch_size": 4 // (dp * ep),
                "batch_accumulation_per_replica": GLOBAL_BATCH // 4})
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    return config


LAYOUTS = {"cp2_dp2": {"cp": 2, "dp": 2}, "cp2_ep2": {"cp": 2, "ep": 2}}
ROUTER_METRICS = ("moe_load_balancing_loss", "moe_z_loss", "moe_max_expert_load")


@pytest.mark.full_tier
def test_router_losses_train_under_cp_as_on_one_rank(tiny_data, tmp_path):
    """One process, then cp2 x dp2 and cp2 x ep2 in one 4-rank spawn: the first step's loss and the gradient of
    every tensor (the router's included), then every step's loss, grad-norm and router statistics, within 1e-5."""
    (reference,) = run_distributed(first_step_then_train, 1, config=moe_config(tiny_data, tmp_path / "cp1"))
    assert_reference_trains(reference["metrics"], parity_steps())
    assert all(m["moe_load_balancing_loss"] >= 0.99 and m["moe_z_loss"] > 0 for m in reference["metrics"])
    expected = assemble([reference], "grads")
    assert expected["layers.0.mlp.router.weight"].abs().sum() > 0

    calls = [{"config": moe_config(tiny_data, tmp_path / name, **layout)} for name, layout in LAYOUTS.items()]
    for layout, ranks in zip(LAYOUTS, run_distributed_each(first_step_then_train, 4, calls), strict=True):
        assert ranks[0]["loss"] == pytest.approx(reference["loss"], rel=1e-5), layout
        for name, grad in assemble(ranks, "grads").items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=f"{layout}: {name}")
        for want, got in zip(reference["metrics"], ranks[0]["metrics"], strict=True):
            for key in ("lm_loss", "grad_norm", *ROUTER_METRICS):
                assert got[key] == pytest.approx(want[key], rel=1e-5), (layout, got["step"], key)


def _sequence_sum_gradient() -> tuple[list[float], list[float]]:
    """Each of 2 ranks holds a part ``x`` of a per-sequence sum, and backpropagates its half share of the loss
    ``(whole sum)²``: the ranks' objectives add up to it, so each part's gradient must be 2 x the whole sum."""
    import torch.distributed as dist

    from nanotron.layout import Axis, Group, Layout
    from nanotron.parallel.context import ParallelContext
    from nanotron.parallel.context_parallel import ContextParallelSequenceSum

    pc = ParallelContext(Layout(cp=2))
    x = torch.tensor([1.0, 2.0]) * (pc.coord(Axis.CP) + 1)
    x.requires_grad_(True)
    whole = ContextParallelSequenceSum(pc.group(Group.CP))(x)
    (whole.square().sum() / dist.get_world_size(pc.group(Group.CP))).backward()
    return whole.tolist(), x.grad.tolist()


def test_the_cp_sequence_sum_backpropagates_every_ranks_share():
    for whole, grad in run_distributed(_sequence_sum_gradient, 2):
        assert whole == [3.0, 6.0] and grad == [6.0, 12.0]
