"""Mamba checkpoints in Hugging Face ``transformers`` layout (``MambaForCausalLM``), to and from nanotron.

Tensor names map one to one: ``backbone.embeddings`` ↔ ``embed_tokens``, ``backbone.layers.i.{norm,mixer.*}`` ↔
``layers.i.{norm,mixer.*}``, ``backbone.norm_f`` ↔ ``norm``; a tied LM head exists only as the embedding. The
mixer's in_proj holds the channels ``x`` then the gate ``z`` in both, and conv1d the same [d_inner, 1, d_conv]
kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from nanotron.config import MambaConfig
from nanotron.models.hf_fields import COMMON_FIELDS, INITIALIZER_RANGE, Field, Ignored, Read, Refused

MAMBA_FIELDS: dict[str, Field] = COMMON_FIELDS | {
    name: Read(ours) for name, ours in (
        ("vocab_size", "vocab_size"), ("hidden_size", "d_model"), ("num_hidden_layers", "num_hidden_layers"),
        ("state_size", "ssm_cfg.d_state"), ("conv_kernel", "ssm_cfg.d_conv"), ("expand", "ssm_cfg.expand"),
        ("time_step_rank", "ssm_cfg.dt_rank"), ("time_step_min", "ssm_cfg.dt_min"),
        ("time_step_max", "ssm_cfg.dt_max"), ("time_step_init_scheme", "ssm_cfg.dt_init"),
        ("time_step_scale", "ssm_cfg.dt_scale"), ("time_step_floor", "ssm_cfg.dt_init_floor"),
        ("use_conv_bias", "ssm_cfg.conv_bias"), ("use_bias", "ssm_cfg.bias"), ("layer_norm_epsilon", "rms_norm_eps"),
        ("residual_in_fp32", "residual_in_fp32"), ("tie_word_embeddings", "tie_word_embeddings"),
        ("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id (the first of a list)"),
        ("pad_token_id", "pad_token_id"), ("intermediate_size", "checked against expand x hidden_size"))
} | {
    "hidden_act": Refused(("silu",), "the convolution's and the gate's activation, which the selective scan's "
                                     "kernels fuse"),
    "initializer_range": INITIALIZER_RANGE,
    "rescale_prenorm_residual": Ignored("scales out_proj's initial weights: conversion takes the weights"),
    "use_cache": Ignored("whether generation keeps the convolution and scan states: the same logits"),
    "use_mambapy": Ignored("which plain-torch scan transformers runs without the CUDA kernels: the same values"),
    "use_associative_scan": Ignored("which plain-torch scan transformers runs without the CUDA kernels: the same "
                                    "values"),
}

_MIXER = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
          "dt_proj.bias", "A_log", "D", "out_proj.weight", "out_proj.bias")


def _first(token_id):
    return token_id[0] if isinstance(token_id, list) and token_id else token_id


class MambaHFAdapter:
    hf_fields = {"mamba": MAMBA_FIELDS}  # per config.json model_type

    def config_fields_from_hf(self, hf: dict) -> dict:
        ssm = {
            "d_state": hf.get("state_size", 16), "d_conv": hf.get("conv_kernel", 4), "expand": hf.get("expand", 2),
            "dt_rank": hf.get("time_step_rank", "auto"), "dt_min": hf.get("time_step_min", 0.001),
            "dt_max": hf.get("time_step_max", 0.1), "dt_init": hf.get("time_step_init_scheme", "random"),
            "dt_scale": hf.get("time_step_scale", 1.0), "dt_init_floor": hf.get("time_step_floor", 1e-4),
            "conv_bias": hf.get("use_conv_bias", True), "bias": hf.get("use_bias", False),
        }
        return {
            "d_model": hf["hidden_size"], "num_hidden_layers": hf["num_hidden_layers"], "vocab_size": hf["vocab_size"],
            "ssm_cfg": ssm, "rms_norm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "residual_in_fp32": hf.get("residual_in_fp32", True),
            "tie_word_embeddings": hf.get("tie_word_embeddings", True),
            "bos_token_id": hf.get("bos_token_id"), "eos_token_id": _first(hf.get("eos_token_id")),
            "pad_token_id": hf.get("pad_token_id"),
        }

    def config_for_weights(self, config: MambaConfig, stored: Mapping[str, torch.Tensor]) -> MambaConfig:
        return config

    def derived_key_problems(self, hf: dict, config: MambaConfig) -> list[str]:
        channels = hf.get("intermediate_size")  # transformers sizes the mixer by it, nanotron by expand
        if channels is None or channels == config.d_inner:
            return []
        return [f"intermediate_size ({channels!r}) must equal expand x hidden_size = {config.ssm_cfg.expand} x "
                f"{config.d_model} = {config.d_inner}: nanotron sizes the mixer by expand"]

    def config_to_hf(self, config: MambaConfig, dtype: str) -> dict:
        ssm = config.ssm_cfg
        return {
            "architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_act": "silu",
            "hidden_size": config.d_model, "intermediate_size": config.d_inner, "state_size": ssm.d_state,
            "num_hidden_layers": config.num_hidden_layers, "vocab_size": config.vocab_size, "expand": ssm.expand,
            "conv_kernel": ssm.d_conv, "use_bias": ssm.bias, "use_conv_bias": ssm.conv_bias,
            "time_step_rank": config.dt_rank, "time_step_scale": ssm.dt_scale, "time_step_min": ssm.dt_min,
            "time_step_max": ssm.dt_max, "time_step_init_scheme": ssm.dt_init, "time_step_floor": ssm.dt_init_floor,
            "layer_norm_epsilon": config.rms_norm_eps, "residual_in_fp32": config.residual_in_fp32,
            "tie_word_embeddings": config.tie_word_embeddings, "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id, "torch_dtype": dtype,
        }

    def _pairs(self, config: MambaConfig, present: Callable[[str], bool]) -> Iterator[tuple[str, str]]:
        """(Hugging Face name, nanotron name) of every tensor the model has, layer after layer (a config.json that
        declares more layers than are stored stops at the first missing one, whatever number it declares)."""
        yield from (("backbone.embeddings.weight", "embed_tokens.weight"), ("backbone.norm_f.weight", "norm.weight"))
        for i in range(config.num_hidden_layers):
            yield f"backbone.layers.{i}.norm.weight", f"layers.{i}.norm.weight"
            yield from ((f"backbone.layers.{i}.mixer.{name}", f"layers.{i}.mixer.{name}") for name in _MIXER
                        if present(f"layers.{i}.mixer.{name}"))
        if not config.tie_word_embeddings:
            yield "lm_head.weight", "lm_head.weight"

    @staticmethod
    def _has(config: MambaConfig) -> Callable[[str], bool]:
        ssm = config.ssm_cfg
        return lambda name: not ((name.endswith(("in_proj.bias", "out_proj.bias")) and not ssm.bias)
                                 or (name.endswith("conv1d.bias") and not ssm.conv_bias))

    def weights_from_hf(self, hf: Mapping[str, torch.Tensor], config: MambaConfig) -> dict[str, torch.Tensor]:
        return {ours: hf[theirs] for theirs, ours in self._pairs(config, self._has(config))}

    def weights_to_hf(self, read: Callable[[str], torch.Tensor], config: MambaConfig) -> dict[str, torch.Tensor]:
        return {theirs: read(ours) for theirs, ours in self._pairs(config, self._has(config))}
