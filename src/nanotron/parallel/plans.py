"""Tensor-parallel plans: which module of each model is split how.

A plan maps module names (matched exactly or as a dotted suffix) to a style. Keeping plans here, as data, leaves the
model files free of any parallel code; each family's ``ModelSpec`` points at its plan.
"""

from __future__ import annotations

from nanotron.config import LlamaConfig, LlaMoEConfig, MambaConfig
from nanotron.parallel.tensor_parallel import (
    Column,
    MixtureOfExperts,
    Row,
    SelectiveStateSpace,
    SequenceParallelNorm,
    Style,
    VocabEmbedding,
)


def llama_plan(config: LlamaConfig) -> dict[str, Style]:
    q_width = config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    return {
        "embed_tokens": VocabEmbedding(),
        "input_layernorm": SequenceParallelNorm(),
        # Whole heads per rank; kv heads are replicated over the ranks sharing one when tp > num_key_value_heads.
        "attn.qkv_proj": Column(chunks=(q_width, kv_width, kv_width), units=(config.head_dim,) * 3),
        "attn.o_proj": Row(),
        "post_attention_layernorm": SequenceParallelNorm(),
        "mlp.gate_up_proj": Column(chunks=(config.intermediate_size, config.intermediate_size)),
        "mlp.down_proj": Row(),
        "norm": SequenceParallelNorm(),
        "lm_head": Column(),  # vocabulary-sharded logits, consumed by the vocab-parallel cross-entropy
    }



def moe_plan(config: LlaMoEConfig) -> dict[str, Style]:
    """Llama's plan (the dense layers' MLPs included); each MoE block is split as a whole (``TensorParallelMoE``)."""
    return llama_plan(config) | {f"layers.{i}.mlp": MixtureOfExperts() for i in config.moe_layers}


def mamba_plan(config: MambaConfig) -> dict[str, Style]:
    """Every mixer split by channels (``TensorParallelMambaMixer``); the block norms and the final norm see sequence
    shards in sequence-parallel mode."""
    return {"embed_tokens": VocabEmbedding(), "mixer": SelectiveStateSpace(), "norm": SequenceParallelNorm(),
            "lm_head": Column()}
