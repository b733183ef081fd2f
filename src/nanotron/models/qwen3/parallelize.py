"""How Qwen3 is parallelised: as Qwen2 (``moe_plan``, and LlaMoE's expert parallelism), plus the q/k norms, whose
weights stay whole on every tensor-parallel rank (their placement is replicated) and are applied to the rank's own
heads, so their gradients are summed over TP (``HeadNorm``) in both modes."""

from nanotron.config import Qwen3Config
from nanotron.models.moe.parallelize import moe_plan
from nanotron.parallel.tensor_parallel import HeadNorm, Style


def qwen3_plan(config: Qwen3Config) -> dict[str, Style]:
    return moe_plan(config) | {"attn.q_norm": HeadNorm(), "attn.k_norm": HeadNorm()}
