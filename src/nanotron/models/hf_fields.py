"""What conversion does with each field of a Hugging Face ``config.json``, as data: per architecture (its
``model_type``), every field of transformers' config class is

- ``Read``: mapped to nanotron's config by the family's adapter, which refuses the values nanotron does not build;
- ``Ignored``: it changes neither the weights nor the logits computed from them, for the reason given;
- ``Refused``: nanotron builds it only at the values listed (transformers' default first); any other is refused by
  name before anything is written.

The families' adapters hold their tables (``hf_fields``); ``tests/test_hf_interop.py`` checks that they classify
every field of the installed transformers' config classes, so that a field added to transformers cannot be dropped
unread. A config.json key that no table names (a leftover of another library, a field of a newer transformers) is
ignored with one warning naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from nanotron.errors import CheckpointError

logger = logging.getLogger("nanotron.convert")


@dataclass(frozen=True)
class Read:
    into: str  # what it becomes in nanotron's config


@dataclass(frozen=True)
class Ignored:
    reason: str


@dataclass(frozen=True)
class Refused:
    allowed: tuple  # the values nanotron builds, transformers' default first
    reason: str


Field = Read | Ignored | Refused

# The fields of transformers' PreTrainedConfig (and the keys ``save_pretrained`` adds, and transformers 4's
# ``torch_dtype``), which every architecture's config.json may hold.
COMMON_FIELDS: dict[str, Field] = {
    "model_type": Read("the family (its adapter)"),
    "architectures": Ignored("names the head class: another head than the causal LM's stores other tensors, which "
                             "the weights check refuses"),
    "transformers_version": Ignored("the version of transformers that wrote the file"),
    "_name_or_path": Ignored("where transformers loaded the model from"),
    "dtype": Ignored("the dtype transformers loads the weights in; conversion keeps the stored tensors' dtype"),
    "torch_dtype": Ignored("transformers 4's name of dtype"),
    "output_hidden_states": Ignored("what transformers' forward returns besides the logits"),
    "output_attentions": Ignored("what transformers' forward returns besides the logits"),
    "return_dict": Ignored("the type of transformers' forward output"),
    "chunk_size_feed_forward": Ignored("splits a feed-forward over positions (the same values); these decoders "
                                       "do not read it"),
    "id2label": Ignored("labels of classification heads, which a causal LM has none of"),
    "label2id": Ignored("labels of classification heads, which a causal LM has none of"),
    "problem_type": Ignored("the loss of classification heads, which a causal LM has none of"),
    "is_encoder_decoder": Refused((False,), "nanotron builds decoder-only models"),
    "quantization_config": Refused((None,), "quantized weights are not converted; dequantize the model and save it "
                                            "in a floating-point dtype first"),
}

INITIALIZER_RANGE = Ignored("the std of transformers' initial weights: conversion takes the weights (nanotron's "
                            "init_method.std sets its own)")

# Fields of every Llama-style architecture (Llama, Qwen2, SmolLM3, Qwen2-MoE, Mixtral).
DECODER_FIELDS: dict[str, Field] = COMMON_FIELDS | {
    name: Read(name) for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                  "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "pad_token_id",
                                  "hidden_act")
} | {
    "eos_token_id": Read("eos_token_id (the first of a list)"),
    "rope_parameters": Read("rope_theta and rope_scaling"),
    "rope_theta": Read("rope_theta (transformers 4)"),
    "rope_scaling": Read("rope_scaling (transformers 4)"),
    "head_dim": Read("checked against hidden_size / num_attention_heads"),
    "initializer_range": INITIALIZER_RANGE,
    "use_cache": Ignored("whether generation keeps a KV cache: the same logits"),
    "attention_dropout": Ignored("dropout of transformers' training, never applied at inference; nanotron trains "
                                 "without it"),
}


def refused_field(hf: Mapping, fields: Mapping[str, Field]) -> str | None:
    """The first field of ``hf`` whose value its ``Refused`` entry does not allow, as one line; None if none."""
    for name, field in fields.items():
        if isinstance(field, Refused) and name in hf and hf[name] not in field.allowed:
            allowed = " or ".join("null" if value is None else repr(value) for value in field.allowed)
            return f"{name} {hf[name]!r} is not supported ({field.reason}); only {allowed} is"
    return None


def check_fields(hf: Mapping, fields: Mapping[str, Field], source: str) -> None:
    """Refuse a config.json with a field at a value nanotron does not build; warn once about keys no table names."""
    problem = refused_field(hf, fields)
    if problem is not None:
        raise CheckpointError(f"{source}: {problem}")
    unknown = sorted(str(key) for key in hf if key not in fields)
    if unknown:
        logger.warning(f"{source}: ignored the keys {', '.join(unknown)}, which are no field of transformers' "
                       f"{hf.get('model_type')} config that nanotron knows")
