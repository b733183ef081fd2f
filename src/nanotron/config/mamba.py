"""The Mamba family's config (Mamba-1, nanotron's and mamba_ssm's field names) and its rules."""

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from nanotron.config.family import FamilyFacts
from nanotron.config.rules import MODEL_CONFIG_KEY, at_least, positive, prefix


@dataclass
class MambaSSMArgs:
    """The selective state-space mixer of every Mamba layer (nanotron's and mamba_ssm's ``ssm_cfg``)."""

    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int | Literal["auto"] = "auto"  # "auto": ceil(d_model / 16)
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init: Literal["random", "constant"] = "random"  # how dt_proj.weight starts
    dt_scale: float = 1.0
    dt_init_floor: float = 1e-4
    conv_bias: bool = True
    bias: bool = False  # on in_proj and out_proj

    def problems(self, key: str) -> Iterator[str]:
        k = prefix(key)
        for name in ("d_state", "d_conv", "expand"):
            yield from at_least(f"{k}{name}", getattr(self, name), 1)
        if not (self.dt_rank == "auto" or (isinstance(self.dt_rank, int) and self.dt_rank >= 1)):
            yield f"{k}dt_rank must be \"auto\" or an integer >= 1 (got {self.dt_rank!r})"
        if not 0 < self.dt_min <= self.dt_max:
            yield f"{k}dt_min ({self.dt_min}) and dt_max ({self.dt_max}) must satisfy 0 < dt_min <= dt_max"
        yield from positive(f"{k}dt_init_floor", self.dt_init_floor)
        yield from positive(f"{k}dt_scale", self.dt_scale)


@dataclass
class MambaConfig(FamilyFacts):
    """Mamba-1 (Gu & Dao, 2023): pre-norm residual blocks of selective state-space mixers, no attention: no context
    limit, and a sequence is scanned in order (no context parallelism)."""

    is_mamba_config: bool = True
    d_model: int = 2560
    num_hidden_layers: int = 64
    vocab_size: int = 50277
    ssm_cfg: MambaSSMArgs = field(default_factory=MambaSSMArgs)
    rms_norm_eps: float = 1e-5  # the blocks' RMSNorm (upstream's rms_norm: false, LayerNorm, is refused)
    residual_in_fp32: bool = True
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    bos_token_id: int | None = 0
    eos_token_id: int | None = 0
    pad_token_id: int | None = 0

    resume_may_change: ClassVar[frozenset[str]] = frozenset({"bos_token_id", "eos_token_id", "pad_token_id",
                                                             "initializer_range"})

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def d_inner(self) -> int:
        return self.ssm_cfg.expand * self.d_model

    @property
    def dt_rank(self) -> int:
        rank = self.ssm_cfg.dt_rank
        return -(-self.d_model // 16) if rank == "auto" else int(rank)

    def activation_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The residual stream, which stages exchange: fp32 with ``residual_in_fp32``."""
        return torch.float32 if self.residual_in_fp32 else dtype

    @property
    def attention(self) -> bool:
        return False

    def context_parallel_refusal(self, key: str | None = MODEL_CONFIG_KEY) -> str | None:
        return f"a Mamba model ({key} with is_mamba_config: true) scans the sequence in order"

    def qk_clip_refusal(self, key: str | None = MODEL_CONFIG_KEY) -> str | None:
        return f"a Mamba model ({key} with is_mamba_config: true) has no attention"

    def problems(self, key: str | None = MODEL_CONFIG_KEY) -> Iterator[str]:
        """Rules on the values alone; the shapes are ``layout_problems``."""
        k = prefix(key)
        if not self.is_mamba_config:
            yield f"{k}is_mamba_config must be true for a Mamba model config"
        yield from self.ssm_cfg.problems(f"{k}ssm_cfg")
        yield from positive(f"{k}rms_norm_eps", self.rms_norm_eps)
        yield from positive(f"{k}initializer_range", self.initializer_range)

    def layout_problems(self, tp: int, *, key: str | None = MODEL_CONFIG_KEY, tp_key: str = "parallelism.tp",
                        **_) -> list[str]:
        """The shape rules at ``tp`` tensor-parallel ranks (see ``LlamaConfig.layout_problems``; a sequence length
        needs no rule: the model has no position limit)."""
        k = prefix(key)
        problems = [problem for name in ("vocab_size", "d_model", "num_hidden_layers")
                    for problem in at_least(f"{k}{name}", getattr(self, name), 1)]
        if not problems and tp >= 1 and self.d_inner % tp:
            problems.append(f"{k}d_model ({self.d_model}) x {k}ssm_cfg.expand ({self.ssm_cfg.expand}) = "
                            f"{self.d_inner} channels must be divisible by {tp_key} ({tp}): each TP rank holds whole "
                            "channels")
        if tp > 1 and self.ssm_cfg.bias:
            problems.append(f"{k}ssm_cfg.bias: true is not supported with {tp_key} ({tp}) > 1 (a row-parallel "
                            "out_proj bias would be added on every rank); set it to false or use tp 1")
        return problems
