"""The linear layer of every model, with a swappable matmul: where other number formats (FP8) plug in.

Plain layers (:class:`Linear`) and the tensor-parallel ones (``parallel/tensor_parallel.py``) all compute
``self.matmul(x, weight, bias)``, ``F.linear`` unless a module converter (``build_model(converters=...)``) sets another
function on the layers it chooses. The weights, their placements and checkpoints stay the same whatever the matmul,
so a run can switch formats when it resumes.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """``nn.Linear`` with a swappable matmul; ``chunks`` are the widths of fused outputs (q|k|v), which a model
    reads back from ``output_chunks`` (a tensor-parallel replacement reports its local widths there)."""

    matmul = staticmethod(F.linear)  # (input, weight, bias) -> output; a converter may set another per instance
    matrix_parameters = ("weight",)  # a matrix of the model (Muon orthogonalises those of the decoder)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, chunks: tuple[int, ...] | None = None):
        super().__init__(in_features, out_features, bias=bias)
        self.output_chunks = chunks or (out_features,)

    def operands(self, x):
        """The (input, weight, bias) that ``matmul`` receives: what a loss that applies the layer itself (the fused LM
        head and cross-entropy, ``parallel/linear_cross_entropy.py``) multiplies."""
        return x, self.weight, self.bias

    def forward(self, x):
        return self.matmul(*self.operands(x))
