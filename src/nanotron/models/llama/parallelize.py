"""How Llama is parallelised: its tensor-parallel plan, which module is split how.

A plan maps module names (matched exactly or as a dotted suffix) to a style (``parallel/tensor_parallel.py``).
Keeping the plan here, as data, leaves the model file free of any parallel code; the family's ``ModelSpec`` points
at it.
"""

from __future__ import annotations

from nanotron.config import LlamaConfig
from nanotron.parallel.tensor_parallel import Column, Row, SequenceParallelNorm, Style, VocabEmbedding


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


