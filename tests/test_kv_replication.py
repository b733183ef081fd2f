"""Tensor parallelism beyond the number of kv heads: each kv head is replicated over the TP ranks whose query heads
use it (4 heads / 2 kv heads at tp=4; multi-query, 1 kv head, at tp=2). Gradients, grad-norm and checkpoints must
equal the single-process run; a checkpoint written at tp=4 resumes at tp=1 on the same curve."""

from __future__ import annotations

import pytest
import torch

from support.configs import tiny_config_dict
from support.distributed import run_distributed
from support.hf import nanotron_outputs
from support.parity import assemble, assert_reference_trains, parity_run
from support.runs import train_on_ranks
from support.tiers import parity_steps

STEPS = parity_steps()


def kv_config(tiny_data, folder, tp: int, kv_heads: int, **checkpoints) -> dict:
    base = tiny_config_dict(tiny_data, folder)
    model = base["model"]
    model["model_config"] = model["model_config"] | {"num_attention_heads": 4, "num_key_value_heads": kv_heads,
                                                     "intermediate_size": 128}
    optimizer = base["optimizer"]  # an explicit decay length: the LR of a step does not depend on train_steps
    optimizer["learning_rate_scheduler"] |= {"lr_warmup_steps": 1, "lr_decay_steps": STEPS}
    return tiny_config_dict(tiny_data, folder, model=model, optimizer=optimizer, tokens={"train_steps": STEPS},
                            parallelism={"tp": tp, "tp_mode": "REDUCE_SCATTER", "tp_linear_async_communication": True},
                            checkpoints={"checkpoint_interval": 1000} | checkpoints)


@pytest.mark.parametrize("tp, kv_heads", [pytest.param(4, 2, marks=pytest.mark.full_tier), (2, 1)],
                         ids=["tp4-2kv", "tp2-mqa"])
@pytest.mark.slow
def test_replicated_kv_heads_match_one_process(tiny_data, tmp_path, tp, kv_heads):
    (reference,) = run_distributed(parity_run, 1, config=kv_config(tiny_data, tmp_path / "ref", 1, kv_heads))
    assert_reference_trains(reference["metrics"], STEPS)
    results = run_distributed(parity_run, tp, config=kv_config(tiny_data, tmp_path / "tp", tp, kv_heads))
    head_dim = 16
    # Each rank holds 4 / tp query heads and one kv head (for k and for v), shared with tp / kv_heads - 1 others.
    assert results[0]["local_shapes"]["layers.0.attn.qkv_proj.weight"][0] == (4 // tp + 2) * head_dim
    reference_grads = assemble([reference], "grads")
    for name, grad in assemble(results, "grads").items():  # ranks sharing a kv head must hold the same gradient
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert results[0]["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    for expected, got in zip(reference["metrics"], results[0]["metrics"], strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), got["step"]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), got["step"]  # kv counted once


@pytest.mark.full_tier
def test_a_tp4_checkpoint_of_2_kv_heads_resumes_at_tp1_and_exports(tiny_data, tmp_path):
    from safetensors.torch import load_file

    from nanotron.checkpoint.hf import nanotron_to_hf

    half = STEPS // 2
    straight = train_on_ranks(kv_config(tiny_data, tmp_path / "straight", 1, 2, save_initial_state=True), 1)
    first = kv_config(tiny_data, tmp_path / "run", 4, 2, save_initial_state=True)
    first["tokens"]["train_steps"] = half
    train_on_ranks(first, 4)
    resumed = kv_config(tiny_data, tmp_path / "run", 1, 2, resume_checkpoint_path=str(tmp_path / "run"))
    metrics = train_on_ranks(resumed, 1)
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    for expected, got in zip(straight, metrics, strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), got["step"]
    # The initial checkpoint written at tp=4 stores each kv head once, as the tp=1 run does: identical exports.
    exported = {run: load_file(nanotron_to_hf(tmp_path / run / "0", tmp_path / f"hf-{run}") / "model.safetensors")
                for run in ("run", "straight")}
    assert set(exported["run"]) == set(exported["straight"])
    for name, tensor in exported["run"].items():
        assert torch.equal(tensor, exported["straight"][name]), name
    # The checkpoint written at tp=4 generates at tp=4 as at tp=1: same logits, same greedy tokens (KV cache on).
    written_at_tp4 = str(tmp_path / "run" / str(half))
    (single,) = run_distributed(nanotron_outputs, 1, ckpt=written_at_tp4, tp=1, pp=1)
    sharded = run_distributed(nanotron_outputs, 4, ckpt=written_at_tp4, tp=4, pp=1)
    torch.testing.assert_close(sharded[0]["logits"], single["logits"], rtol=1e-5, atol=1e-5)
    assert sharded[0]["cached"] == single["cached"] == single["uncached"]
