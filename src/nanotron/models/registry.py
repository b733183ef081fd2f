"""The model families nanotron trains, by name (the ``model.type`` of checkpoint.json) and by config class.

To add a family: its config dataclass (``nanotron/config``, with its ``is_<name>_config`` marker), its pure model
(``models/<name>.py``), its tensor-parallel plan (``parallel/plans.py``), its Hugging Face adapter
(``checkpoint/hf_<name>.py``) and one :class:`ModelSpec` here. docs/design.md walks through it.
"""

from __future__ import annotations

from nanotron.checkpoint.hf_llama import LlamaHFAdapter, MixtralHFAdapter
from nanotron.checkpoint.hf_mamba import MambaHFAdapter
from nanotron.checkpoint.logical_tensors import CheckpointError
from nanotron.config import ConfigError, LlamaConfig, LlaMoEConfig, MambaConfig, llama_problems, mamba_problems
from nanotron.models.llama import KVCache, LlamaForCausalLM, llama_costs, llama_init_rule
from nanotron.models.mamba import (
    MambaCache,
    MambaForCausalLM,
    mamba_activation_dtype,
    mamba_costs,
    mamba_init_rule,
)
from nanotron.models.moe import (
    LlaMoEForCausalLM,
    moe_costs,
    moe_init_rule,
    router_losses,
    router_metrics,
    router_statistics_template,
)
from nanotron.models.spec import AuxiliaryLosses, ModelSpec
from nanotron.parallel.plans import llama_plan, mamba_plan, moe_plan

LLAMA = ModelSpec(
    name="llama",
    config_class=LlamaConfig,
    model_class=LlamaForCausalLM,
    tensor_parallel_plan=llama_plan,
    costs=llama_costs,
    init_rule=llama_init_rule,
    hf_adapter=LlamaHFAdapter(),
    inference_cache=KVCache,
    config_problems=llama_problems,
    # Extending the context changes max_position_embeddings and usually the RoPE theta or scaling with it.
    resume_may_change=frozenset({"max_position_embeddings", "rope_theta", "rope_scaling", "bos_token_id",
                                 "eos_token_id", "pad_token_id", "initializer_range", "use_cache"}),
)

LLAMOE = ModelSpec(
    name="llamoe",
    config_class=LlaMoEConfig,
    model_class=LlaMoEForCausalLM,
    tensor_parallel_plan=moe_plan,
    costs=moe_costs,
    init_rule=moe_init_rule,
    hf_adapter=MixtralHFAdapter(),
    inference_cache=KVCache,
    config_problems=llama_problems,
    resume_may_change=LLAMA.resume_may_change | {"moe_capacity_factor", "moe_aux_loss_coef", "moe_z_loss_coef"},
    auxiliary_losses=AuxiliaryLosses(router_losses, router_statistics_template, router_metrics),
)

MAMBA = ModelSpec(
    name="mamba",
    config_class=MambaConfig,
    model_class=MambaForCausalLM,
    tensor_parallel_plan=mamba_plan,
    costs=mamba_costs,
    init_rule=mamba_init_rule,
    hf_adapter=MambaHFAdapter(),
    inference_cache=MambaCache,
    config_problems=mamba_problems,
    resume_may_change=frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "initializer_range"}),
    activation_dtype=mamba_activation_dtype,
)

MODEL_SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in (LLAMA, LLAMOE, MAMBA)}


def spec_named(name: str, source: object) -> ModelSpec:
    """The family called ``name`` by ``source`` (a checkpoint, for the error message)."""
    if name not in MODEL_SPECS:
        raise CheckpointError(f"{source} holds a {name!r} model, which this version cannot build (it has "
                              f"{', '.join(sorted(MODEL_SPECS))})")
    return MODEL_SPECS[name]


def spec_for_config(model_config: object) -> ModelSpec:
    for spec in MODEL_SPECS.values():
        if type(model_config) is spec.config_class:
            return spec
    raise TypeError(f"no model family is registered for {type(model_config).__name__}")


def spec_for_hf_model_type(model_type: str | None, source: object) -> ModelSpec:
    for spec in MODEL_SPECS.values():
        if model_type in spec.hf_adapter.model_types:
            return spec
    known = sorted(t for spec in MODEL_SPECS.values() for t in spec.hf_adapter.model_types)
    raise CheckpointError(f"{source} describes a {model_type!r} model; supported model_type values: "
                          f"{', '.join(known)}")


def check_model_config(model_config, tp: int, source: object, **keys) -> None:
    """Refuse a model config read from ``source`` (a file) that its family cannot build at ``tp`` ranks, with one
    line per problem, before anything is allocated; ``keys`` name the fields in messages (see ``config_problems``)."""
    problems = spec_for_config(model_config).config_problems(model_config, tp, **keys)
    if problems:
        raise ConfigError(*problems, source=source)
