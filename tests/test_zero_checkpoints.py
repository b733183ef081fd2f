"""Checkpoints of ZeRO-2/3 and HSDP runs hold the same logical tensors as any other layout's: a run saved at one layout
and ZeRO stage resumes at another as if nothing changed, and exports to Hugging Face."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from support.configs import tiny_config_dict, write_config
from support.distributed import run_distributed
from support.hf import transformers_outputs
from support.parity import assert_reference_trains
from support.runs import assert_user_error, cli, train_in_process

# Save at SAVED_AT, then compare the next 10 steps.
SAVED_AT, STEPS = 3, 13
WARMUP = 2
Layout = tuple[int, int, int, int, int | None]  # dp, tp, pp, zero_stage, dp_shard


def config_for(tiny_data, folder, layout: Layout, resume_from=None, **checkpoints) -> dict:
    dp, tp, pp, zero, dp_shard = layout
    base = tiny_config_dict(tiny_data, folder)
    model = base["model"] | {"make_vocab_size_divisible_by": 128}  # 384 rows at tp=1, 512 at tp=2
    model["model_config"] = model["model_config"] | {"num_hidden_layers": 4}
    return tiny_config_dict(
        tiny_data, folder, model=model,
        parallelism={"dp": dp, "tp": tp, "pp": pp, "tp_mode": "REDUCE_SCATTER", "dp_shard": dp_shard},
        tokens={"train_steps": STEPS, "micro_batch_size": 4 // dp, "batch_accumulation_per_replica": 2},
        optimizer=base["optimizer"] | {"zero_stage": zero, "learning_rate_scheduler": {
            "learning_rate": 3e-3, "lr_warmup_steps": WARMUP, "lr_decay_steps": STEPS - WARMUP, "min_decay_lr": 3e-4}},
        checkpoints={"checkpoint_interval": SAVED_AT, "resume_checkpoint_path": resume_from, "save_final_state": False,
                     **checkpoints},
    )


def train(config: dict, layout: Layout) -> list[dict]:
    dp, tp, pp, _, _ = layout
    (metrics,) = [m for m in run_distributed(train_in_process, dp * tp * pp, timeout=1200, config=config) if m]
    return metrics


@pytest.fixture(scope="module")
def straight_runs(tiny_data, tmp_path_factory):
    """Uninterrupted runs at the source layouts, with a checkpoint at SAVED_AT (async saves under ZeRO-3)."""
    runs = {}

    def run(layout: Layout):
        if layout not in runs:
            folder = tmp_path_factory.mktemp("straight")
            async_save = layout[3] == 3
            runs[layout] = (folder, train(config_for(tiny_data, folder, layout, async_save=async_save), layout))
            assert_reference_trains(runs[layout][1][:6], 6)
        return runs[layout]

    return run


ZERO3_DP2, ZERO3_DP4, HSDP = (2, 1, 1, 3, None), (4, 1, 1, 3, None), (4, 1, 1, 3, 2)
ONE_PROCESS, ZERO1_DP2, TP2, PP2 = (1, 1, 1, 0, None), (2, 1, 1, 1, None), (1, 2, 1, 0, None), (1, 1, 2, 0, None)
# The default tier keeps ZeRO-3 against one process (saved and loaded); the full tier every other pair.
PAIRS = [
    (ZERO3_DP2, ONE_PROCESS),
    pytest.param(ONE_PROCESS, ZERO3_DP2, marks=pytest.mark.full_tier),
    pytest.param(ZERO3_DP2, ZERO1_DP2, marks=pytest.mark.full_tier),
    pytest.param(ZERO1_DP2, ZERO3_DP2, marks=pytest.mark.full_tier),
    pytest.param(ZERO3_DP2, ZERO3_DP4, marks=pytest.mark.full_tier),
    pytest.param(ZERO3_DP4, ZERO3_DP2, marks=pytest.mark.full_tier),
    pytest.param(ZERO3_DP2, TP2, marks=pytest.mark.full_tier),
    pytest.param(TP2, ZERO3_DP2, marks=pytest.mark.full_tier),
    pytest.param(PP2, ZERO3_DP2, marks=pytest.mark.full_tier),
    pytest.param(ZERO3_DP2, PP2, marks=pytest.mark.full_tier),
    pytest.param(HSDP, ZERO3_DP4, marks=pytest.mark.full_tier),
    pytest.param(ZERO3_DP4, HSDP, marks=pytest.mark.full_tier),
]


def layout_id(layout: Layout) -> str:
    dp, tp, pp, zero, dp_shard = layout
    return f"dp{dp}{'' if dp_shard is None else f'(shard{dp_shard})'}tp{tp}pp{pp}z{zero}"


@pytest.mark.parametrize("source, target", PAIRS, ids=layout_id)
@pytest.mark.slow
def test_resume_at_another_layout_and_zero_stage_continues_the_run(straight_runs, tiny_data, tmp_path, source,
                                                                    target):
    """The next 10 steps within 1e-6 of the run that went on at the source layout (the sums over ranks and
    micro-batches are made in another order), the schedule and data position exactly."""
    folder, straight = straight_runs(source)
    resumed = train(config_for(tiny_data, tmp_path / "resumed", target, resume_from=str(folder / str(SAVED_AT))),
                    target)
    assert [m["step"] for m in resumed] == list(range(SAVED_AT + 1, STEPS + 1))
    for expected, got in zip(straight[SAVED_AT:], resumed, strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-6), got["step"]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), got["step"]
        assert (got["lr"], got["consumed_tokens"]) == (expected["lr"], expected["consumed_tokens"])


@pytest.mark.parametrize("layout", [ZERO3_DP2, pytest.param(HSDP, marks=pytest.mark.full_tier)], ids=layout_id)
@pytest.mark.slow
def test_resume_at_the_same_zero_3_layout_is_bit_exact(straight_runs, tiny_data, tmp_path, layout):
    folder, straight = straight_runs(layout)
    resumed = train(config_for(tiny_data, tmp_path / "resumed", layout, resume_from=str(folder / str(SAVED_AT))),
                    layout)
    for expected, got in zip(straight[SAVED_AT:], resumed, strict=True):
        assert (got["lm_loss"], got["grad_norm"]) == (expected["lm_loss"], expected["grad_norm"]), got["step"]


def logical_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every logical tensor of a checkpoint's model and optimizer folders, whole."""
    from nanotron.checkpoint.logical_tensors import LogicalTensorReader

    tensors = {}
    for part in ("model", "optimizer"):
        reader = LogicalTensorReader(checkpoint / part)
        for name in reader.names():
            shape = reader.logical_shape(name)
            tensors[f"{part}:{name}"] = torch.empty(shape)
            reader.read_into(name, tuple(slice(0, n) for n in shape), tensors[f"{part}:{name}"])
    return tensors


def test_a_zero_3_checkpoint_holds_the_logical_tensors_of_one_process_and_exports(straight_runs, tmp_path):
    """Weights, masters and both Adam moments of every parameter, whole and in their logical shapes, as one
    process saves them (values within the arithmetic's differences); the Hugging Face export gives transformers
    the logits of the checkpoint."""
    sharded = logical_tensors(straight_runs(ZERO3_DP2)[0] / str(SAVED_AT))
    single = logical_tensors(straight_runs(ONE_PROCESS)[0] / str(SAVED_AT))
    assert sharded.keys() == single.keys() and any(key.startswith("optimizer:exp_avg_sq/") for key in sharded)
    for key, tensor in single.items():
        assert sharded[key].shape == tensor.shape, key
        torch.testing.assert_close(sharded[key], tensor, rtol=1e-3, atol=1e-6, msg=key)

    checkpoint = straight_runs(ZERO3_DP2)[0] / str(SAVED_AT)
    outcome = cli("convert", "nanotron-to-hf", "--ckpt-path", checkpoint, "--save-path", tmp_path / "hf")
    assert outcome.code == 0, outcome.stderr[-3000:]
    prompt = [[5, 17, 42, 8, 99, 3]]
    exported = transformers_outputs(tmp_path / "hf", prompt, new_tokens=1)["logits"]
    torch.testing.assert_close(exported, nanotron_logits(checkpoint, prompt[0]), rtol=1e-4, atol=1e-5)


def nanotron_logits(checkpoint: Path, ids: list[int]) -> torch.Tensor:
    from nanotron.generation.generate import forward_logits, load_model
    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext

    pc = ParallelContext(Layout())
    try:
        model, _ = load_model(checkpoint, pc)
        logits = forward_logits(model, pc, torch.tensor([ids]), None, None, None, last_only=False)
        return logits[0, :, :model.config.vocab_size]
    finally:
        pc.destroy()



def test_a_zero_3_checkpoint_missing_an_optimizer_shard_is_one_error_line(straight_runs, tiny_data, tmp_path):
    """One of the optimizer's shard files gone (a partial copy): the resume at one process stops with one line
    naming the file, before training writes anything."""
    saved = straight_runs(ZERO3_DP2)[0] / str(SAVED_AT)
    copy = tmp_path / "copy" / str(SAVED_AT)
    shutil.copytree(saved, copy)
    lost = sorted((copy / "optimizer").glob("*.safetensors"))[-1]
    lost.unlink()
    config = config_for(tiny_data, tmp_path / "resumed", ONE_PROCESS, resume_from=str(copy))
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, str(lost), "is missing")
    assert not (tmp_path / "resumed").exists() or not any((tmp_path / "resumed").iterdir())
