"""Qwen2 (upstream nanotron's ``is_qwen2_config``; Qwen2, SmolLM3 and Qwen2-MoE in transformers): Llama with q/k/v
biases, each layer's attention full or in a sliding window and with or without RoPE, the logit z-loss, and
optionally mixtures of experts with a shared expert (``moe_config``; LlaMoE's blocks, routing and expert
parallelism, ``models/moe``).

``model.py`` is the pure model (Llama's with its own attention per layer), ``parallelize.py`` its tensor-parallel
plan (LlaMoE's, which is Llama's without experts), ``costs.py`` its parameters and FLOPs (windows bound the attended
keys), ``hf_adapter.py`` the Hugging Face mapping of the three architectures; ``QWEN2`` ties them together for the
registry.
"""

from nanotron.config import Qwen2Config
from nanotron.models.llama.model import KVCache
from nanotron.models.moe import apply_expert_parallel, moe_init_rule, router_terms
from nanotron.models.moe.costs import moe_layer_activations
from nanotron.models.qwen2.costs import qwen2_costs
from nanotron.models.qwen2.hf_adapter import Qwen2HFAdapter
from nanotron.models.qwen2.model import Qwen2ForCausalLM
from nanotron.models.qwen2.parallelize import qwen2_plan
from nanotron.models.spec import ModelSpec

QWEN2 = ModelSpec(
    name="qwen2",
    config_class=Qwen2Config,
    model_class=Qwen2ForCausalLM,
    tensor_parallel_plan=qwen2_plan,
    costs=qwen2_costs,
    # A GPU runs windows and documents as flex attention, whose block mask is shared by the layers and small (one
    # entry per 128 x 128 block): a layer keeps what Llama's (or a mixture of experts') keeps.
    layer_activations=moe_layer_activations,
    init_rule=moe_init_rule,
    hf_adapter=Qwen2HFAdapter(),
    inference_cache=KVCache,
    step_terms=router_terms,
    expert_parallel=apply_expert_parallel,
)
