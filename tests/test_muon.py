"""Muon: Newton-Schulz against float64 references, the update against a plain single-matrix implementation, which
parameters it takes, its settings, and training with it at every layout against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nanotron.config import LRSchedulerArgs, OptimizerArgs
from nanotron.optim.adamw import AdamWHyperparameters, adamw_update_
from nanotron.optim.newton_schulz import QUINTIC, UNIT_BAND, newton_schulz
from nanotron.optim.optimizer import build_optimizer
from nanotron.parallel import data_parallel
from nanotron.parallel.placement import annotate_placements
from support.configs import moe_config, tiny_config_dict, write_config
from support.distributed import run_distributed
from support.parity import assert_matches_reference, assert_reference_trains, final_weights
from support.runs import assert_user_error, cli, trainer_metrics
from support.tiers import full_tier


def _conditioned(rows: int, columns: int, condition: float, seed: int) -> torch.Tensor:
    """A float64 matrix whose singular values spread over [1, condition]."""
    generator = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, min(rows, columns), dtype=torch.float64, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(columns, min(rows, columns), dtype=torch.float64, generator=generator))
    values = torch.logspace(0, torch.log10(torch.tensor(condition)).item(), min(rows, columns), dtype=torch.float64)
    return u @ torch.diag(values) @ v.T


def _largest_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """In float64 (``torch.testing`` would take seconds to import in the quick tier)."""
    return (got.detach().double() - expected.detach().double()).abs().max().item()


def _exact_iteration(matrix: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic iteration written out in float64, on the wide orientation."""
    a, b, c = QUINTIC
    x = matrix.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.T if tall else x


@pytest.mark.parametrize("rows, columns", [(48, 48), (32, 96), (128, 40)])
def test_newton_schulz_keeps_the_singular_vectors_and_brings_the_values_into_the_quintics_band(rows, columns):
    matrix = _conditioned(rows, columns, condition=50.0, seed=rows + columns)
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    orthogonal = newton_schulz(matrix.float(), 5).double()
    # In U V^T's basis the result is diagonal: the singular vectors are the matrix's ...
    in_basis = u.T @ orthogonal @ vh.T
    off_diagonal = in_basis - torch.diag(torch.diagonal(in_basis))
    assert off_diagonal.abs().max() < 1e-5
    # ... and every singular value is within the band the quintic leaves them in after 5 steps (not exactly 1).
    values = torch.diagonal(in_basis)
    assert UNIT_BAND[0] < values.min() and values.max() < UNIT_BAND[1], (values.min(), values.max())
    assert (orthogonal - u @ vh).abs().max() < 0.4


def test_newton_schulz_in_fp32_is_the_float64_iteration_and_orthogonalises_stacks_matrix_by_matrix():
    stack = torch.stack([_conditioned(24, 40, 20.0, seed) for seed in range(3)])
    exact = torch.stack([_exact_iteration(m, 5) for m in stack])
    assert _largest_difference(newton_schulz(stack.float(), 5), exact) < 2e-6
    assert _largest_difference(newton_schulz(stack, 5, dtype=torch.float64), exact) < 1e-12


@pytest.fixture
def group():
    """A one-rank gloo group in this process for one test (the optimizer reduces over a data-parallel group; the
    training tests of this module start their own)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _muon_args(**settings) -> OptimizerArgs:
    return OptimizerArgs(learning_rate_scheduler=LRSchedulerArgs(learning_rate=1e-2), name="muon", weight_decay=0.1,
                         **settings)


@pytest.mark.parametrize("nesterov, scale, held", [(True, "rms_matching", False), (False, "original", True)])
def test_muon_update_is_the_plain_single_matrix_update_and_adamw_takes_the_rest(group, monkeypatch, nesterov, scale,
                                                                                 held):
    """Two settings, and gradients in a buffer or (``held``) kept as autograd produced them."""
    if held:
        monkeypatch.setattr(data_parallel, "HELD_GRADIENT_MIN_ELEMENTS", 1)
    torch.manual_seed(0)
    params = {"w": nn.Parameter(torch.randn(16, 24)), "norm": nn.Parameter(torch.ones(16))}
    holder = nn.Module()
    for name, param in params.items():
        holder.register_parameter(name, param)
    annotate_placements(holder)
    start = {name: param.detach().clone() for name, param in params.items()}
    args = _muon_args(muon_nesterov=nesterov, muon_update_scale=scale, muon_momentum=0.9)
    buckets, optimizer = build_optimizer(params, args, bucket_mb=1.0, groups={("dp", "cp", "ep"): group},
                                         single_micro_batch=held, matrices={"w"}, tp_group=group)
    assert (buckets.bucket_of["w"].grads is None) == held
    # The norm takes AdamW (``adamw_update_``, which test_optimizer.py holds against torch.optim.AdamW).
    norm, norm_moments = start["norm"].clone(), (torch.zeros(16), torch.zeros(16))
    weight, momentum = start["w"].clone(), torch.zeros(16, 24)
    factor = 0.2 * 24**0.5 if scale == "rms_matching" else 1.0
    for step in range(3):
        grads = {name: torch.randn_like(param) for name, param in params.items()}
        sum((param * grads[name]).sum() for name, param in params.items()).backward()
        buckets.finish_reduction()
        optimizer.step(1e-2)
        buckets.zero()
        momentum = 0.9 * momentum + grads["w"]
        direction = grads["w"] + 0.9 * momentum if nesterov else momentum
        weight = weight * (1 - 1e-2 * 0.1) - 1e-2 * factor * _exact_iteration(direction, 5).float()
        hyper = AdamWHyperparameters.at_step(step + 1, 1e-2, 0.9, 0.95, 1e-8, 0.0, None, torch.device("cpu"))
        adamw_update_(norm, grads["norm"], *norm_moments, torch.empty(16), hyper)
        assert _largest_difference(params["w"], weight) < 1e-6, step + 1
    assert _largest_difference(params["norm"], norm) < 1e-6
    assert optimizer.state_kinds(buckets.buckets.index(buckets.bucket_of["w"])) == ("momentum", "master")


# --- training with Muon, at every layout against one process --------------------------------------------------------

STEPS = 20 if full_tier() else 10
# The MoE trains 10 steps in every tier: expert parallelism sums the experts' gradients in another order, and that
# rounding, carried through the routing, moves the grad-norm by more than 1e-5 (relative) from step 19 on (the
# losses still agree), as the MoE's AdamW parity allows 1e-4 (test_moe.py).
MOE_STEPS = 10
MUON = {"name": "muon", "learning_rate_scheduler": {"learning_rate": 3e-3, "lr_warmup_steps": 2,
                                                    "min_decay_lr": 3e-4}}


def muon_config(tiny_data, folder, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, zero: int = 0,
                tp_mode: str = "REDUCE_SCATTER", moe: bool = False, **overrides) -> dict:
    """The same 16-sequence global batch at every layout, 10 steps (the Llama 20 in the full tier) of Muon."""
    if moe:
        config = moe_config(tiny_data, folder, dp=dp, ep=ep, tp=tp, pp=pp, zero=zero)
        config["parallelism"]["tp_mode"] = tp_mode
    else:
        config = tiny_config_dict(tiny_data, folder, parallelism={"dp": dp, "tp": tp, "pp": pp, "tp_mode": tp_mode},
                                  tokens={"micro_batch_size": 4, "batch_accumulation_per_replica": 4 // dp})
        config["model"]["model_config"] |= {"num_hidden_layers": 4}
        config["optimizer"]["zero_stage"] = zero
    config["tokens"]["train_steps"] = MOE_STEPS if moe else STEPS
    config["optimizer"] |= MUON
    config["checkpoints"] |= {"checkpoint_interval": 1000, "save_final_state": False}
    for section, values in overrides.items():
        config[section] = config.get(section, {}) | values
    return config


def _train(config: dict) -> dict:
    """Train; the metrics (rank 0) and this rank's pieces of the final weights."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    trainer.train()
    weights = final_weights(trainer)
    muon = {name for bucket in trainer.buckets.buckets if bucket.orthogonalised for name in bucket.names}
    return {"metrics": trainer_metrics(trainer), "weights": weights, "muon": muon}


@pytest.fixture(scope="module")
def llama_reference(tiny_data, tmp_path_factory):
    config = muon_config(tiny_data, tmp_path_factory.mktemp("ref") / "run")
    (result,) = run_distributed(_train, 1, timeout=600, config=config)
    assert_reference_trains(result["metrics"], STEPS)
    return result


@pytest.mark.slow
def test_muon_takes_the_decoder_matrices_and_the_reference_trains(llama_reference):
    """Embeddings (tied with the head), norms: AdamW; every attention and MLP matrix of the 4 layers: Muon."""
    assert llama_reference["muon"] == {f"layers.{i}.{m}.weight" for i in range(4)
                                       for m in ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}


LLAMA_LAYOUTS = [
    pytest.param({"dp": 2, "tp": 2, "zero": 1}, id="dp2-zero1-tp2", marks=pytest.mark.slow),
    pytest.param({"tp": 2}, id="tp2-reduce-scatter", marks=pytest.mark.full_tier),
    pytest.param({"tp": 2, "tp_mode": "ALL_REDUCE"}, id="tp2-all-reduce", marks=pytest.mark.full_tier),
    pytest.param({"tp": 4}, id="tp4-kv-heads-replicated", marks=pytest.mark.full_tier),
    pytest.param({"dp": 2, "zero": 1}, id="dp2-zero1", marks=pytest.mark.full_tier),
    pytest.param({"dp": 2, "zero": 3}, id="dp2-zero3", marks=pytest.mark.full_tier),
    pytest.param({"pp": 2}, id="pp2", marks=pytest.mark.full_tier),
]


@pytest.mark.parametrize("layout", LLAMA_LAYOUTS)
def test_muon_at_a_layout_matches_one_process(llama_reference, tiny_data, tmp_path, layout):
    config = muon_config(tiny_data, tmp_path / "run", **layout)
    ranks = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
    assert_matches_reference(llama_reference, run_distributed(_train, ranks, timeout=600, config=config), layout)


@pytest.fixture(scope="module")
def moe_reference(tiny_data, tmp_path_factory):
    config = muon_config(tiny_data, tmp_path_factory.mktemp("moe") / "run", moe=True)
    (result,) = run_distributed(_train, 1, timeout=600, config=config)
    assert_reference_trains(result["metrics"], MOE_STEPS)
    return result


@pytest.mark.full_tier
def test_muon_takes_each_experts_matrices_and_leaves_the_router_to_adamw(moe_reference):
    assert "layers.1.mlp.experts.gate_up_proj" in moe_reference["muon"]
    assert "layers.1.mlp.experts.down_proj" in moe_reference["muon"]
    assert not {name for name in moe_reference["muon"] if "router" in name}


@pytest.mark.full_tier
@pytest.mark.parametrize("layout", [{"ep": 2}, {"ep": 2, "tp": 2}, {"ep": 2, "dp": 2, "zero": 1}],
                         ids=lambda layout: "-".join(f"{key}{value}" for key, value in layout.items()))
def test_muon_on_experts_at_a_layout_matches_one_process(moe_reference, tiny_data, tmp_path, layout):
    config = muon_config(tiny_data, tmp_path / "run", moe=True, **layout)
    ranks = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("ep", 1)
    assert_matches_reference(moe_reference, run_distributed(_train, ranks, timeout=600, config=config), layout)


@pytest.mark.slow
def test_a_non_matrix_forced_into_muon_is_one_line_naming_the_key(tiny_data, tmp_path):
    config = tiny_config_dict(tiny_data, tmp_path / "run")
    config["optimizer"] |= {"name": "muon", "muon_named_params": [r"_proj\.weight$", r"layernorm"]}
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, "optimizer.muon_named_params matches layers.0.input_layernorm.weight, of shape [64]",
                      "narrow the patterns")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
