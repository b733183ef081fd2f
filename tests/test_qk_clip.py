"""QK-clip (MuonClip): the largest attention logit per head under every mask form, the rescale of the query and key
rows, the clip at every layout against one process, and its refusals."""

from __future__ import annotations

import pytest
import torch

from nanotron.config import DeepseekV3Config, LlamaConfig
from nanotron.models.deepseek_v3.model import LatentAttention
from nanotron.models.llama.model import LlamaAttention
from nanotron.nn.attention import AttentionMasks
from nanotron.nn.flash_attention import FlashMask, document_boundaries
from nanotron.nn.max_logits import LogitMaxima, max_logits, record_max_logits
from nanotron.optim.qk_clip import block_row_factors, head_factors
from support.configs import tiny_config_dict, write_config
from support.distributed import run_distributed
from support.parity import assert_matches_reference, assert_reference_trains, final_weights
from support.runs import assert_user_error, cli, trainer_metrics


def _relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest over elements, in float64 (``torch.testing`` takes seconds to load in the quick tier)."""
    got, expected = got.double(), expected.double()
    return ((got - expected).abs() / expected.abs()).max().item()


def _dense_max_logits(q: torch.Tensor, k: torch.Tensor, allow: torch.Tensor) -> torch.Tensor:
    """Every logit at once (the reference): [batch, heads, queries, keys] where ``allow`` [batch | 1, queries, keys]."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return logits.masked_fill(~allow[:, None], float("-inf")).amax(dim=(0, 2, 3))


def _masks(sequence: int, documents: torch.Tensor) -> AttentionMasks:
    return AttentionMasks.of_sequence(sequence, torch.device("cpu"), documents=documents)


def _mask_case() -> tuple[torch.Tensor, ...]:
    """q [2, 4, 10, 8] and k [2, 2, 10, 8], two documents per row, and the causal, same-document and 3-position
    window rules, [batch | 1, queries, keys]."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 10, 8) * 3, torch.randn(2, 2, 10, 8) * 3
    documents = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
    causal = torch.ones(10, 10).tril().bool()[None]
    inside = documents[:, :, None] == documents[:, None, :]
    window = causal & (torch.arange(10)[None, :] > torch.arange(10)[:, None] - 3)
    return q, k, documents, causal, inside, window


def test_max_logits_reads_every_mask_form_as_the_dense_rule(monkeypatch):
    """Plain causal (None), the dense mask with documents and a window, FA4's mask of runs and of documents: the
    chunked maximum (chunks of 3 queries) is the dense one under the same rule."""
    monkeypatch.setattr("nanotron.nn.max_logits.CHUNK_ELEMENTS", 2 * 4 * 3 * 10)
    q, k, documents, causal, inside, window = _mask_case()
    masks = _masks(10, documents)
    cases = [(None, causal), (masks.dense(None), causal & inside), (masks.dense(3), window & inside),
             (FlashMask(3, query_runs=((0, 10),)), window),
             (FlashMask(None, cu_seqlens=document_boundaries(documents)), causal & inside)]
    for mask, allow in cases:
        assert _relative_difference(max_logits(q, k, mask), _dense_max_logits(q, k, allow)) < 1e-6


def _llama_attention(kv_heads: int) -> LlamaAttention:
    return LlamaAttention(LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=kv_heads,
                                      attention_bias=True))


def _latent_attention() -> LatentAttention:
    return LatentAttention(DeepseekV3Config(hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=8,
                                            qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8))


@pytest.mark.full_tier
def test_max_logits_reads_a_flex_block_mask_as_the_dense_rule():
    """CUDA's form of windows and documents (building one on the CPU takes seconds: full tier)."""
    q, k, documents, _, inside, window = _mask_case()
    mask = _masks(10, documents).block_mask(3)
    assert _relative_difference(max_logits(q, k, mask), _dense_max_logits(q, k, window & inside)) < 1e-6


@pytest.mark.parametrize("build, rotary_dim, shared_keys", [
    (lambda: _llama_attention(4), 8, False), (lambda: _llama_attention(2), 8, True), (_latent_attention, 4, False),
], ids=["mha", "gqa-bias", "mla"])
def test_a_head_past_the_threshold_is_brought_to_it_and_the_others_are_untouched(build, rotary_dim, shared_keys):
    """Record the maxima of one forward, scale the rows by the clip's factors: on the same input a clipped head's
    largest logit is the threshold, every other head's is what it was (multi-head, grouped-query with a bias,
    latent attention)."""
    torch.manual_seed(1)
    attention = build()
    with torch.no_grad():  # heads of different sizes
        for param in attention.parameters():
            param.mul_(torch.linspace(1, 4, param.shape[0]).view(-1, *[1] * (param.dim() - 1)))
    record_max_logits(attention)
    x = torch.randn(2, 12, 32)
    rotary = tuple(torch.randn(12, rotary_dim) for _ in range(2))

    def maxima() -> torch.Tensor:
        attention(x, rotary)
        return attention.core.take(4, x.device)

    before = maxima()
    threshold = before.median().item()
    gamma = head_factors(before, threshold)
    clipped = gamma < 1
    assert clipped.sum() in (1, 2) and not clipped.all()
    with torch.no_grad():
        for param, rows in block_row_factors(attention, gamma, shared_keys).items():
            param.mul_(rows.view(-1, *[1] * (param.dim() - 1)))
    after = maxima()
    assert _relative_difference(after[clipped], torch.full_like(after[clipped], threshold)) < 1e-5
    assert _relative_difference(after[~clipped], before[~clipped]) < 1e-6


def test_the_record_counts_training_forwards_only_and_take_starts_it_afresh():
    core = LogitMaxima(LlamaAttention(LlamaConfig(hidden_size=32, num_attention_heads=4)).core)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8)
    with torch.no_grad():
        core(q, k, k, None)
    assert core.maximum is None
    core(q, k, k, None)
    core(q * 2, k, k, None)
    assert torch.equal(core.take(4, q.device), max_logits(q * 2, k, None).maximum(max_logits(q, k, None)))
    assert torch.isinf(core.take(4, q.device)).all()


# --- at every layout, exactly ---------------------------------------------------------------------------------------

STEPS = 10
# Within the range of the tiny models' largest logits per head over the first steps (initialised at std 0.2: Llama's
# about 8 to 14, DeepSeek-V3's about 5 to 8), so that some heads are clipped at some steps and others are not.
THRESHOLD, LATENT_THRESHOLD = 11.0, 6.5


# DeepSeek-V3's latent attention, 2 layers (the second with experts), no YaRN
LATENT = {"is_deepseek_v3_config": True, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64, "tie_word_embeddings": True,
          "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 16,
          "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}


def qk_clip_config(tiny_data, folder, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, zero: int = 0,
                   kv_heads: int = 4, latent: bool = False) -> dict:
    """The Muon runs' 16-sequence global batch at every layout, 10 steps, QK-clip at ``THRESHOLD``; the tiny Llama
    with ``kv_heads``, or (``latent``) a tiny DeepSeek-V3."""
    config = tiny_config_dict(tiny_data, folder, parallelism={"dp": dp, "tp": tp, "pp": pp,
                                                              "context_parallel_size": cp},
                              tokens={"micro_batch_size": 4, "batch_accumulation_per_replica": 4 // dp,
                                      "train_steps": STEPS})
    config["model"]["model_config"] = dict(LATENT) if latent else config["model"]["model_config"] | {
        "num_key_value_heads": kv_heads}
    config["model"]["init_method"] = {"std": 0.2}
    config["optimizer"] |= {"name": "muon", "zero_stage": zero,
                            "muon_qk_clip_threshold": LATENT_THRESHOLD if latent else THRESHOLD}
    config["checkpoints"] |= {"save_final_state": False}
    return config


def _train(config: dict) -> dict:
    """Train; the metrics (rank 0) and this rank's pieces of the final weights."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    trainer.train()
    weights = final_weights(trainer)
    return {"metrics": trainer_metrics(trainer), "weights": weights}


def _reference(tiny_data, folder, **model) -> dict:
    """One process; heads are clipped at some steps (the largest logit is then past the threshold), not all."""
    config = qk_clip_config(tiny_data, folder, **model)
    (result,) = run_distributed(_train, 1, timeout=600, config=config)
    metrics, threshold = result["metrics"], config["optimizer"]["muon_qk_clip_threshold"]
    assert_reference_trains(metrics, STEPS)
    clipped = [record["qk_clip_heads"] for record in metrics]
    assert 0 < sum(clipped) < 2 * 4 * STEPS, clipped  # of layers x heads x steps
    for record in metrics:
        assert (record["qk_clip_heads"] > 0) == (record["qk_clip_max_logit"] > threshold), record
    return result


@pytest.fixture(scope="module")
def mha_reference(tiny_data, tmp_path_factory):
    return _reference(tiny_data, tmp_path_factory.mktemp("mha") / "run", kv_heads=4)


@pytest.fixture(scope="module")
def gqa_reference(tiny_data, tmp_path_factory):
    return _reference(tiny_data, tmp_path_factory.mktemp("gqa") / "run", kv_heads=2)


@pytest.fixture(scope="module")
def latent_reference(tiny_data, tmp_path_factory):
    return _reference(tiny_data, tmp_path_factory.mktemp("latent") / "run", latent=True)


def _matches_reference(reference: dict, tiny_data, folder, layout: dict, **model) -> None:
    ranks = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    results = run_distributed(_train, ranks, timeout=600, config=qk_clip_config(tiny_data, folder, **model, **layout))
    assert_matches_reference(reference, results, layout)
    (metrics,) = [result["metrics"] for result in results if result["metrics"]]
    for expected, got in zip(reference["metrics"], metrics, strict=True):
        assert got["qk_clip_heads"] == expected["qk_clip_heads"], (layout, got["step"])
        assert got["qk_clip_max_logit"] == pytest.approx(expected["qk_clip_max_logit"], rel=1e-5), (layout, got["step"])


@pytest.mark.slow
def test_qk_clip_at_dp2_tp2_zero1_matches_one_process(mha_reference, tiny_data, tmp_path):
    """Heads split over tp ranks, maxima over dp ranks and micro-batches, masters sharded by ZeRO-1."""
    _matches_reference(mha_reference, tiny_data, tmp_path / "run", {"dp": 2, "tp": 2, "zero": 1}, kv_heads=4)


@pytest.mark.full_tier
@pytest.mark.parametrize("layout", [{"tp": 2}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 3}, {"pp": 2}, {"cp": 2}],
                         ids=lambda layout: "-".join(f"{key}{value}" for key, value in layout.items()))
def test_qk_clip_of_multi_head_attention_at_a_layout_matches_one_process(mha_reference, tiny_data, tmp_path, layout):
    _matches_reference(mha_reference, tiny_data, tmp_path / "run", layout, kv_heads=4)


@pytest.mark.full_tier
@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 4}, {"dp": 2, "zero": 1}],
                         ids=["tp2", "tp4-kv-heads-replicated", "dp2-zero1"])
def test_qk_clip_of_grouped_query_attention_at_a_layout_matches_one_process(gqa_reference, tiny_data, tmp_path,
                                                                            layout):
    _matches_reference(gqa_reference, tiny_data, tmp_path / "run", layout, kv_heads=2)


@pytest.mark.full_tier
@pytest.mark.parametrize("compiled, recompute", [(True, "selective"), (False, "pointwise")],
                         ids=["compiled-selective", "eager-pointwise"])
def test_qk_clip_in_recomputed_layers_matches_one_process(mha_reference, tiny_data, tmp_path, compiled, recompute):
    """The record runs eagerly inside compiled layers, out of sight of selective recomputation's dispatch modes and
    not again when a layer recomputes its forward in the backward."""
    config = qk_clip_config(tiny_data, tmp_path / "run")
    config["model"]["compile"], config["parallelism"]["recompute"] = compiled, recompute
    results = run_distributed(_train, 1, timeout=900, config=config)
    assert_matches_reference(mha_reference, results, f"compiled {compiled}, {recompute} recompute")


@pytest.mark.full_tier
def test_qk_clip_of_latent_attention_at_tp2_matches_one_process(latent_reference, tiny_data, tmp_path):
    _matches_reference(latent_reference, tiny_data, tmp_path / "run", {"tp": 2}, latent=True)


# --- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("settings, fragments", [
    ({"muon_qk_clip_threshold": 0}, ["optimizer.muon_qk_clip_threshold must be > 0"]),
    ({"name": "adamw", "muon_qk_clip_threshold": 100.0},
     ["optimizer.muon_qk_clip_threshold is a setting of Muon but optimizer.name is adamw"]),
], ids=["not-positive", "without-muon"])
def test_a_bad_threshold_is_one_line_naming_the_key(tiny_data, tmp_path, settings, fragments):
    config = tiny_config_dict(tiny_data, tmp_path / "run")
    config["optimizer"] |= {"name": "muon"} | settings
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "config.yaml", config)), *fragments)



@pytest.mark.parametrize("family, fragment", [
    ({"is_mamba_config": True, "d_model": 64, "num_hidden_layers": 2, "vocab_size": 384}, "has no attention"),
    ({"is_qwen3_config": True}, "undoes any scaling of the projections' rows"),
], ids=["mamba", "qwen3"])
def test_a_family_whose_logits_the_clip_cannot_bound_is_refused_by_name(tiny_data, tmp_path, family, fragment):
    from nanotron.config import ConfigError, config_from_dict

    config = tiny_config_dict(tiny_data, tmp_path / "run")
    if "is_mamba_config" not in family:
        family = {key: value for key, value in config["model"]["model_config"].items() if key != "is_llama_config"} \
            | family
    config["model"]["model_config"] = family
    config["optimizer"] |= {"name": "muon", "muon_qk_clip_threshold": 100.0}
    with pytest.raises(ConfigError) as info:
        config_from_dict(config)
    (problem,) = [problem for problem in info.value.problems if "muon_qk_clip_threshold" in problem]
    assert fragment in problem and problem.endswith("remove the key"), problem
