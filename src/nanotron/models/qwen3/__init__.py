"""Qwen3 (``is_qwen3_config``; Qwen3 and Qwen3-MoE in transformers): Qwen2 with per-head q/k RMSNorm before RoPE, its
own head size, no q/k/v biases, per-layer sliding windows, and optionally Qwen3-MoE's experts (``moe_config``;
LlaMoE's blocks, routing and expert parallelism, ``models/moe``).

``model.py`` is the pure model, ``parallelize.py`` its tensor-parallel plan (Qwen2's with the q/k norms),
``costs.py`` its parameters and FLOPs, ``hf_adapter.py`` the Hugging Face mapping of both architectures; ``QWEN3``
ties them together for the registry.
"""

from nanotron.config import Qwen3Config
from nanotron.models.llama.model import KVCache
from nanotron.models.moe import apply_expert_parallel, router_terms
from nanotron.models.qwen3.costs import qwen3_costs, qwen3_layer_activations
from nanotron.models.qwen3.hf_adapter import Qwen3HFAdapter
from nanotron.models.qwen3.model import Qwen3ForCausalLM, qwen3_init_rule
from nanotron.models.qwen3.parallelize import qwen3_plan
from nanotron.models.spec import ModelSpec

QWEN3 = ModelSpec(
    name="qwen3",
    config_class=Qwen3Config,
    model_class=Qwen3ForCausalLM,
    tensor_parallel_plan=qwen3_plan,
    costs=qwen3_costs,
    layer_activations=qwen3_layer_activations,
    init_rule=qwen3_init_rule,
    hf_adapter=Qwen3HFAdapter(),
    inference_cache=KVCache,
    step_terms=router_terms,
    expert_parallel=apply_expert_parallel,
)
