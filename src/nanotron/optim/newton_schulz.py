"""Newton-Schulz orthogonalisation: the matrix Muon steps along, ``U S' V^T`` for a matrix ``U S V^T``, with every
singular value ``S`` moved close to 1.

The iteration is Keller Jordan's quintic: the matrix is scaled to a Frobenius norm of 1 (so every singular value
is at most 1), then each step maps ``X`` to ``a X + b (X X^T) X + c (X X^T)^2 X``, which applies the odd polynomial
``p(s) = a s + b s^3 + c s^5`` to every singular value and leaves the singular vectors alone. The default
coefficients (3.4445, -4.7750, 2.0315) make the slope at 0 as steep as possible while keeping ``p`` within about
[0.7, 1.2] on the values it reaches: after 5 steps the singular values of a well-conditioned matrix lie in that band,
not at 1 (``UNIT_BAND``). It works on the wide orientation (rows <= columns) so that ``X X^T`` is the smaller
product. A stack of matrices ([experts, rows, columns]) is orthogonalised matrix by matrix.

It runs in the dtype it is given: fp32 on CPUs, where it is the reference every layout is compared with, and bf16
on GPUs, where the products run on tensor cores (``newton_schulz_function`` compiles it there).
"""

from __future__ import annotations

import functools

import torch

QUINTIC = (3.4445, -4.7750, 2.0315)
NORM_EPS = 1e-7
UNIT_BAND = (0.6, 1.25)  # where the default quintic leaves the singular values of a matrix after 5 steps


def newton_schulz(matrix: torch.Tensor, steps: int, coefficients: tuple[float, float, float] = QUINTIC,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthogonalised ``matrix`` (or stack of matrices along the last two dims), computed in ``dtype`` and
    returned in it."""
    a, b, c = coefficients
    x = matrix.to(dtype)
    # The Frobenius norm of the stored layout, before any transpose: compiled, a reduction over the transposed view
    # of a stack of tall matrices read memory across its strides (53 ms a step for a mixtral's experts on an H100).
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + NORM_EPS)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


@functools.cache
def _compiled_newton_schulz():
    return torch.compile(newton_schulz, dynamic=True)


def newton_schulz_function(device: torch.device, compiled: bool):
    """(function, dtype) of the orthogonalisation on ``device``: compiled (``compiled``) in bf16 on CUDA, plain
    torch in fp32 elsewhere."""
    if device.type == "cuda":
        return (_compiled_newton_schulz() if compiled else newton_schulz), torch.bfloat16
    return newton_schulz, torch.float32
