"""Mamba: a stack of selective state-space mixers (no attention), its residual stream optionally in fp32.

``model.py`` is the pure model (the scan and the causal convolution are kernels in ``nn/``), ``parallelize.py``
splits every mixer by channels, ``costs.py`` and ``hf_adapter.py`` as for Llama.
"""

from nanotron.config import MambaConfig, MambaInit
from nanotron.models.mamba.costs import mamba_costs, mamba_layer_activations
from nanotron.models.mamba.hf_adapter import MambaHFAdapter
from nanotron.models.mamba.model import MambaCache, MambaForCausalLM, mamba_init_rule, upstream_mamba_init_rule
from nanotron.models.mamba.parallelize import mamba_plan
from nanotron.models.spec import ModelSpec

MAMBA = ModelSpec(
    name="mamba",
    config_class=MambaConfig,
    model_class=MambaForCausalLM,
    tensor_parallel_plan=mamba_plan,
    costs=mamba_costs,
    layer_activations=mamba_layer_activations,
    init_rule=mamba_init_rule,
    init_rules={MambaInit: upstream_mamba_init_rule},
    hf_adapter=MambaHFAdapter(),
    inference_cache=MambaCache,
)
