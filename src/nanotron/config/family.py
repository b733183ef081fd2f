"""The facts of a model family that follow from its config alone, which the rest of nanotron reads off the config.

Every family config class (``llama.py``, ``moe.py``, ``qwen2.py``, ``mamba.py``) derives from :class:`FamilyFacts`
and overrides what differs from its defaults; code that needs one of these facts asks the config, never its class.
What a family does in code (its model, tensor-parallel plan, costs, initial weights, Hugging Face mapping) is its
``ModelSpec`` (``models/spec.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from nanotron.config.rules import MODEL_CONFIG_KEY

if TYPE_CHECKING:
    from nanotron.config.moe import MoESettings


class FamilyFacts:
    """The defaults: attention layers, no context limit, no logit z-loss, no document masking, hidden states in the
    model's dtype, nothing a resume may change, no experts, and every parallelism supported."""

    # Fields a run may change when it continues from a checkpoint; any other difference means other weights, and
    # loading them is refused (``checkpoint/manager.py``).
    resume_may_change: ClassVar[frozenset[str]] = frozenset()

    @property
    def attention(self) -> bool:
        """Whether the model has attention layers (their kernel is ``model.attention_backend``'s choice)."""
        return True

    @property
    def context_length(self) -> int | None:
        """The positions the model is trained for (generation refuses to go past them); None: no such limit."""
        return None

    @property
    def logit_z_loss(self) -> float:
        """The weight of the z-loss on the LM head's logits in the trained objective: the objective adds it times the
        mean over the step's tokens of logsumexp(logits)² (``parallel/cross_entropy.py``); 0: none."""
        return 0.0

    @property
    def document_masking(self) -> bool:
        """Whether attention stays inside each document packed in a sample: the model is then handed every
        micro-batch's ``document_ids`` and per-document ``position_ids`` (``data/loader.py``), which the data must
        give (a stage's ``return_positions``)."""
        return False

    @property
    def moe(self) -> MoESettings | None:
        """The mixture-of-experts blocks (``config/moe.py``'s ``MoESettings``; expert parallelism splits them), or
        None: a dense model, which ``parallelism.expert_parallel_size`` > 1 is refused for."""
        return None

    @property
    def embedding_on_head_stage(self) -> bool:
        """Whether the stage of the LM head uses the token embedding too (tied to the head, or read by modules beside
        it): under pipeline parallelism that stage then holds a copy of it, kept identical to the first stage's."""
        return getattr(self, "tie_word_embeddings", False)

    def activation_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the hidden states pipeline stages exchange, for a model in ``dtype``."""
        return dtype

    def context_parallel_refusal(self, key: str | None = MODEL_CONFIG_KEY) -> str | None:
        """Why the model cannot split a sequence over context-parallel ranks, naming the config by ``key``; None: it
        can."""
        return None

    def qk_clip_refusal(self, key: str | None = MODEL_CONFIG_KEY) -> str | None:
        """Why QK-clip (``optimizer.muon_qk_clip_threshold``) cannot bound the model's attention logits by scaling
        each head's query and key rows, naming the config by ``key``; None: it can."""
        return None
