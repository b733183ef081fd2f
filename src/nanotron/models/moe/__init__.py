"""LlaMoE (Mixtral's architecture): Llama whose feed-forward blocks are mixtures of experts, with expert parallelism.

``model.py`` holds the router, the grouped experts and the router's auxiliary losses (``global_balance.py``: the
balance loss over the global batch); ``parallelize.py`` splits the blocks over tensor-parallel ranks and the experts
over expert-parallel ones; ``costs.py`` and ``hf_adapter.py`` (Mixtral) as for Llama.
"""

from nanotron.config import LlaMoEConfig
from nanotron.models.llama.model import KVCache
from nanotron.models.moe.costs import moe_costs, moe_layer_activations
from nanotron.models.moe.hf_adapter import MixtralHFAdapter
from nanotron.models.moe.model import LlaMoEForCausalLM, moe_init_rule, router_terms
from nanotron.models.moe.parallelize import apply_expert_parallel, moe_plan
from nanotron.models.spec import ModelSpec

LLAMOE = ModelSpec(
    name="llamoe",
    config_class=LlaMoEConfig,
    model_class=LlaMoEForCausalLM,
    tensor_parallel_plan=moe_plan,
    costs=moe_costs,
    layer_activations=moe_layer_activations,
    init_rule=moe_init_rule,
    hf_adapter=MixtralHFAdapter(),
    inference_cache=KVCache,
    step_terms=router_terms,
    expert_parallel=apply_expert_parallel,
)
