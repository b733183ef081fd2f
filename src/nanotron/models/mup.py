"""Spectral µP (Yang, Simon & Bernstein, 2023, "A Spectral Condition for Feature Learning"), as upstream nanotron
configures it: ``model.init_method: {use_mup: true}``.

Every matrix of a linear layer, of logical shape [fan_out, fan_in], gets

- an initial scale ``σ = 1/sqrt(fan_in) · min(1, sqrt(fan_out / fan_in))`` (normal(0, σ)), and
- a learning rate ``η · fan_out / fan_in``, ``η`` being the schedule's (``optimizer.learning_rate_scheduler``), so
  that its spectral norm and the spectral norm of its updates both grow as ``sqrt(fan_out / fan_in)``: the hidden
  features keep their size as the width grows, at initialisation and while training.

The embedding starts at normal(0, 1) and keeps the schedule's learning rate (a tied LM head is the embedding); norms
start at one and biases at zero, with the schedule's learning rate. Matrices are found by their role, the weights
that ``nn.Linear`` modules hold (an untied LM head among them: ``fan_out`` is the vocabulary), read from the model's
logical (unsplit) layout, so every layout starts from the same values and steps with the same rates. Upstream also
divides attention logits by ``head_dim`` instead of ``sqrt(head_dim)``; here they keep ``1/sqrt(head_dim)``, which
is the same rule while ``head_dim`` stays fixed as the width grows (more heads), as in upstream's example.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanotron.models.init import normal
from nanotron.models.spec import Initializer, ModelSpec

EMBEDDING_STD = 1.0


def spectral_std(fan_out: int, fan_in: int) -> float:
    """The initial standard deviation of a [fan_out, fan_in] matrix."""
    return fan_in ** -0.5 * min(1.0, math.sqrt(fan_out / fan_in))


def linear_matrices(model_config: Any, spec: ModelSpec) -> tuple[dict[str, tuple[int, int]], set[str]]:
    """The logical names and shapes [fan_out, fan_in] of the model's linear matrices, and the names of its
    embeddings (a tied LM head's weight is the embedding's), read from the unsplit model on the meta device."""
    with torch.device("meta"):
        model = spec.model_class(model_config, model_config.vocab_size)
    names = {id(param): name for name, param in model.named_parameters()}
    embeddings = {names[id(module.weight)] for module in model.modules() if isinstance(module, nn.Embedding)}
    matrices = {names[id(module.weight)]: tuple(module.weight.shape) for module in model.modules()
                if isinstance(module, nn.Linear) and names[id(module.weight)] not in embeddings}
    return matrices, embeddings


def spectral_init_rule(model_config: Any, spec: ModelSpec) -> Callable[[str], Initializer]:
    """Each parameter's initializer by logical name: spectral scales for the matrices, normal(0, 1) for the
    embeddings, the family's own rule for the rest (norms at one, biases at zero)."""
    matrices, embeddings = linear_matrices(model_config, spec)

    def rule(name: str) -> Initializer:
        if name in matrices:
            return normal(spectral_std(*matrices[name]))
        if name in embeddings:
            return normal(EMBEDDING_STD)
        return spec.init_rule(name, model_config, EMBEDDING_STD)

    return rule


def learning_rate_scales(model_config: Any, spec: ModelSpec) -> dict[str, float]:
    """The learning rate of each linear matrix over the schedule's: fan_out / fan_in (others: 1)."""
    matrices, _ = linear_matrices(model_config, spec)
    return {name: fan_out / fan_in for name, (fan_out, fan_in) in matrices.items()}
