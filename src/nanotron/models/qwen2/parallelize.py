"""How Qwen2 is parallelised: as Llama, with its mixture-of-experts blocks split as LlaMoE's (``moe_plan``: Llama's
plan where there are none). Windows and RoPE act within each head, so whole heads per tensor-parallel rank need
nothing more; the q|k|v biases are split with the rows of the fused weight. Expert parallelism is LlaMoE's
(``apply_expert_parallel``)."""

from nanotron.models.moe.parallelize import moe_plan

qwen2_plan = moe_plan
