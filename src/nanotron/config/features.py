"""Optional training features, each a section that is absent when unused: ``fp8`` and ``doremi``."""

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nanotron.config.rules import positive


@dataclass
class FP8Args:
    """FP8 matmuls in the decoder's linear layers and MoE experts (``nn/fp8/``); embeddings, the LM head,
    routers, norms and the loss stay in the model dtype, master weights and optimizer state in fp32."""

    enabled: bool = False
    # tensorwise or rowwise (per token and feature) from the current amax; delayed: from an amax history
    recipe: Literal["tensorwise", "rowwise", "delayed"] = "tensorwise"
    amax_history_length: int = 16  # delayed: the scale comes from the largest amax of this many last steps
    gradient_format: Literal["e4m3", "e5m2"] = "e5m2"  # of the output gradients; e4m3 for every operand with "e4m3"
    exclude_modules: list[str] = field(default_factory=list)  # regexes of module names kept in the model dtype
    log_out_of_range: bool = False  # log the shares of cast values that saturated or flushed to zero, every step

    def problems(self) -> Iterator[str]:
        if self.amax_history_length < 1:
            yield f"fp8.amax_history_length must be at least 1, got {self.amax_history_length}"
        for i, pattern in enumerate(self.exclude_modules):
            try:
                re.compile(pattern)
            except re.error as e:
                yield f"fp8.exclude_modules[{i}] ({pattern!r}) is not a valid regex: {e}"


@dataclass
class DoReMiArgs:
    """DoReMi (Xie et al., 2023): domain weights learned by a small proxy model against a reference model.

    ``domain_weights`` are the reference's fixed mixture (``examples/doremi/train_reference.py``; unset: the
    natural token shares) and the starting point of the proxy's; a larger run pastes the averaged weights of the
    proxy here. ``ref_model_resume_checkpoint_path`` is the trained reference, needed by the proxy only.
    """

    domain_names: list[str] | None = None  # None: the names of the dataset folders
    domain_weights: list[float] | None = None
    ref_model_resume_checkpoint_path: Path | None = None
    step_size: float = 1.0  # of the exponentiated-gradient update of the weights
    smoothing_param: float = 1e-3  # mixes the updated weights with the uniform ones

    def problems(self) -> Iterator[str]:
        """The section's own rules; one domain per dataset folder is a rule between sections."""
        yield from positive("doremi.step_size", self.step_size)
        if not 0 <= self.smoothing_param <= 1:
            yield f"doremi.smoothing_param must be in [0, 1] (got {self.smoothing_param})"
        if self.domain_weights is not None:
            if any(not weight >= 0 for weight in self.domain_weights):
                yield f"doremi.domain_weights must all be >= 0 (got {self.domain_weights})"
            elif abs(sum(self.domain_weights) - 1) > 1e-3:
                yield (f"doremi.domain_weights must sum to 1 (they sum to {sum(self.domain_weights):.6g}); paste "
                       "the output of `nanotron doremi average` or normalise them")
