"""The ``model`` section: which family (``model_config``, chosen by its marker), how it starts, its dtype."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch

from nanotron.config.llama import LlamaConfig
from nanotron.config.mamba import MambaConfig
from nanotron.config.moe import LlaMoEConfig
from nanotron.config.qwen2 import Qwen2Config
from nanotron.config.rules import MODEL_CONFIG_KEY, Spellings, at_least, canonical_spellings, positive

# `model.model_config` is chosen by the `is_<name>_config: true` marker it contains; add new architectures here.
MODEL_CONFIG_CLASSES: dict[str, type] = {"is_llama_config": LlamaConfig, "is_llamoe_config": LlaMoEConfig,
                                         "is_mamba_config": MambaConfig, "is_qwen2_config": Qwen2Config}

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
class ModelArgs:
    model_config: LlamaConfig | MambaConfig  # or LlamaConfig's subclasses LlaMoEConfig and Qwen2Config
    init_method: RandomInit | ExistingCheckpointInit
    dtype: DType = "bfloat16"
    make_vocab_size_divisible_by: int = 1
    ddp_bucket_cap_mb: int = 25
    compile: bool = False  # torch.compile every decoder layer and the final norm (fuses norms, rotary, SwiGLU)
    # Tokens per chunk of the fused LM head + cross-entropy (parallel/linear_cross_entropy.py); 0: logits in full
    loss_chunk_tokens: int = 8192
    attention_backend: AttentionBackend = "auto"  # nn/flash_attention.py

    def __post_init__(self) -> None:
        canonical_spellings(self)

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
        yield from self.model_config.problems(MODEL_CONFIG_KEY)
        if self.attention_backend == "fa4" and isinstance(self.model_config, MambaConfig):
            yield "model.attention_backend: fa4 needs a family with attention, Mamba has none; remove the key"

    def device_problems(self, device: torch.device) -> Iterator[str]:
        """The rules that read the device the run trains on: FlashAttention-4 asked for must run there."""
        if self.attention_backend == "fa4" and not isinstance(self.model_config, MambaConfig):
            from nanotron.nn.flash_attention import INSTALL, unavailable

            why_not = unavailable(device, self.torch_dtype(), self.model_config.head_dim)
            if why_not is not None:
                yield (f"model.attention_backend: fa4 cannot run here: {why_not}; {INSTALL} on a CUDA machine of "
                       "compute capability 9.0 or later with model.dtype bfloat16, or set attention_backend: auto")
