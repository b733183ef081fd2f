"""Context parallelism: each sequence split over ``parallelism.context_parallel_size`` ranks (load-balanced chunks,
keys and values all-gathered in attention) trains exactly as one rank holding the whole sequence, composes with
tp, dp (ZeRO-1) and pp, and resumes across cp sizes."""

from __future__ import annotations

import pytest
import torch

from nanotron.config import ConfigError, config_from_dict
from nanotron.data.batch import MicroBatch
from nanotron.layout import Axis, Group
from nanotron.nn.attention import AttentionMasks, allowed
from nanotron.parallel.context_parallel import ContextParallelBatches, token_indices
from support.configs import tiny_config_dict
from support.distributed import run_distributed, run_distributed_each
from support.parity import assemble, assert_reference_trains, first_step_then_train
from support.runs import train_on_ranks
from support.tiers import parity_steps

# Layer 0 slides over 8 tokens (chunks are 8 tokens at cp 2 over 32), layer 1 has no RoPE and attends to everything;
# the tiny corpus's documents (about 40 tokens) are masked from each other where a sample packs two.
QWEN2_TINY = {"is_qwen2_config": True, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": True, "attention_bias": True,
              "sliding_window_size": 8, "no_rope_layer": 2, "z_loss_enabled": True, "z_loss_coefficient": 0.01,
              "_use_doc_masking": True}


def cp_config(tiny_data, folder, *, cp: int = 1, tp: int = 1, dp: int = 1, pp: int = 1, zero: int = 0,
              steps: int | None = None, **overrides) -> dict:
    base = tiny_config_dict(tiny_data, folder)
    model = base["model"] | {"model_config": QWEN2_TINY}
    config = tiny_config_dict(
        tiny_data, folder, model=model,
        parallelism={"dp": dp, "tp": tp, "pp": pp, "context_parallel_size": cp, "tp_mode": "REDUCE_SCATTER"},
        tokens={"train_steps": steps or parity_steps(), "micro_batch_size": 4 // dp},
        optimizer=base["optimizer"] | {"zero_stage": zero}, **overrides)
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    return config


# --- the split and the mask, on one process ---------------------------------------------------------------------------


def test_the_split_covers_each_sequence_once_and_balances_causal_attention():
    """Rank r of N holds chunks r and 2N-1-r of 2N; every rank gets the same number of (query, key) pairs under the
    causal mask, so attention FLOPs per rank are the model's over N."""
    for size in (1, 2, 4):
        held = [token_indices(rank, size, 64) for rank in range(size)]
        assert sorted(torch.cat(held).tolist()) == list(range(64))
        pairs = [allowed(indices[:, None], torch.arange(64)[None, :]).sum().item() for indices in held]
        assert pairs == [64 * 65 // 2 // size] * size
    assert token_indices(1, 2, 16).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="2 x 3 equal chunks"):
        token_indices(0, 3, 32)


def test_the_micro_batch_is_cut_per_token_and_keeps_global_positions():
    ids = torch.arange(2 * 8).view(2, 8)
    micro_batch = MicroBatch(ids, ids + 1, ids % 3 > 0, torch.tensor([0, 1]), token_count=torch.tensor(9.0),
                             sample_weights=torch.tensor([0.5, 0.25]), extras={"reference_losses": ids * 0.5})
    part = ContextParallelBatches(1, 2).prepare(micro_batch)
    held = [2, 3, 4, 5]
    assert torch.equal(part.input_ids, ids[:, held]) and torch.equal(part.labels, ids[:, held] + 1)
    assert torch.equal(part.label_mask, micro_batch.label_mask[:, held])
    assert torch.equal(part.extras["reference_losses"], ids[:, held] * 0.5)
    assert part.position_ids.tolist() == [held, held] and part.document_ids is None
    assert torch.equal(part.domain_ids, micro_batch.domain_ids) and part.token_count.item() == 9.0
    assert torch.equal(part.sample_weights, micro_batch.sample_weights)


def test_a_ranks_masks_are_its_rows_of_the_whole_sequences_masks():
    """The masks a cp rank hands the model (its queries' global indices and documents against the whole sequence's)
    are the rows of the single-rank masks, for the causal rule, a window, and documents packed in the samples."""
    documents = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    zeros = torch.zeros(2, 16, dtype=torch.long)
    micro_batch = MicroBatch(zeros, zeros, zeros == 0, torch.tensor([0, 0]), document_ids=documents)
    whole = AttentionMasks.of_sequence(16, torch.device("cpu"), documents=documents)
    for rank in range(2):
        transform = ContextParallelBatches(rank, 2)
        part = transform.prepare(micro_batch)
        (masks,) = transform.model_inputs(part).values()
        rows = token_indices(rank, 2, 16)
        for window in (None, 3):
            assert torch.equal(masks.dense(window), whole.dense(window)[:, :, rows])
        assert torch.equal(part.extras["key_document_ids"], documents)


# --- config rules -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, fragment", [
    ({"tokens": {"sequence_length": 34}}, "tokens.sequence_length (34) must be divisible by 2 x "
                                          "parallelism.context_parallel_size = 4"),
    ({"tokens": {"sequence_length": 36}, "parallelism": {"tp": 4}},
     "tokens.sequence_length / parallelism.context_parallel_size (18) must be divisible by parallelism.tp (4)"),
    ({"model_config": {"is_llamoe_config": True, "moe_num_experts": 4, "num_experts_per_tok": 2,
                       "moe_capacity_factor": 1.5}},
     "model.model_config.moe_capacity_factor (1.5): the experts' capacity drops assignments"),
    ({"model_config": {"is_mamba_config": True}}, "context_parallel_size (2) needs an attention model"),
])
def test_layouts_cp_cannot_run_are_refused_naming_the_key(tiny_data, tmp_path, changes, fragment):
    config = cp_config(tiny_data, tmp_path, cp=2)
    for section in ("tokens", "parallelism"):
        config[section] |= changes.get(section, {})
    if "model_config" in changes:
        llama = tiny_config_dict(tiny_data, tmp_path)["model"]["model_config"]
        if "is_mamba_config" in changes["model_config"]:
            llama = {"is_mamba_config": True, "d_model": 64, "num_hidden_layers": 2, "vocab_size": 384}
        else:
            llama = llama | changes["model_config"]
            llama.pop("is_llama_config")
        config["model"]["model_config"] = llama
    with pytest.raises(ConfigError) as info:
        config_from_dict(config)
    assert any(fragment in problem for problem in info.value.problems), info.value.problems


def test_the_world_size_counts_cp(tiny_data, tmp_path):
    from nanotron.config import validate_config

    config = config_from_dict(cp_config(tiny_data, tmp_path, cp=2, tp=2))
    validate_config(config, world_size=4)
    with pytest.raises(ConfigError, match=r"parallelism.context_parallel_size \(2\) = 4, but 2 processes"):
        validate_config(config, world_size=2)


# --- parity with one rank holding the whole sequence ------------------------------------------------------------------


def _assert_same_training(reference: dict, ranks: list[dict], layout: str) -> None:
    """The first step's loss and (unless ZeRO-1 split them) gradients, then every step's loss and grad-norm, within
    1e-5 of one rank's; the step line's tokens/s per GPU counts every rank."""
    assert ranks[0]["loss"] == pytest.approx(reference["loss"], rel=1e-5), layout
    if not ranks[0]["sharded"]:
        expected = assemble([reference], "grads")
        for name, grad in assemble(ranks, "grads").items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=f"{layout}: {name}")
    for want, got in zip(reference["metrics"], ranks[0]["metrics"], strict=True):
        for key in ("lm_loss", "grad_norm", "z_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (layout, got["step"], key)
        assert got["tokens_per_sec_per_gpu"] == pytest.approx(got["tokens_per_sec"] / len(ranks))


@pytest.fixture(scope="module")
def one_rank(tiny_data, tmp_path_factory) -> dict:
    config = cp_config(tiny_data, tmp_path_factory.mktemp("cp1"))
    (reference,) = run_distributed(first_step_then_train, 1, config=config)
    assert_reference_trains(reference["metrics"], parity_steps())
    return reference


@pytest.mark.slow
def test_cp2_trains_as_one_rank_with_a_window_and_documents(one_rank, tiny_data, tmp_path):
    ranks = run_distributed(first_step_then_train, 2, config=cp_config(tiny_data, tmp_path / "cp2", cp=2))
    _assert_same_training(one_rank, ranks, "cp2")


def _grid(tp: int, cp: int, dp: int) -> tuple[int, dict, dict]:
    from nanotron.layout import Group, Layout
    from nanotron.parallel.context import ParallelContext

    pc = ParallelContext(Layout(tp=tp, cp=cp, dp=dp))
    return pc.rank, pc.coordinates, {group: pc.members(group) for group in Group}


LAYOUTS = {"cp2_tp2": {"cp": 2, "tp": 2}, "cp2_dp2_zero1": {"cp": 2, "dp": 2, "zero": 1}, "cp2_pp2": {"cp": 2, "pp": 2}}


@pytest.mark.full_tier
def test_cp2_composes_with_tp_dp_zero1_and_pp(one_rank, tiny_data, tmp_path):
    """One 4-rank spawn for the three layouts; the grid keeps cp next to tp (consecutive ranks, inside a node)."""
    calls = [{"config": cp_config(tiny_data, tmp_path / name, **layout)} for name, layout in LAYOUTS.items()]
    for name, ranks in zip(LAYOUTS, run_distributed_each(first_step_then_train, 4, calls)):
        _assert_same_training(one_rank, ranks, name)


def test_cp_sits_between_tp_and_dp_in_the_grid():
    by_rank = {rank: (coords, groups) for rank, coords, groups in run_distributed(_grid, 4, tp=1, cp=2, dp=2)}
    assert by_rank[1][0] == {Axis.PP: 0, Axis.DP: 0, Axis.EP: 0, Axis.CP: 1, Axis.TP: 0}
    assert by_rank[0][1][Group.CP] == [0, 1] and by_rank[0][1][Group.DP] == [0, 2]
    assert by_rank[0][1][Group.DENSE_REPLICAS] == [0, 1, 2, 3] and by_rank[0][1][Group.SAMPLE_SHARDS] == [0, 2]


# --- resuming across cp sizes -----------------------------------------------------------------------------------------

SAVED_AT, STEPS = 3, 6


@pytest.mark.parametrize("source, target", [(2, 1), pytest.param(1, 2, marks=pytest.mark.full_tier)])
@pytest.mark.slow
def test_resume_at_another_cp_size_continues_the_run(tiny_data, tmp_path, source, target):
    straight_folder = tmp_path / "straight"
    straight = train_on_ranks(cp_config(
        tiny_data, straight_folder, cp=source, steps=STEPS, checkpoints={
            "checkpoints_path": str(straight_folder), "checkpoint_interval": SAVED_AT, "save_final_state": False}),
        source)
    resumed_folder = tmp_path / "resumed"
    resumed = train_on_ranks(cp_config(
        tiny_data, resumed_folder, cp=target, steps=STEPS, checkpoints={
            "checkpoints_path": str(resumed_folder), "checkpoint_interval": 1000, "save_final_state": False,
            "resume_checkpoint_path": str(straight_folder / str(SAVED_AT))}), target)
    assert [m["step"] for m in resumed] == list(range(SAVED_AT + 1, STEPS + 1))
    for expected, got in zip(straight[SAVED_AT:], resumed, strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), got["step"]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), got["step"]
        assert (got["lr"], got["consumed_tokens"]) == (expected["lr"], expected["consumed_tokens"])


# --- the memory planner -----------------------------------------------------------------------------------------------


def test_the_memory_planner_holds_each_ranks_part_of_the_sequence(tiny_data, tmp_path):
    """At cp 2 a rank keeps half of each sequence's activations (plus the gathered keys and values) and of the loss's
    per-token buffers, and ZeRO-1 shards the optimizer state over dp × cp."""
    from nanotron.memory import estimate_memory

    one, two = (estimate_memory(config_from_dict(cp_config(tiny_data, tmp_path, cp=cp, zero=1)), 80.0)
                for cp in (1, 2))
    (whole,), (half,) = one.stages, two.stages
    assert "cp 2" in two.description
    assert half.master_weights == pytest.approx(whole.master_weights / 2, rel=0.02)
    assert half.weights == whole.weights
    assert half.logits < whole.logits
    assert whole.activations / 2 < half.activations < whole.activations
