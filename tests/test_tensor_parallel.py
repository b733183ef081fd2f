"""Tensor parallelism (both modes, tp 2 and 4) against the single-process reference, on gloo."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_reference_trains, parity_steps, tiny_config_dict

from distributed import run_distributed, run_distributed_each

STEPS = parity_steps()  # 6, or 20 under NANOTRON_TEST_TIER=full; the first-step gradients are checked exactly in both


def tp_config(tiny_data, tmp_path, name: str, tp: int, mode: str, overlap: bool = False) -> dict:
    """8 heads / 4 kv heads so that tp=4 holds whole kv heads; everything splits evenly at tp 4."""
    base = tiny_config_dict(tiny_data, tmp_path / name)
    model = base["model"]
    model["model_config"] = model["model_config"] | {"num_attention_heads": 8, "num_key_value_heads": 4,
                                                     "intermediate_size": 128}
    return tiny_config_dict(tiny_data, tmp_path / name, model=model, parallelism={"tp": tp, "tp_mode": mode, "tp_linear_async_communication": overlap},
                            tokens={"train_steps": STEPS})


def _pieces(tensors: dict[str, torch.Tensor], params: dict, coords: dict, sizes: dict) -> dict:
    """Every local tensor as (logical slices, values) pieces, so the parent can rebuild the logical tensor."""
    from nanotron.parallel.placement import get_placement

    out = {}
    for name, tensor in tensors.items():
        placement = get_placement(params[name])
        out[name] = (placement.logical_shape,
                     [(logical, tensor[local].detach().clone()) for local, logical in placement.boxes(coords, sizes)])
    return out


def first_step_gradients(trainer) -> tuple[torch.Tensor, dict]:
    """Loss and gradient pieces of the first step's micro-batches, without updating the weights.

    The gradients stay in the buckets: call ``trainer.buckets.zero()`` before training on.
    """
    loss = trainer.forward_backward(trainer._loader(trainer.config.data_stages[0]).next_step())["lm_loss"]
    grads = {name: trainer.buckets.gradient(name) for name in trainer.params}
    return loss, _pieces(grads, trainer.params, trainer.pc.coordinates, trainer.pc.sizes)


def _run(config: dict) -> dict:
    """Logits, loss and gradients of the first step (no update), then STEPS training steps."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    pc, params = trainer.pc, trainer.params
    weights = _pieces(dict(params), params, pc.coordinates, pc.sizes)
    batch = trainer._loader(trainer.config.data_stages[0]).next_step()[0]
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"])
    loss, grads = first_step_gradients(trainer)
    norm_grads = {n: trainer.buckets.gradient(n).clone() for n in params if "norm" in n}
    trainer.buckets.zero()

    trainer.train()
    metrics = []
    if pc.rank == 0:
        metrics = [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]
    local_shapes = {n: tuple(p.shape) for n, p in params.items()}
    return {"weights": weights, "grads": grads, "logits": logits, "loss": loss.item(),
            "norm_grads": norm_grads, "metrics": metrics, "local_shapes": local_shapes}


def assemble(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Logical tensors rebuilt from every rank's pieces; each element must be written consistently."""
    full: dict[str, torch.Tensor] = {}
    for result in results:
        for name, (shape, pieces) in result[key].items():
            target = full.setdefault(name, torch.full(shape, float("nan")))
            for logical, values in pieces:
                region = target[logical]
                assert torch.isnan(region).all() or torch.equal(region, values), f"{name}: ranks disagree"
                region.copy_(values)
    for name, tensor in full.items():
        assert not torch.isnan(tensor).any(), f"{name} is not fully covered"
    return full


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    (result,) = run_distributed(_run, 1, config=tp_config(tiny_data, tmp_path_factory.mktemp("ref"), "ref", 1,
                                                          "ALL_REDUCE"))
    assert_reference_trains(result["metrics"], STEPS)
    return result


@pytest.mark.parametrize("tp, variants", [
    (2, [("ALL_REDUCE", False), ("REDUCE_SCATTER", False), ("REDUCE_SCATTER", True)]),
    (4, [("ALL_REDUCE", False), ("REDUCE_SCATTER", False)]),
])
def test_tensor_parallel_matches_single_process(reference, tiny_data, tmp_path, tp, variants):
    calls = [{"config": tp_config(tiny_data, tmp_path, f"{mode}-{overlap}", tp, mode, overlap)} for mode, overlap in variants]
    for variant, results in zip(variants, run_distributed_each(_run, tp, calls)):
        check_against_reference(reference, results, tp, variant)


def check_against_reference(reference: dict, results: list[dict], tp: int, variant: tuple) -> None:
    # Each rank holds 1/tp of every matrix.
    assert results[1]["local_shapes"]["layers.0.attn.qkv_proj.weight"][0] == 128 // tp, variant
    assert results[1]["local_shapes"]["embed_tokens.weight"][0] == 384 // tp

    reference_weights = assemble([reference], "weights")
    for name, tensor in assemble(results, "weights").items():
        assert torch.equal(tensor, reference_weights[name]), f"initial {name} differs"

    logits = torch.cat([r["logits"] for r in results], dim=-1)
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-5, atol=1e-6)
    assert results[0]["loss"] == pytest.approx(reference["loss"], rel=1e-5)

    reference_grads = assemble([reference], "grads")
    for name, grad in assemble(results, "grads").items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    for name in results[0]["norm_grads"]:  # replicated norm weights: same gradient on every TP rank
        for other in results[1:]:
            assert torch.equal(other["norm_grads"][name], results[0]["norm_grads"][name]), name

    for expected, got in zip(reference["metrics"], results[0]["metrics"], strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), got["step"]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), got["step"]


def test_heads_not_divisible_by_tp_is_rejected(tiny_data, tmp_path):
    from nanotron.config import ConfigError, config_from_dict

    config = tp_config(tiny_data, tmp_path, "bad", 2, "ALL_REDUCE")
    config["model"]["model_config"] |= {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 60}
    config["parallelism"]["tp"] = 4
    with pytest.raises(ConfigError) as error:
        config_from_dict(config)
    assert "num_attention_heads (6)" in str(error.value) and "parallelism.tp (4)" in str(error.value)
