"""Convert Llama checkpoints between Hugging Face ``transformers`` and nanotron, in both directions.

Layouts (nanotron ← → Hugging Face):

- ``layers.i.attn.qkv_proj.weight`` = rows ``[q_proj | k_proj | v_proj]`` of ``model.layers.i.self_attn``;
- ``layers.i.mlp.gate_up_proj.weight`` = rows ``[gate_proj | up_proj]`` of ``model.layers.i.mlp``;
- other names map one to one (``model.`` prefix, ``attn`` ↔ ``self_attn``); a tied LM head exists only as
  ``embed_tokens.weight``.
- Rotary embeddings use the same (rotate-half, non-interleaved) convention on both sides: no row permutation.
- nanotron may pad the vocabulary (``make_vocab_size_divisible_by`` × tp); exports keep the first ``vocab_size`` rows.

Only ``safetensors`` and JSON are needed; ``transformers`` itself is used by the tests, never here.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanotron.checkpoint.logical_tensors import FORMAT_VERSION, CheckpointError, LogicalTensorReader, write_boxes
from nanotron.checkpoint.manager import METADATA, read_metadata, resolve_checkpoint
from nanotron.config import LlamaConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def llama_config_from_hf(hf: dict) -> LlamaConfig:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise CheckpointError(f"rope type {rope.get('rope_type', rope.get('type'))!r} (RoPE scaling) is not supported")
    heads = hf["num_attention_heads"]
    if hf.get("head_dim", hf["hidden_size"] // heads) != hf["hidden_size"] // heads:
        raise CheckpointError("head_dim must equal hidden_size / num_attention_heads")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise CheckpointError("Llama models with attention or MLP biases are not supported")
    return LlamaConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        max_position_embeddings=hf.get("max_position_embeddings", 2048), rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=_first(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )


def _first(token_id):
    return token_id[0] if isinstance(token_id, list) else token_id


def hf_config_from_llama(config: LlamaConfig, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id,
        "torch_dtype": dtype,
    }


def _read_hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors weights in {folder} (save the model with safe_serialization)")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
    return tensors


def _copy_tokenizer(source: Path, target: Path) -> bool:
    found = [source / name for name in TOKENIZER_FILES if (source / name).exists()]
    if found:
        target.mkdir(parents=True, exist_ok=True)
        for file in found:
            shutil.copy(file, target / file.name)
    return bool(found)


def hf_to_nanotron(hf_path: Path, save_path: Path) -> Path:
    """Write a nanotron checkpoint (weights only, step 0) from a Hugging Face Llama folder; returns its folder."""
    hf_path, save_path = Path(hf_path), Path(save_path)
    config_file = hf_path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{config_file} does not exist: --hf-path must be a Hugging Face model folder")
    hf_config = json.loads(config_file.read_text())
    if hf_config.get("model_type") != "llama":
        raise CheckpointError(f"{config_file} describes a {hf_config.get('model_type')!r} model, not 'llama'")
    config = llama_config_from_hf(hf_config)
    hf = _read_hf_tensors(hf_path)
    tensors = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        tensors[f"layers.{i}.input_layernorm.weight"] = hf[prefix + "input_layernorm.weight"]
        tensors[f"layers.{i}.post_attention_layernorm.weight"] = hf[prefix + "post_attention_layernorm.weight"]
        tensors[f"layers.{i}.attn.qkv_proj.weight"] = torch.cat(
            [hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"]])
        tensors[f"layers.{i}.attn.o_proj.weight"] = hf[attn + "o_proj.weight"]
        tensors[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])
        tensors[f"layers.{i}.mlp.down_proj.weight"] = hf[mlp + "down_proj.weight"]
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = hf["lm_head.weight"]

    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    tmp = save_path.with_name(save_path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "model").mkdir(parents=True)
    boxes = [(name, tuple(t.shape), tuple(slice(0, n) for n in t.shape), t) for name, t in sorted(tensors.items())]
    write_boxes(tmp / "model" / "hf.safetensors", boxes)
    files = ["model/hf.safetensors"]
    if _copy_tokenizer(hf_path, tmp / "tokenizer"):
        files += [f"tokenizer/{p.name}" for p in sorted((tmp / "tokenizer").iterdir())]
    metadata = {
        "format_version": FORMAT_VERSION, "step": 0, "optimizer_step": 0, "lr_schedule_start_step": 0,
        "consumed_samples": {}, "consumed_tokens": 0,
        "layout": {"dp": 1, "pp": 1, "tp": 1, "ep": 1, "zero_stage": 0},
        "model": {"vocab_size": config.vocab_size, "padded_vocab_size": config.vocab_size, "dtype": dtype,
                  "config": asdict(config)},
        "tokenizer_fingerprint": None, "converted_from": str(hf_path),
        "files": {f: (tmp / f).stat().st_size for f in files},
    }
    (tmp / METADATA).write_text(json.dumps(metadata, indent=2, sort_keys=True))
    if save_path.exists():
        raise CheckpointError(f"{save_path} already exists; choose another --save-path or delete it")
    tmp.rename(save_path)
    return save_path


def checkpoint_llama_config(checkpoint: Path, metadata: dict) -> LlamaConfig:
    """The model config recorded in a checkpoint."""
    if "config" not in metadata.get("model", {}):
        raise CheckpointError(f"{checkpoint / METADATA} has no model config: it was written by an older version")
    return LlamaConfig(**metadata["model"]["config"])


def nanotron_to_hf(ckpt_path: Path, save_path: Path) -> Path:
    """Write a Hugging Face Llama folder (config.json, model.safetensors, tokenizer) from a nanotron checkpoint."""
    checkpoint = resolve_checkpoint(Path(ckpt_path))
    metadata = read_metadata(checkpoint)
    config = checkpoint_llama_config(checkpoint, metadata)
    reader = LogicalTensorReader(checkpoint / "model")

    def full(name: str) -> torch.Tensor:
        shape = reader.logical_shape(name)
        out = torch.empty(shape, dtype=_stored_dtype(reader, name))
        reader.read_into(name, tuple(slice(0, n) for n in shape), out)
        return out

    q_width = config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    vocab = config.vocab_size
    hf = {"model.embed_tokens.weight": full("embed_tokens.weight")[:vocab], "model.norm.weight": full("norm.weight")}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        q, k, v = full(f"layers.{i}.attn.qkv_proj.weight").split([q_width, kv_width, kv_width])
        gate, up = full(f"layers.{i}.mlp.gate_up_proj.weight").chunk(2)
        hf |= {
            prefix + "input_layernorm.weight": full(f"layers.{i}.input_layernorm.weight"),
            prefix + "post_attention_layernorm.weight": full(f"layers.{i}.post_attention_layernorm.weight"),
            prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
            prefix + "self_attn.v_proj.weight": v, prefix + "self_attn.o_proj.weight": full(f"layers.{i}.attn.o_proj.weight"),
            prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
            prefix + "mlp.down_proj.weight": full(f"layers.{i}.mlp.down_proj.weight"),
        }
    if not config.tie_word_embeddings:
        hf["lm_head.weight"] = full("lm_head.weight")[:vocab]

    save_path = Path(save_path)
    save_path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(save_path / "model.safetensors"), metadata={"format": "pt"})
    hf_config = hf_config_from_llama(config, metadata["model"]["dtype"])
    (save_path / "config.json").write_text(json.dumps(hf_config, indent=2))
    _copy_tokenizer(checkpoint / "tokenizer", save_path)
    return save_path


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _stored_dtype(reader: LogicalTensorReader, name: str) -> torch.dtype:
    entry = reader.entries[name][0]
    with safe_open(str(entry.file), framework="pt") as handle:
        return SAFETENSORS_DTYPES[handle.get_slice(entry.key).get_dtype()]
