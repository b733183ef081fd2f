"""Spectral µP (``model.init_method: {use_mup: true}``, upstream's spelling): initial scales and learning rates that
follow each matrix's shape, checked against the paper's formulas, by a coordinate check across widths, and at every
layout."""

from __future__ import annotations

import math

import pytest
import torch

from nanotron.config import ConfigError, config_from_dict
from nanotron.models.mup import spectral_std
from support.configs import tiny_config_dict
from support.parity import initial_weights

MUP = {"use_mup": True}
BASE_HIDDEN = 32  # widths 32 and 128: heads of 16 channels, 2 then 8 of them


def _config(tiny_data, tmp_path, hidden: int, init: dict, steps: int = 3) -> dict:
    run = tmp_path / f"run-{hidden}-{'mup' if 'use_mup' in init else 'std'}"
    config = tiny_config_dict(tiny_data, run, tokens={"sequence_length": 32, "micro_batch_size": 4,
                                                      "batch_accumulation_per_replica": 1, "train_steps": steps})
    config["model"]["init_method"] = init
    config["model"]["model_config"].update(hidden_size=hidden, intermediate_size=4 * hidden,
                                           num_attention_heads=hidden // 16, num_key_value_heads=hidden // 16,
                                           tie_word_embeddings=False)
    config["optimizer"]["learning_rate_scheduler"].update(learning_rate=5e-3, lr_warmup_steps=0)
    return config


def _hidden_rms(model, tokens: torch.Tensor) -> float:
    """The RMS of every decoder layer's output on ``tokens``, averaged over the layers."""
    outputs = []
    hooks = [layer.register_forward_hook(lambda module, args, output: outputs.append(output.float()))
             for layer in model.layers.values()]
    with torch.no_grad():
        model(input_ids=tokens)
    for hook in hooks:
        hook.remove()
    return sum(output.pow(2).mean().sqrt().item() for output in outputs) / len(outputs)


def _rms_at_init_and_after_training(config: dict) -> tuple[float, float]:
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    tokens = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(0))
    before = _hidden_rms(trainer.model, tokens)
    trainer.train()
    return before, _hidden_rms(trainer.model, tokens)


@pytest.mark.slow
def test_coordinate_check_activations_keep_their_size_as_the_width_grows_4x(tiny_data, tmp_path):
    """With µP the layers' outputs keep their RMS (within 1.2x) from width 32 to 128, at initialisation and after 3
    AdamW steps; with the standard normal(0, 0.02) they grow with the width (1.25x at initialisation, 1.67x after
    the 3 steps, on 2026-12-06)."""
    ratios = {}
    for name, init in (("mup", MUP), ("standard", {"std": 0.02})):
        small, large = (_rms_at_init_and_after_training(_config(tiny_data, tmp_path, hidden, init))
                        for hidden in (BASE_HIDDEN, 4 * BASE_HIDDEN))
        ratios[name] = [b / a for a, b in zip(small, large)]
    assert all(1 / 1.2 < ratio < 1.2 for ratio in ratios["mup"]), ratios
    assert ratios["standard"][1] > 1.5, ratios  # what the check would see without µP


@pytest.mark.slow
def test_initial_scales_are_the_spectral_formula_at_every_layout(tiny_data, tmp_path):
    """σ = 1/sqrt(fan_in) · min(1, sqrt(fan_out / fan_in)) for each linear matrix (q|k|v and gate|up as one
    matrix each, as upstream's fused layers), the embedding normal(0, 1), norms at one; tp 2 and pp 2 start from the
    same values."""
    config = _config(tiny_data, tmp_path, 64, MUP)
    weights = initial_weights(config)
    hidden, vocab = 64, 384
    expected = {"layers.0.attn.qkv_proj.weight": spectral_std(3 * hidden, hidden),
                "layers.0.attn.o_proj.weight": spectral_std(hidden, hidden),
                "layers.1.mlp.gate_up_proj.weight": spectral_std(8 * hidden, hidden),
                "layers.1.mlp.down_proj.weight": spectral_std(hidden, 4 * hidden),
                "lm_head.weight": spectral_std(vocab, hidden), "embed_tokens.weight": 1.0}
    assert expected["layers.1.mlp.down_proj.weight"] == pytest.approx(1 / math.sqrt(4 * hidden) / 2)
    for name, std in expected.items():
        assert weights[name].std().item() == pytest.approx(std, rel=0.05), name
    assert torch.equal(weights["norm.weight"], torch.ones(hidden))
    for layout in ({"tp": 2}, {"pp": 2}):
        other = initial_weights(config, **layout)
        assert all(torch.equal(other[name], weights[name]) for name in weights), layout


@pytest.mark.slow
def test_learning_rates_are_the_schedules_times_fan_out_over_fan_in(tiny_data, tmp_path):
    """Upstream's per-parameter rates: a matrix's AdamW step uses lr · fan_out / fan_in, the embedding and norms
    the schedule's."""
    from nanotron.trainer import Trainer

    config = _config(tiny_data, tmp_path, 64, MUP, steps=1)
    config["optimizer"].update(weight_decay=0.0, clip_grad=None)
    config["optimizer"]["learning_rate_scheduler"]["lr_decay_style"] = "constant"
    trainer = Trainer(config_from_dict(config))
    before = {name: param.detach().clone() for name, param in trainer.params.items()}
    trainer.train()
    expected = {"layers.0.attn.qkv_proj.weight": 3.0, "layers.0.mlp.down_proj.weight": 0.25,
                "lm_head.weight": 384 / 64, "embed_tokens.weight": 1.0, "layers.0.input_layernorm.weight": 1.0}
    for name, scale in expected.items():  # AdamW's first step moves every weight by lr · its scale (or less)
        step = (trainer.params[name].detach() - before[name]).abs().max().item()
        assert step == pytest.approx(5e-3 * scale, rel=1e-3), name


@pytest.mark.parametrize("init, family, fragment", [
    ({"use_mup": False}, {}, "model.init_method.use_mup: false is not an initialisation"),
    (MUP, {"is_llama_config": False, "is_llamoe_config": True, "moe_num_experts": 2, "num_experts_per_tok": 1},
     "model.init_method.use_mup: spectral µP covers dense attention models"),
])
def test_mup_where_it_does_not_apply_is_one_line_naming_the_key(tiny_data, tmp_path, init, family, fragment):
    config = _config(tiny_data, tmp_path, 64, init)
    config["model"]["model_config"].update(family)
    with pytest.raises(ConfigError) as error:
        config_from_dict(config)
    (problem,) = error.value.problems
    assert problem.startswith(fragment) and "\n" not in problem
