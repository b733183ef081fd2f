"""FLOPs and MFU under document masking: attention counts the (query, key) pairs inside each document packed in a
sample (within a sliding window where a layer has one), not causal attention over the whole sequence; the linears,
MLP and head count per token as before. Hand counts on packed batches, and the trainer's logged TFLOP/s."""

from __future__ import annotations

import json

import pytest
import torch

from support.configs import tiny_config_dict
from support.distributed import run_distributed_each
from support.runs import train_in_process
from support.stand_ins import benchmark_on_cpu

EOS = 9
QWEN2_TINY = {"is_qwen2_config": True, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "tie_word_embeddings": True, "attention_bias": True,
              "sliding_window_size": 6, "no_rope_layer": 3, "_use_doc_masking": True}


def _packed_batch() -> torch.Tensor:
    """Two samples of 10 tokens: documents of 3, 5 and 2 tokens (each ends with EOS but the cut-off last), and one
    document of 10."""
    return torch.tensor([[1, 2, EOS, 3, 4, 5, 6, EOS, 7, 8], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]])


def test_pairs_of_documents_with_known_lengths():
    """Causal: L(L+1)/2 per document, 6 + 15 + 3 + 55 = 79. Window of 4 keys: 1+2+3 = 6, 1+2+3+4+4 = 14, 1+2 = 3,
    1+2+3+4·7 = 34, in all 57. A window as long as the sequence is no window."""
    from nanotron.data.loader import packed_documents
    from nanotron.models.spec import attended_pairs

    packed = packed_documents(_packed_batch() == EOS)
    assert packed["document_ids"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2]
    positions = packed["position_ids"]
    assert attended_pairs(positions).item() == 79
    assert attended_pairs(positions, 4).item() == 57
    assert attended_pairs(positions, 10).item() == 79
    assert attended_pairs(positions[1:]).item() == 55 == 10 * 11 / 2
    assert attended_pairs(positions).dtype == torch.float64


def test_costs_count_each_layers_pairs_and_keep_the_rest_per_token():
    """Qwen2 with a window of 4 on its two RoPE layers and full attention on the NoPE one (hidden 64): 12 · 64 FLOPs
    per pair, so 768 · (57 + 57 + 79) for the batch; per token, the non-attention FLOPs stay, and attention's whole
    sequence count (12 · 64 · attended keys per layer) gives way to the pairs'; recompute adds a third of the layers'
    FLOPs counted the same way."""
    from nanotron.config import Qwen2Config
    from nanotron.data.loader import packed_documents
    from nanotron.models.llama.costs import attended_keys
    from nanotron.models.qwen2.costs import qwen2_costs

    fields = {k: v for k, v in QWEN2_TINY.items() if k != "is_qwen2_config"} | {"sliding_window_size": 4}
    config = Qwen2Config(**fields)
    costs = qwen2_costs(config, 384, 10)
    assert costs.attention_windows == (4, 4, None) and costs.attention_pair_flops == (768.0,) * 3
    positions = packed_documents(_packed_batch() == EOS)["position_ids"]
    attention = costs.document_attention_flops(positions)
    assert attention.item() == 768 * (57 + 57 + 79)

    whole = 768 * (2 * attended_keys(4, 10) + attended_keys(None, 10))
    assert sum(costs.attention_flops) == pytest.approx(whole, rel=1e-12)
    other = costs.flops_per_token - whole
    assert costs.masked_flops_per_token(20, attention.item()) == pytest.approx(other + 768 * 193 / 20, rel=1e-12)
    layers = sum(costs.layer_flops) - whole + 768 * 193 / 20
    assert costs.masked_flops_per_token(20, attention.item(), recompute="full") == pytest.approx(
        other + 768 * 193 / 20 + layers / 3, rel=1e-12)
    # the whole sequence's count of attention gives back the unmasked numbers
    assert costs.masked_flops_per_token(20, 20 * whole) == pytest.approx(costs.flops_per_token, rel=1e-12)
    assert costs.masked_flops_per_token(20, 20 * whole, "full") == pytest.approx(
        costs.hardware_flops_per_token("full"), rel=1e-12)


def _config(tiny_data, run, **parallelism) -> dict:
    """The tiny Qwen2 with document masking at sequence 64, 4 samples a step, 3 steps logged at steps 2 and 3."""
    config = tiny_config_dict(
        tiny_data, run, model={"dtype": "float32", "init_method": {"std": 0.2}, "model_config": QWEN2_TINY},
        tokens={"sequence_length": 64, "micro_batch_size": 2, "batch_accumulation_per_replica": 2, "train_steps": 3},
        checkpoints={"checkpoints_path": str(run), "checkpoint_interval": 1000, "save_final_state": False},
        logging={"iteration_step_info_interval": 2}, parallelism=parallelism)
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    return config


def _hand_attention_flops(micro_batches: list, eos: int, windows: list[int | None], hidden: int) -> int:
    """12 · hidden FLOPs per pair; each document (cut after every ``eos``) of L tokens has, per layer, Σ_p min(p+1, W)
    pairs, L(L+1)/2 without a window."""
    total = 0
    for mb in micro_batches:
        for ids in mb.input_ids.tolist():
            cuts = [0] + [i + 1 for i, token in enumerate(ids) if token == eos] + [len(ids)]
            for length in (end - start for start, end in zip(cuts, cuts[1:]) if end > start):
                for window in windows:
                    total += 12 * hidden * sum(min(p + 1, window or length) for p in range(length))
    return total


@pytest.mark.parametrize("recompute", [None, "full", "selective"], ids=["plain", "recomputed", "selective"])
@pytest.mark.slow
def test_training_log_reports_tflops_of_the_pairs_inside_documents(tiny_data, tmp_path, recompute):
    """The tiny Qwen2 (hidden 64, layers 0 and 1 sliding over 6 keys, layer 2 full) trained from the preprocessed
    folders at sequence 64 with document masking, logged every 2 steps over 3: each record's TFLOP/s divide back to
    the hand count of its steps' batches (the step log adds up the steps since the last record), below the causal
    count over whole sequences; with recomputed layers, the hardware's too."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(_config(tiny_data, tmp_path / "run", **(
        {"recompute": recompute} if recompute else {}))))
    try:
        eos = trainer.document_ends["main"]  # the preprocessed folders'
        loader = trainer.loader(trainer.config.data_stages[0])  # the batches train() reads: its loader starts alike
        steps = [loader.next_step() for _ in range(3)]
        trainer.train()
    finally:
        trainer.close()
    model_config = trainer.config.model.model_config
    records = [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]
    assert [record["step"] for record in records] == [2, 3]

    windows = [model_config.attention_window(i) for i in range(3)]
    assert windows == [6, 6, None]
    costs = trainer.costs
    other = costs.flops_per_token - 12 * 64 * (6 - 36 / 128 + 6 - 36 / 128 + 32)  # causal: W - W²/2s keys, or s/2
    layers = sum(costs.layer_flops) - sum(costs.attention_flops)
    for record, logged_steps in zip(records, [steps[:2], steps[2:]], strict=True):
        tokens = 2 * 2 * 64 * len(logged_steps)
        attention = sum(_hand_attention_flops(batches, eos, windows, 64) for batches in logged_steps) / tokens
        assert any((mb.input_ids == eos).any() for batches in logged_steps for mb in batches)
        expected = other + attention
        per_gpu = record["tokens_per_sec_per_gpu"]
        assert record["tflops_per_gpu"] * 1e12 / per_gpu == pytest.approx(expected, rel=1e-9)
        assert expected < trainer.flops_per_token
        # a recomputed layer runs its linears again, and its attention too unless selective recompute keeps it
        hardware = expected + {None: 0, "full": (layers + attention) / 3, "selective": layers / 3}[recompute]
        assert record["hardware_tflops_per_gpu"] * 1e12 / per_gpu == pytest.approx(hardware, rel=1e-9)


def _flops_per_token(records: list[dict]) -> list[float]:
    return [record["tflops_per_gpu"] * 1e12 / record["tokens_per_sec_per_gpu"] for record in records]


LAYOUTS = {"dp2": ({"dp": 2}, {"batch_accumulation_per_replica": 1}), "pp2": ({"pp": 2, "pp_engine": "afab"}, {}),
           "cp2": ({"context_parallel_size": 2}, {}), "tp2": ({"tp": 2, "tp_mode": "REDUCE_SCATTER"}, {})}


@pytest.mark.slow  # the count itself is checked on one process in the quick tier
def test_the_count_is_the_steps_whatever_the_layout(tiny_data, tmp_path):
    """Summed over data-parallel replicas, counted once over pipeline stages, context-parallel and tensor-parallel
    ranks: every 2-rank layout of the same global batch logs the FLOPs per token of one rank."""
    reference = _flops_per_token(train_in_process(_config(tiny_data, tmp_path / "reference")))
    calls = []
    for name, (parallelism, tokens) in LAYOUTS.items():
        config = _config(tiny_data, tmp_path / name, **parallelism)
        config["tokens"] |= tokens
        calls.append({"config": config})
    for name, ranks in zip(LAYOUTS, run_distributed_each(train_in_process, 2, calls)):
        assert _flops_per_token(ranks[0]) == pytest.approx(reference, rel=1e-9), name


@pytest.mark.slow
def test_the_benchmark_record_counts_the_pairs_of_its_two_batches(tiny_data, tmp_path, monkeypatch):
    """``run_nanotron`` on the CPU (CUDA's timers and memory counters stood in) with the tiny Qwen2 under document
    masking: the record's FLOPs per token are the mean of the hand counts of the two batches its steps alternate,
    and the causal count, which the peers (attending across documents) compute, is kept beside them."""
    import argparse

    import benchmark

    from nanotron.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(benchmark.PRESETS, "tiny-qwen2", QWEN2_TINY | {"is_llama_config": False})
    benchmark_on_cpu(monkeypatch, benchmark)
    trained, train_step = [], Trainer.train_step

    def recorded_step(trainer, micro_batches, lr):
        trained.append((trainer, micro_batches))
        return train_step(trainer, micro_batches, lr)

    monkeypatch.setattr(Trainer, "train_step", recorded_step)
    args = argparse.Namespace(data=str(tiny_data["tokenized"]), sequence_length=64, micro_batch_size=2, accumulation=1,
                              steps=2, warmup=1, save_to=None)
    result, _ = benchmark.run_nanotron(args, "tiny-qwen2", ["model.compile=false", "model.dtype=float32"])
    trainer = trained[0][0]
    eos = trainer.document_ends["main"]
    assert trained[0][1] is trained[2][1] and trained[0][1] is not trained[1][1]  # two batches, alternating
    windows = [trainer.config.model.model_config.attention_window(i) for i in range(3)]
    attention = sum(_hand_attention_flops(batches, eos, windows, 64) for _, batches in trained[:2]) / (2 * 2 * 64)
    expected = trainer.flops_per_token - sum(trainer.costs.attention_flops) + attention
    assert result["flops_per_token"] == pytest.approx(expected, rel=1e-9)
    assert result["tflops_per_gpu"] == pytest.approx(result["tokens_per_sec_per_gpu"] * expected / 1e12, rel=1e-9)
    assert result["causal_flops_per_token"] == trainer.flops_per_token > expected
