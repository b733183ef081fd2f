"""The Qwen2 family (``is_qwen2_config``): per-layer sliding windows and NoPE layers against transformers' Qwen2 and
SmolLM3 (logits, greedy generation with the KV cache, conversion both ways), upstream's layer rules, the logit
z-loss (by hand, fused and unfused, and at tp=2), upstream's YAML keys, and the features refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.configs import tiny_config_dict, tp_config, write_config
from support.distributed import run_distributed_each
from support.hf import (
    away_from_initial_values,
    export_back_exactly,
    one_process_outputs,
    transformers_outputs,
)
from support.parity import assert_reference_trains, check_against_reference, first_step, parity_run
from support.runs import assert_user_error, cli, metrics, train_through_cli

SHAPE = dict(vocab_size=112, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rope_theta=5000.0, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, initializer_range=0.1)
WINDOW = 3
# transformers class prefix, config arguments, and the layers that should slide and skip RoPE once converted
VARIANTS = {
    # layers at index >= max_window_layers slide
    "qwen2": ("Qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2}, [2, 3], []),
    # a free no_rope_layers list (1 = RoPE on), sliding windows on layers 0 and 3, one of them without RoPE
    "smollm3": ("SmolLM3", {"use_sliding_window": True, "sliding_window": WINDOW, "no_rope_layers": [1, 0, 1, 0],
                            "layer_types": ["sliding_attention", "full_attention", "full_attention",
                                            "sliding_attention"]}, [0, 3], [1, 3]),
}
PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7, 21]]
NEW_TOKENS = 12  # generated well past the window


def _save_random(family: str, folder: Path, changes: dict) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(**SHAPE | changes))
    away_from_initial_values(model).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module", params=list(VARIANTS))
def converted(request, tmp_path_factory):
    name = request.param
    family, changes, sliding, nope = VARIANTS[name]
    root = tmp_path_factory.mktemp(name)
    hf = _save_random(family, root / "hf", changes)
    outcome = cli("convert", "hf-to-nanotron", "--hf-path", hf, "--save-path", root / "nanotron")
    assert outcome.code == 0, outcome.stderr[-3000:]
    return {"name": name, "hf": hf, "ckpt": root / "nanotron", "sliding": sliding, "nope": nope, "root": root}


def test_logits_and_greedy_generation_match_transformers(converted):
    """Sliding windows shorter than the prompt and the generated text, NoPE layers; prompts of different lengths
    (left padding) with and without the KV cache."""
    ours = one_process_outputs(converted["ckpt"], PROMPTS, NEW_TOKENS)
    theirs = transformers_outputs(converted["hf"], PROMPTS, NEW_TOKENS)
    layers = ours["layers"]
    assert [i for i, layer in enumerate(layers) if layer.attn.window == WINDOW] == converted["sliding"]
    assert [i for i, layer in enumerate(layers) if not layer.attn.rope] == converted["nope"]
    assert (ours["logits"] - theirs["logits"]).abs().max() < 1e-4
    assert ours["cached"] == ours["uncached"] == theirs["greedy"]


def test_conversion_back_is_exact(converted):
    before, after, _ = export_back_exactly(converted["hf"], converted["ckpt"], converted["root"] / "back", PROMPTS[0])
    assert after.architectures == before.architectures
    keys = ["layer_types", "sliding_window", "use_sliding_window"]
    keys += ["no_rope_layers"] if converted["name"] == "smollm3" else []
    assert {key: getattr(after, key) for key in keys} == {key: getattr(before, key) for key in keys}


def test_qwen2_config_without_biases_nor_windows_exports_as_either_architecture():
    from nanotron.config import Qwen2Config
    from nanotron.errors import CheckpointError
    from nanotron.models.qwen2.hf_adapter import Qwen2HFAdapter

    adapter = Qwen2HFAdapter()
    plain = adapter.config_to_hf(Qwen2Config(num_hidden_layers=2), "float32")
    assert plain["architectures"] == ["SmolLM3ForCausalLM"] and plain["no_rope_layers"] == [1, 1]
    assert plain["layer_types"] == ["full_attention"] * 2 and plain["use_sliding_window"] is False
    biased = adapter.config_to_hf(Qwen2Config(num_hidden_layers=2, attention_bias=True, sliding_window_size=4,
                                              sliding_window_layers=[1]), "float32")
    assert biased["architectures"] == ["Qwen2ForCausalLM"] and biased["max_window_layers"] == 1
    with pytest.raises(CheckpointError, match="q/k/v biases and layers without RoPE"):
        adapter.config_to_hf(Qwen2Config(num_hidden_layers=2, attention_bias=True, no_rope_layer=2), "float32")


def test_per_layer_fields_derived_where_config_json_lists_none():
    """transformers writes ``layer_types`` and ``no_rope_layers`` out; older or hand-written files may leave them to
    ``max_window_layers`` (Qwen2) and ``no_rope_layer_interval`` (SmolLM3), with their defaults."""
    from nanotron.errors import CheckpointError
    from nanotron.models.qwen2.hf_adapter import Qwen2HFAdapter

    adapter = Qwen2HFAdapter()
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 8,
            "num_attention_heads": 4, "use_sliding_window": True, "sliding_window": 16}
    qwen2 = adapter.config_fields_from_hf(base | {"model_type": "qwen2", "max_window_layers": 5})
    assert qwen2["sliding_window_layers"] == [5, 6, 7] and qwen2["nope_layers"] is None and qwen2["attention_bias"]
    smollm3 = adapter.config_fields_from_hf(base | {"model_type": "smollm3", "no_rope_layer_interval": 3})
    assert smollm3["no_rope_layer"] == 3 and smollm3["sliding_window_layers"] == [2, 5]
    assert not smollm3["attention_bias"]
    with pytest.raises(CheckpointError, match=r"no_rope_layers must list one of 0, 1 for each of the "
                                              r"num_hidden_layers \(8\) layers"):
        adapter.config_fields_from_hf(base | {"model_type": "smollm3", "no_rope_layers": [1, 0]})


def test_llama_no_longer_converts_qwen2(tmp_path):
    from nanotron.checkpoint.hf_folder import read_hf_config
    from nanotron.models.qwen2 import QWEN2

    hf = _save_random("Qwen2", tmp_path / "hf", {})
    spec, config = read_hf_config(hf)
    assert spec is QWEN2 and config.attention_bias and config.sliding_window_size is None


# --- upstream's layer rules and the window's meaning -----------------------------------------------------------------


def test_upstream_no_rope_layer_and_sliding_window_size_rules():
    """``no_rope_layer: k`` takes RoPE off layers with (index + 1) % k == 0; ``sliding_window_size`` slides on the
    RoPE layers only (upstream's flash-attention path drops the window on its NoPE layers)."""
    from nanotron.config import Qwen2Config
    from nanotron.models.qwen2.model import Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=6,
                         num_attention_heads=2, no_rope_layer=3, sliding_window_size=5)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config, 32)
    assert [layer.attn.rope for layer in model.layers.values()] == [True, True, False, True, True, False]
    assert [layer.attn.window for layer in model.layers.values()] == [5, 5, None, 5, 5, None]


@pytest.mark.parametrize("window", [1, 3])
def test_a_window_of_w_covers_w_tokens_including_the_current_one(window):
    from nanotron.config import Qwen2Config
    from nanotron.models.qwen2.model import Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, sliding_window_size=window)
    model = Qwen2ForCausalLM(config, 32)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.5)
    ids = torch.randint(0, 32, (1, 8))
    changed = ids.clone()
    changed[0, 2] = (ids[0, 2] + 1) % 32
    with torch.no_grad():
        differs = (model(ids) - model(changed)).abs().amax(-1)[0] > 1e-6
    # one layer: position i sees positions i - window + 1 .. i
    assert differs.tolist() == [2 <= i <= 2 + window - 1 for i in range(8)]


def test_sliding_layers_count_their_window_in_the_flops():
    from nanotron.config import LlamaConfig, Qwen2Config
    from nanotron.models.llama.costs import attended_keys, llama_costs
    from nanotron.models.qwen2.costs import qwen2_costs
    from nanotron.models.qwen2.model import Qwen2ForCausalLM

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    sliding = Qwen2Config(**sizes, attention_bias=True, sliding_window_size=16, no_rope_layer=2)
    full = llama_costs(LlamaConfig(**sizes, attention_bias=True), 64, 256)
    costs = qwen2_costs(sliding, 64, 256)
    assert costs.parameters == full.parameters == sum(p.numel() for p in Qwen2ForCausalLM(sliding, 64).parameters())
    # layer 0 slides (16 keys at most: 16 - 16² / 512 = 15.5 on average), layer 1 (NoPE) attends to all 128
    assert attended_keys(16, 256) == 15.5 and attended_keys(None, 256) == attended_keys(256, 256) == 128
    assert costs.layer_flops[1] == full.layer_flops[1]
    assert full.layer_flops[0] - costs.layer_flops[0] == 12 * 32 * (128 - 15.5)
    assert costs.flops_per_token == full.flops_per_token - 12 * 32 * (128 - 15.5)


# --- z-loss --------------------------------------------------------------------------------------------------------

QWEN2_TINY = {"is_qwen2_config": True, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": True, "attention_bias": True,
              "sliding_window_size": 8, "no_rope_layer": 2, "z_loss_enabled": True, "z_loss_coefficient": 0.05}


def _by_hand(trainer, micro_batches: list, coefficient: float) -> tuple[float, float, dict]:
    """CE and coefficient · mean logsumexp² over the step's target tokens, and the gradients of their sum, from a
    copy of the trainer's model in plain torch."""
    from nanotron.models.qwen2.model import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(trainer.model.config, trainer.model.padded_vocab_size)
    model.load_state_dict(trainer.model.state_dict())
    count = sum(int(mb.label_mask.sum()) for mb in micro_batches)
    ce = z = 0.0
    for mb in micro_batches:
        logits = model(input_ids=mb.input_ids).float()
        mask = mb.label_mask
        ce = ce + torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(),
                                                    reduction="none")[mask.flatten()].sum() / count
        z = z + coefficient * logits.logsumexp(-1)[mask].square().sum() / count
    (ce + z).backward()
    return ce.item(), z.item(), {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("chunk_tokens", [0, 48], ids=["logits", "fused-head"])
def test_trained_loss_is_cross_entropy_plus_the_z_loss(tiny_data, tmp_path, chunk_tokens):
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    config = tiny_config_dict(tiny_data, tmp_path / "run", model={"dtype": "float32", "init_method": {"std": 0.2},
                                                                     "model_config": QWEN2_TINY,
                                                                     "loss_chunk_tokens": chunk_tokens})
    trainer = Trainer(config_from_dict(config))
    try:
        micro_batches = first_step(trainer)
        statistics = trainer.program.run(micro_batches, step=1)
        ce, z, grads = _by_hand(trainer, micro_batches, 0.05)
        assert z > 0.05 * 10  # logsumexp of 384 logits is ~6: the z term weighs on the gradients
        assert statistics["lm_loss"].item() == pytest.approx(ce, rel=1e-5)
        assert statistics["z_loss"].item() == pytest.approx(z, rel=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(trainer.buckets.gradient(name), grad, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        trainer.close()


@pytest.mark.slow
def test_tp2_matches_tp1_with_windows_nope_and_z_loss(tiny_data, tmp_path):
    """One 2-rank spawn for both loss paths (the vocabulary-parallel cross-entropy on logits, and the fused head);
    the tp=1 reference trains (loss falls, grad-norm > 0) and logs the z-loss beside lm_loss."""
    def config(name: str, tp: int, chunk_tokens: int) -> dict:
        cfg = tp_config(tiny_data, tmp_path, name, tp, "REDUCE_SCATTER" if tp > 1 else "ALL_REDUCE")
        cfg["model"]["model_config"] = QWEN2_TINY | {"num_attention_heads": 8, "num_key_value_heads": 4,
                                                     "z_loss_coefficient": 0.01}
        cfg["model"]["loss_chunk_tokens"] = chunk_tokens
        return cfg

    paths = (0, 8192)
    references = run_distributed_each(parity_run, 1, [{"config": config(f"ref-{c}", 1, c)} for c in paths])
    results = run_distributed_each(parity_run, 2, [{"config": config(f"tp2-{c}", 2, c)} for c in paths])
    for chunk_tokens, (reference,), ranks in zip(paths, references, results):
        assert_reference_trains(reference["metrics"], len(reference["metrics"]))
        assert all(m["z_loss"] > 0 for m in reference["metrics"])
        check_against_reference(reference, ranks, 2, ("z-loss", chunk_tokens))
        for expected, got in zip(reference["metrics"], ranks[0]["metrics"], strict=True):
            assert got["z_loss"] == pytest.approx(expected["z_loss"], rel=1e-5), got["step"]


# --- upstream's keys and the features refused by name ----------------------------------------------------------------

# upstream nanotron's Qwen2Config keys as its config_qwen.yaml writes them (sizes made tiny), with windows, NoPE
# layers and the z-loss switched on
UPSTREAM_MODEL_CONFIG = {
    "_attn_implementation": "flash_attention_2", "_fused_rms_norm": True, "_fused_rotary_emb": True,
    "_use_doc_masking": False, "_use_qkv_packed": True, "attention_bias": False, "bos_token_id": 1,
    "eos_token_id": 2, "flex_attention_mask": None, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 128, "is_qwen2_config": True, "max_position_embeddings": 64,
    "moe_config": None, "no_rope_layer": 2, "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pad_token_id": None, "pretraining_tp": 1, "rms_norm_eps": 1.0e-06,
    "rope_interleaved": False, "rope_scaling": None, "rope_theta": 10000.0, "sliding_window_size": 8,
    "tie_word_embeddings": True, "use_cache": True, "vocab_size": 384, "z_loss_coefficient": 0.0001,
    "z_loss_enabled": True, "log_attn_probs": True, "ring_attn_heads_k_stride": None,
    "rope_seq_len_interpolation_factor": None,
}


def _upstream_config(tiny_data, tmp_path, **changes) -> dict:
    config = tiny_config_dict(tiny_data, tmp_path / "run", tokens={"train_steps": 2})
    config["model"]["model_config"] = UPSTREAM_MODEL_CONFIG | changes
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    return config


def test_a_yaml_with_upstreams_qwen2_keys_trains(tiny_data, tmp_path):
    train_through_cli(_upstream_config(tiny_data, tmp_path), tmp_path / "config.yaml")
    records = metrics(tmp_path / "run")
    assert [record["step"] for record in records] == [1, 2]
    assert all(record["z_loss"] > 0 and record["lm_loss"] > 0 for record in records)


@pytest.mark.parametrize("changes, fragment", [
    ({"rope_interleaved": True}, "rope_interleaved (true): the interleaved rotary layout is not available"),
    ({"rope_seq_len_interpolation_factor": 2.0}, "rope_scaling: {rope_type: linear, factor: 2.0}"),
], ids=["interleaved", "interpolation-factor"])
def test_features_not_built_are_refused_by_name(tiny_data, tmp_path, changes, fragment):
    path = write_config(tmp_path / "config.yaml", _upstream_config(tiny_data, tmp_path, **changes))
    assert_user_error(cli("train", "--config-file", path), fragment)
    assert not (tmp_path / "run").exists()


def test_checkpoint_records_the_qwen2_type(converted):
    assert json.loads((converted["ckpt"] / "checkpoint.json").read_text())["model"]["type"] == "qwen2"


@pytest.mark.parametrize("changes, fragment", [
    ({"no_rope_layer": 2, "nope_layers": [1]}, "no_rope_layer and model.model_config.nope_layers both say"),
    ({"sliding_window_layers": [0]}, "sliding_window_layers needs sliding_window_size"),
    ({"sliding_window_size": 4, "sliding_window_layers": [0, 2]}, "sliding_window_layers ([0, 2]) must list distinct"),
    ({"nope_layers": [1, 1]}, "nope_layers ([1, 1]) must list distinct layer indices in [0, "),
    ({"sliding_window_size": 0}, "sliding_window_size must be >= 1 (got 0)"),
    ({"z_loss_coefficient": -1.0}, "z_loss_coefficient must be >= 0"),
])
def test_layer_and_z_loss_rules_name_the_key(changes, fragment):
    from nanotron.config import Qwen2Config

    problems = list(Qwen2Config(num_hidden_layers=2, **changes).problems())
    assert len(problems) == 1 and fragment in problems[0], problems
