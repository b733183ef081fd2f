"""What the rest of nanotron needs to know about a model family, and the interface its models offer.

A model family is one :class:`ModelSpec` in ``models/registry.py``: its config class and what it does in code: model
class, tensor-parallel plan, costs (parameters, FLOPs per token per part, for MFU and the pipeline split), what its
layers keep for the backward (the memory planner), initial weights, Hugging Face adapter, inference cache, expert
parallelism and step terms. What follows from the config alone (context length, z-loss, document masking, the
dtype between stages, what a resume may change) is a property of the config (``config/family.py``). The trainer, the
pipeline, generation, metrics and checkpoints only talk to a model through :class:`CausalLM`, its config and its spec,
so adding a family means adding its files and one registry entry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

# Fills the full logical fp32 tensor of one parameter, drawing from the parameter's own generator.
Initializer = Callable[[torch.Tensor, torch.Generator], None]


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model as the rest of nanotron sees it.

    The four parts are named alike in every family so that pipeline stages can drop what they do not own
    (``embed_tokens`` on stage 0, ``norm`` and ``lm_head`` on the last stage, ``layers`` keyed by the global layer
    index) and tied embeddings can be found. The model holds no process group: parallelism is applied from outside.
    """

    config: Any
    padded_vocab_size: int
    embed_tokens: nn.Module | None
    layers: nn.ModuleDict
    norm: nn.Module | None
    lm_head: nn.Module | None

    def forward(self, input_ids: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                caches: dict[str, Any] | None = None, head: bool = True,
                document_ids: torch.Tensor | None = None, masks: Any = None) -> torch.Tensor:
        """The parts this stage holds: ids (first stage) or hidden states in, hidden states or logits out; a later
        stage may be handed the ids too, for the sequence's length only. ``caches`` maps layer indices to their
        inference caches (generation). ``head=False`` leaves the LM head out: the last stage returns the final norm's
        output, for a loss that applies the head itself chunk by chunk (``parallel/linear_cross_entropy.py``).
        ``document_ids`` [batch, seq] are given to configs with ``document_masking`` only, ``masks``
        (``nn.attention.AttentionMasks``) to attention families under context parallelism only."""

    def tie_weights(self) -> None:
        """Share the embedding with the LM head where the config ties them (again after modules are swapped)."""


def tie_embeddings(model: CausalLM) -> None:
    """``tie_weights`` for a family whose LM head is the embedding matrix when the config ties them (both parts
    present: a pipeline stage may hold only one of the two copies)."""
    if model.config.tie_word_embeddings and model.embed_tokens is not None and model.lm_head is not None:
        model.lm_head.weight = model.embed_tokens.weight


@dataclass(frozen=True)
class ModelCosts:
    """Per-token training FLOPs (forward and backward) of a model's parts, and its logical parameter count.

    ``layer_flops`` balances the pipeline split together with ``head_flops``; ``flops_per_token`` is the numerator
    of MFU; recomputing a layer in the backward adds a third of its FLOPs (one more forward), or, selectively, a
    third of what is not its attention kernels' (``attention_flops``, part of ``layer_flops``; none for a family
    without attention).
    """

    parameters: int
    layer_flops: tuple[float, ...]
    head_flops: float
    flops_per_token: float
    # Per decoder layer with attention: the attention kernels' FLOPs per token over whole causal sequences (part of
    # ``layer_flops`` and ``flops_per_token``; document masking replaces them by its own pairs'), the training FLOPs
    # of one (query, key) pair and the sliding window (None: every earlier key).
    attention_flops: tuple[float, ...] = ()
    attention_pair_flops: tuple[float, ...] = ()
    attention_windows: tuple[int | None, ...] = ()

    def hardware_flops_per_token(self, recompute: str = "none") -> float:
        """FLOPs the devices execute with ``parallelism.recompute``: the model's, plus one more forward of every
        decoder layer (``full``) or of all but its attention kernel (``selective``). ``pointwise`` adds none: it
        reruns only elementwise ops (norms, RoPE, SwiGLU's product, residual adds), which the model's count, of
        matmuls and attention, leaves out too."""
        if recompute in ("none", "pointwise"):
            return self.flops_per_token
        recomputed = sum(self.layer_flops) - (sum(self.attention_flops) if recompute == "selective" else 0.0)
        return self.flops_per_token + recomputed / 3

    def document_attention_flops(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The training FLOPs of every layer's attention over samples whose tokens sit at ``position_ids`` [batch,
        seq] in their documents (document masking; ``data/loader.py`` restarts them per document): each layer's
        FLOPs per pair times the pairs its window leaves (``attended_pairs``, counted once per window). A float64
        tensor on the positions' device, so that counting syncs nothing."""
        pairs = {window: attended_pairs(position_ids, window) for window in dict.fromkeys(self.attention_windows)}
        total = torch.zeros((), dtype=torch.float64, device=position_ids.device)
        for flops, window in zip(self.attention_pair_flops, self.attention_windows, strict=True):
            total = total + flops * pairs[window]
        return total

    def masked_flops_per_token(self, tokens: float, attention_flops: float, recompute: str = "none") -> float:
        """FLOPs per token (the devices', as ``hardware_flops_per_token``, with ``recompute``) of ``tokens`` whose
        attention took ``attention_flops`` (``document_attention_flops``) instead of causal attention over whole
        sequences: the linears, MLP and head cost per token what they did, and a fully recomputed layer runs its
        attention twice."""
        change = attention_flops / tokens - sum(self.attention_flops)
        attention_runs = 1 + (1 / 3 if recompute == "full" else 0)
        return self.hardware_flops_per_token(recompute) + change * attention_runs


def attended_pairs(position_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The (query, key) pairs causal attention computes when no query sees another document: a query at position p
    of its document (``position_ids``) attends to p + 1 keys, at most W with a window of W (the query's own
    included); L(L + 1) / 2 for a whole document of L tokens. A float64 scalar tensor on the positions' device."""
    keys = position_ids + 1
    if window is not None:
        keys = keys.clamp(max=window)
    return keys.sum().to(torch.float64)


@dataclass(frozen=True)
class ActivationShape:
    """One rank's share of a micro-batch, as the memory planner (``memory.py``) hands it to a family's
    ``layer_activations``: the layout decides the shares, the family what its layers keep of them."""

    tokens: int  # micro_batch_size x sequence_length / cp: this rank's part of a micro-batch
    sequence_length: int  # the whole sequence's (its keys, under context parallelism)
    tp: int
    value_bytes: int  # the model dtype's
    residual_share: float  # of the tokens of the residual stream a rank keeps (1/tp with sequence parallelism)
    linear_input_share: float  # of a column-parallel linear's input tokens it keeps (1/tp only when overlapped)
    compiled: bool  # model.compile
    # parallelism.recompute: what else than its input a recomputed layer keeps (full: nothing; selective: its
    # attention outputs; pointwise: those and its matmuls' outputs); none: everything
    recompute: str = "none"
    cp: int = 1  # parallelism.context_parallel_size: the ranks a sequence is split over


# (config, global layer index, shape) -> (kept, transient): bytes one decoder layer keeps for the backward per
# micro-batch on one rank, and the most it adds while its backward runs.
LayerActivations = Callable[[Any, int, ActivationShape], tuple[int, int]]


@dataclass(frozen=True)
class HeadSideActivations:
    """What the modules a family keeps beside the LM head (DeepSeek-V3's multi-token prediction) keep for the backward
    per micro-batch on the last stage and add during their backward (bytes), and how many more outputs of the LM head
    they compute (each kept as the main one's logits)."""

    kept: int
    transient: int
    head_outputs: int


class HFAdapter(Protocol):
    """Maps a family's checkpoints to and from Hugging Face ``transformers`` (config.json and tensor names)."""

    # Per config.json ``model_type`` this adapter reads, what becomes of each field of transformers' config class
    # (``models/hf_fields.py``)
    hf_fields: dict[str, dict[str, Any]]

    def config_fields_from_hf(self, hf_config: dict) -> dict:
        """nanotron's model-config fields for config.json's values, as found (the config loader checks their types,
        the family's rules their values); a missing key that every such config.json has raises KeyError."""

    def derived_key_problems(self, hf_config: dict, config: Any) -> list[str]:
        """One line per config.json key nanotron derives instead of reading (Llama's head_dim) that disagrees with
        ``config``, which passed the family's rules."""

    def config_for_weights(self, config: Any, stored: Mapping[str, torch.Tensor]) -> Any:
        """``config`` (read from config.json) as the stored tensors (``stored``, shapes on the meta device) say, where
        config.json may declare parts that the weights leave out (DeepSeek-V3's multi-token prediction)."""

    def config_to_hf(self, config: Any, dtype: str) -> dict: ...

    def weights_from_hf(self, tensors: Mapping[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
        """Takes each tensor it maps by indexing ``tensors`` (which may hold shapes only, on the meta device)."""

    def weights_to_hf(self, read: Callable[[str], torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
        """``read(name)`` returns the full logical tensor ``name`` (the real vocabulary rows only)."""




@dataclass(frozen=True)
class ModelSpec:
    """One model family: everything built, measured, initialised or converted differently per family."""

    name: str  # recorded in checkpoint.json as ``model.type``
    config_class: type
    model_class: Callable[[Any, int], CausalLM]  # (config, padded vocabulary size) -> model
    tensor_parallel_plan: Callable[[Any], dict]  # config -> {module name suffix: tensor-parallel style}
    costs: Callable[[Any, int, int], ModelCosts]  # (config, padded vocabulary size, sequence length)
    init_rule: Callable[[str, Any, float], Initializer]  # (logical name, config, init std) -> initializer
    hf_adapter: HFAdapter
    inference_cache: Callable[[], Any]  # a fresh cache for one decoder layer
    # the run's config -> the family's step terms (``training/objective.py``'s ``StepTerm``: a contribution to the
    # loss, statistics and metrics), beside the language-model loss: a mixture of experts' router losses
    step_terms: Callable[[Any], list] = lambda config: []
    # the model config -> the family's batch transforms (``data/batch.py``'s ``BatchTransform``), applied to every
    # micro-batch before the parallel layout's (context parallelism's cut): DeepSeek-V3's tokens ahead
    batch_transforms: Callable[[Any], list] = lambda model_config: []
    # (model on the meta device, expert-parallel group) -> None: splits the experts over the group's ranks; None for
    # a family without experts (the config rules refuse expert_parallel_size > 1 for it)
    expert_parallel: Callable[[nn.Module, Any], None] | None = None
    # What a decoder layer keeps for the backward (``LayerActivations``), which cannot be read from the parameters: the
    # memory planner's model of the family, checked against measured peaks; it raises ConfigError for a setting it
    # does not model. None: the planner refuses the family.
    layer_activations: LayerActivations | None = None
    # (config, shape) -> what the modules beside the LM head keep (``HeadSideActivations``); None: nothing beside it
    head_side_activations: Callable[[Any, ActivationShape], HeadSideActivations] | None = None
    # The family's other initialisations, by the class of ``model.init_method`` that selects each: (logical name,
    # config, init method) -> initializer (Mamba: upstream's own, ``MambaInit``)
    init_rules: dict[type, Callable[[str, Any, Any], Initializer]] = field(default_factory=dict)
