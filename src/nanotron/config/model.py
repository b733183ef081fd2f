"""The ``model`` section: which family (``model_config``, chosen by its marker), how it starts, its dtype."""

from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Literal

import torch

from nanotron.config.deepseek_v3 import DeepseekV3Config
from nanotron.config.llama import LlamaConfig
from nanotron.config.mamba import MambaConfig
from nanotron.config.moe import LlaMoEConfig
from nanotron.config.qwen2 import Qwen2Config
from nanotron.config.qwen3 import Qwen3Config
from nanotron.config.rules import MODEL_CONFIG_KEY, Spellings, at_least, canonical_spellings, positive

# `model.model_config` is chosen by the `is_<name>_config: true` marker it contains; add new architectures here.
MODEL_CONFIG_CLASSES: dict[str, type] = {"is_llama_config": LlamaConfig, "is_llamoe_config": LlaMoEConfig,
                                         "is_mamba_config": MambaConfig, "is_qwen2_config": Qwen2Config,
                                         "is_qwen3_config": Qwen3Config, "is_deepseek_v3_config": DeepseekV3Config}
# Keys of another family's config that a config class lacks, and what the loader's error says about them.
MISPLACED_KEYS: dict[type, tuple[frozenset[str], str]] = {
    LlamaConfig: (frozenset(f.name for f in fields(LlaMoEConfig)) - {f.name for f in fields(LlamaConfig)},
                  "mixture-of-experts fields need 'is_llamoe_config: true' in place of 'is_llama_config: true'"),
}

DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DType = Annotated[Literal["float32", "bfloat16", "float16"], Spellings(fold=str.lower, aliases=DTYPE_ALIASES)]
# auto: FlashAttention-4 where it is installed and runs the case, else torch's kernels (SDPA, flex attention)
AttentionBackend = Annotated[Literal["auto", "torch", "fa4"], Spellings(fold=str.lower)]


@dataclass
class RandomInit:
    std: float


@dataclass
class ExistingCheckpointInit:
    path: Path


@dataclass
class MambaInit:
    """Upstream's Mamba initialisation (``models/mamba/model.py``: ``upstream_mamba_init_rule``), chosen by its keys;
    ``{std}`` is the reference one."""

    initializer_range: float
    rescale_prenorm_residual: bool
    n_residuals_per_layer: int


@dataclass
class SpectralMupInit:
    """Upstream's spectral µP (``models/mup.py``): initial scales, learning rates and the attention scale that follow
    each matrix's shape, so that hyper-parameters tuned at one width hold at another."""

    use_mup: bool


@dataclass
class ModelArgs:
    # or LlamaConfig's subclasses LlaMoEConfig, Qwen2Config, Qwen3Config, DeepseekV3Config
    model_config: LlamaConfig | MambaConfig
    init_method: RandomInit | ExistingCheckpointInit | MambaInit | SpectralMupInit
    dtype: DType = "bfloat16"
    make_vocab_size_divisible_by: int = 1
    ddp_bucket_cap_mb: int = 25
    compile: bool = False  # torch.compile every decoder layer and the final norm (fuses norms, rotary, SwiGLU)
    # Tokens per chunk of the fused LM head + cross-entropy (parallel/linear_cross_entropy.py); 0: logits in full
    loss_chunk_tokens: int = 8192
    attention_backend: AttentionBackend = "auto"  # nn/flash_attention.py

    def __post_init__(self) -> None:
        canonical_spellings(self)

    def _init_method_problems(self) -> Iterator[str]:
        init, family = self.init_method, self.model_config
        if isinstance(init, MambaInit):
            if not isinstance(family, MambaConfig):
                yield ("model.init_method: {initializer_range, rescale_prenorm_residual, n_residuals_per_layer} is "
                       "upstream's Mamba initialisation, and model_config is not a Mamba model; write "
                       "init_method: {std: <number>}")
            yield from positive("model.init_method.initializer_range", init.initializer_range)
            yield from at_least("model.init_method.n_residuals_per_layer", init.n_residuals_per_layer, 1)
        if isinstance(init, SpectralMupInit):
            if init.use_mup is not True:
                yield ("model.init_method.use_mup: false is not an initialisation; remove the key and write "
                       "init_method: {std: <number>}, or set use_mup: true")
            elif isinstance(family, MambaConfig) or family.moe is not None:
                yield ("model.init_method.use_mup: spectral µP covers dense attention models (Llama, Qwen2, Qwen3), "
                       "as upstream's does; write init_method: {std: <number>} for this model")

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def problems(self) -> Iterator[str]:
        """These fields' rules and the family config's rules on its values (its shapes depend on other sections:
        ``cross_section.py``)."""
        yield from at_least("model.make_vocab_size_divisible_by", self.make_vocab_size_divisible_by, 1)
        yield from at_least("model.ddp_bucket_cap_mb", self.ddp_bucket_cap_mb, 1)
        yield from at_least("model.loss_chunk_tokens", self.loss_chunk_tokens, 0)
        if isinstance(self.init_method, RandomInit):
            yield from positive("model.init_method.std", self.init_method.std)
        yield from self._init_method_problems()
        yield from self.model_config.problems(MODEL_CONFIG_KEY)
        if self.attention_backend == "fa4" and not self.model_config.attention:
            yield "model.attention_backend: fa4 needs a family with attention, Mamba has none; remove the key"
