"""Llama (and Qwen2, which is Llama with q/k/v biases): a decoder of grouped-query attention and gated MLPs.

``model.py`` is the pure model, ``parallelize.py`` its tensor-parallel plan, ``costs.py`` its parameters and FLOPs,
``hf_adapter.py`` its Hugging Face mapping; ``LLAMA`` ties them together for the registry.
"""

from nanotron.config import LlamaConfig
from nanotron.models.llama.costs import llama_costs, llama_layer_activations
from nanotron.models.llama.hf_adapter import LlamaHFAdapter
from nanotron.models.llama.model import KVCache, LlamaForCausalLM, llama_init_rule
from nanotron.models.llama.parallelize import llama_plan
from nanotron.models.spec import ModelSpec

LLAMA = ModelSpec(
    name="llama",
    config_class=LlamaConfig,
    model_class=LlamaForCausalLM,
    tensor_parallel_plan=llama_plan,
    costs=llama_costs,
    layer_activations=llama_layer_activations,
    init_rule=llama_init_rule,
    hf_adapter=LlamaHFAdapter(),
    inference_cache=KVCache,
)
