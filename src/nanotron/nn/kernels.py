"""Triton, the optional dependency of the fused GPU kernels, loaded in one place for the modules that have them
(``fp8.py``: the gradient cast, ``swiglu.py``: the backward, ``causal_conv1d.py`` and ``selective_scan.py``: Mamba).

Each of them defines its kernels only when Triton loaded (``triton`` is not None) and runs them where ``available``
says so; everywhere else it runs its plain-torch reference. The kernels need Triton and a torch with
``torch.library.triton_op`` (2.6 or newer), above nanotron's floor of torch 2.4. On a CUDA device a reference run
for want of the kernels is correct but slower, so the first such call reports, once, what could not be loaded and
why. CPUs run the references by design: nothing to report.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    UNAVAILABLE = None
except ImportError as error:  # no Triton (CPU builds of torch), or a torch older than 2.6
    triton = tl = triton_op = wrap_triton = None
    UNAVAILABLE = f"{error} (torch {torch.__version__})"

_reported = False


def available(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device``: a CUDA device, and Triton loaded."""
    if device.type != "cuda":
        return False
    if triton is None:
        _report_unavailable()
    return triton is not None


@torch.compiler.disable
def _report_unavailable() -> None:
    global _reported
    if not _reported:
        _reported = True
        logger.warning(f"Triton kernels unavailable: {UNAVAILABLE}; the FP8 cast, SwiGLU backward and Mamba "
                       "convolution and scan run their plain-torch references on CUDA (slower); install triton with "
                       "torch>=2.6 for the kernels")
