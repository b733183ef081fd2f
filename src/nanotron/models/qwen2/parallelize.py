"""How Qwen2 is parallelised: as Llama (``llama_plan``). Windows and RoPE act within each head, so whole heads per
tensor-parallel rank need nothing more; the q|k|v biases are split with the rows of the fused weight."""

from nanotron.models.llama.parallelize import llama_plan

qwen2_plan = llama_plan
