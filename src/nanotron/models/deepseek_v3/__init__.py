"""DeepSeek-V3 (``is_deepseek_v3_config``; ``DeepseekV3ForCausalLM`` in transformers): Llama's decoder with
multi-head latent attention and, from ``first_k_dense_replace`` on, LlaMoE's mixture-of-experts blocks with
DeepSeek's routing (sigmoid scores, the auxiliary-loss-free balancing bias, expert groups, shared experts).

``model.py`` is the pure model, ``parallelize.py`` its tensor-parallel plan (heads split, latents replicated),
``costs.py`` its parameters and FLOPs, ``hf_adapter.py`` the Hugging Face mapping; ``DEEPSEEK_V3`` ties them together
for the registry; ``mtp.py`` and ``mtp_loss.py`` are multi-token prediction (modules, tokens ahead, loss). The balancing
bias moves after every step by the step's expert load
(``features/expert_balance.py``).
"""

from nanotron.config.deepseek_v3 import DeepseekV3Config
from nanotron.models.deepseek_v3.costs import (
    deepseek_v3_costs,
    deepseek_v3_layer_activations,
    multi_token_prediction_activations,
)
from nanotron.models.deepseek_v3.hf_adapter import DeepseekV3HFAdapter
from nanotron.models.deepseek_v3.model import DeepseekV3ForCausalLM, LatentCache
from nanotron.models.deepseek_v3.mtp import deepseek_v3_init_rule
from nanotron.models.deepseek_v3.mtp_loss import mtp_batch_transforms, mtp_terms
from nanotron.models.deepseek_v3.parallelize import deepseek_v3_plan
from nanotron.models.moe import apply_expert_parallel, router_terms
from nanotron.models.spec import ModelSpec


def deepseek_v3_terms(config) -> list:
    """The router's step terms, and multi-token prediction's where the config has its modules."""
    return router_terms(config) + mtp_terms(config)


DEEPSEEK_V3 = ModelSpec(
    name="deepseek_v3",
    config_class=DeepseekV3Config,
    model_class=DeepseekV3ForCausalLM,
    tensor_parallel_plan=deepseek_v3_plan,
    costs=deepseek_v3_costs,
    init_rule=deepseek_v3_init_rule,
    hf_adapter=DeepseekV3HFAdapter(),
    inference_cache=LatentCache,  # the kv latents and the shared rotary keys, not every head's keys and values
    step_terms=deepseek_v3_terms,
    batch_transforms=mtp_batch_transforms,
    expert_parallel=apply_expert_parallel,
    layer_activations=deepseek_v3_layer_activations,
    head_side_activations=multi_token_prediction_activations,
)
