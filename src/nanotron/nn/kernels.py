"""Triton, the optional dependency of the fused GPU kernels, loaded in one place for the modules that have them
(``fp8/cast_kernels.py``: the gradient casts, ``swiglu.py``: the backward, ``causal_conv1d.py`` and
``selective_scan.py``: Mamba, ``optim/adamw.py``: the update of masters held as remainders,
``parallel/linear_cross_entropy.py``: the loss's softmax statistics).

Each of them defines its kernels only when Triton loaded (``triton`` is not None) and runs them where ``available``
says so; everywhere else it runs its plain-torch reference. The kernels need Triton and a torch with
``torch.library.triton_op`` (2.6 or newer), above nanotron's floor of torch 2.4. On a CUDA device a reference run
for want of the kernels is correct but slower, so the first such call reports, once, what could not be loaded and
why. CPUs run the references by design: nothing to report.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl

    UNAVAILABLE = None
except ImportError as error:  # no Triton
    triton = tl = None
    UNAVAILABLE = f"{error} (torch {torch.__version__})"


class _Unregistered:
    """Stands in for a ``triton_op`` where no kernel can run (no CUDA device, no ``TRITON_INTERPRET=1``): the op is
    not registered, because registering imports inductor and dynamo, over a second in every process. The
    ``triton.jit`` kernels themselves are still defined, for the tests that read their IR."""

    def __init__(self, function):
        self.__wrapped__ = function

    def register_autograd(self, backward, setup_context) -> None:
        pass

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__wrapped__.__name__} is a Triton kernel: it runs on a CUDA device or under "
                           "TRITON_INTERPRET=1")


if triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    try:
        from torch.library import triton_op, wrap_triton
    except ImportError as error:  # a torch older than 2.6
        triton = tl = triton_op = wrap_triton = None
        UNAVAILABLE = f"{error} (torch {torch.__version__})"
else:
    triton_op, wrap_triton = (lambda name, mutates_args: _Unregistered), None

_reported = False


def available(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device``: a CUDA device, and Triton loaded."""
    if device.type != "cuda":
        return False
    if triton is None and not _reported:
        _report_unavailable()
    return triton is not None


def _report_unavailable() -> None:
    """Logs once. Not wrapped in ``torch.compiler.disable``: that imports dynamo (over a second) at import time in
    every process; under compilation the one call breaks the graph once, and later calls skip it."""
    global _reported
    _reported = True
    logger.warning(f"Triton kernels unavailable: {UNAVAILABLE}; the FP8 cast, SwiGLU backward, Mamba "
                   "convolution and scan, the optimizer update and the loss's softmax statistics run their plain-torch "
                   "references on CUDA (slower); install triton with torch>=2.6 for the kernels")
